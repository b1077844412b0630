// One place that builds the optimizer stack of a kind (include/dmuon/optimizer_factory.hpp).
#include "dmuon/optimizer_factory.hpp"

#include "dmuon/distributed_optim.hpp"
#include "dmuon/error.hpp"
#include "io/enum_names.hpp"

namespace dmuon {

namespace {
constexpr EnumName<OptimKind> kOptimKindNames[] = {{OptimKind::adamw, "adamw"},
                                                   {OptimKind::muon, "muon"},
                                                   {OptimKind::muon_gather, "muon-gather"},
                                                   {OptimKind::dmuon, "dmuon"}};
}  // namespace

std::string_view to_string(OptimKind kind) { return name_of(kOptimKindNames, kind); }
OptimKind parse_optim_kind(std::string_view text) { return parse_name(kOptimKindNames, "optimizer", text); }

OptimizerStack make_optimizer_stack(std::shared_ptr<comm::Comm> comm, const std::vector<ParamSpec>& specs,
                                    const OptimizerStackOptions& options) {
  DMUON_CHECK(comm != nullptr, "make_optimizer_stack needs a communicator (a world of one: comm::self())");
  const OptimKind kind = options.kind;
  DMUON_CHECK(kind != OptimKind::muon || comm->size() == 1, "OptimizerStackOptions.kind muon is single-process (here ",
              comm->size(), " ranks): use dmuon or muon-gather");
  std::vector<int> owners = options.owners;
  if (kind == OptimKind::dmuon) {
    DMUON_CHECK(owners.size() == specs.size(), "dmuon needs an owner per parameter (the planner's), got ",
                owners.size(), " for ", specs.size(), " parameters");
  } else {
    DMUON_CHECK(owners.empty(), "OptimizerStackOptions.kind ", to_string(kind), " places no owners, got ",
                owners.size());
  }
  if (kind == OptimKind::muon) {  // one rank owns every matrix
    for (const ParamSpec& s : specs) owners.push_back(s.role == ParamRole::matrix ? 0 : -1);
  }
  const bool owner_aligned = kind == OptimKind::dmuon || kind == OptimKind::muon;

  shard::ParamRegistry registry;
  for (const ParamSpec& s : specs) registry.add(s);
  const shard::ShardOptions shard_options{owner_aligned ? shard::Layout::owner_aligned : shard::Layout::even,
                                          options.mode, options.grad_reduce, options.two_stage, options.backend};
  OptimizerStack stack;
  stack.params = std::make_unique<shard::ShardedParams>(comm, std::move(registry), shard_options, std::move(owners));
  const Orthogonalizer orth = options.orth ? options.orth : ns_orthogonalizer(options.optimizer.muon.ns);
  switch (kind) {
    case OptimKind::adamw:
      stack.optimizer = std::make_unique<ShardedAdamW>(comm, *stack.params, options.optimizer);
      break;
    case OptimKind::muon_gather:
      stack.optimizer = std::make_unique<MuonGatherCompute>(comm, *stack.params, options.optimizer, orth);
      break;
    case OptimKind::muon:
    case OptimKind::dmuon:
      stack.optimizer = std::make_unique<DMuon>(comm, *stack.params, options.optimizer, orth);
      break;
  }
  return stack;
}

}  // namespace dmuon
