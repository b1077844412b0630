// One place that builds the optimizer stack of a kind (include/dmuon/optimizer_factory.hpp).
#include "dmuon/optimizer_factory.hpp"

#include <array>
#include <string>

#include "dmuon/distributed_optim.hpp"
#include "dmuon/error.hpp"

namespace dmuon {

namespace {

using MakeOptimizer = std::unique_ptr<Optimizer> (*)(std::shared_ptr<comm::Comm> comm, shard::ShardedParams& params,
                                                     const OptimizerOptions& options, const Orthogonalizer& orth);

struct KindRow {
  OptimKindInfo info;
  MakeOptimizer make;
};

// Every kind, one row each, in OptimKind's order: its name, the trainer's default learning rate, what it asks
// of the ranks and the shards, and its optimizer over the sharded parameters.
constexpr KindRow kKinds[] = {
    {{OptimKind::adamw, "adamw", 3e-3, false, false, false},
     [](std::shared_ptr<comm::Comm> comm, shard::ShardedParams& params, const OptimizerOptions& options,
        const Orthogonalizer&) -> std::unique_ptr<Optimizer> {
       return std::make_unique<ShardedAdamW>(comm, params, options);
     }},
    // Single-process Muon is DMuon with every matrix owned by the one rank.
    {{OptimKind::muon, "muon", 0.02, true, false, true},
     [](std::shared_ptr<comm::Comm> comm, shard::ShardedParams& params, const OptimizerOptions& options,
        const Orthogonalizer& orth) -> std::unique_ptr<Optimizer> {
       return std::make_unique<DMuon>(comm, params, options, orth);
     }},
    {{OptimKind::muon_gather, "muon-gather", 0.02, false, false, false},
     [](std::shared_ptr<comm::Comm> comm, shard::ShardedParams& params, const OptimizerOptions& options,
        const Orthogonalizer& orth) -> std::unique_ptr<Optimizer> {
       return std::make_unique<MuonGatherCompute>(comm, params, options, orth);
     }},
    {{OptimKind::dmuon, "dmuon", 0.02, false, true, true},
     [](std::shared_ptr<comm::Comm> comm, shard::ShardedParams& params, const OptimizerOptions& options,
        const Orthogonalizer& orth) -> std::unique_ptr<Optimizer> {
       return std::make_unique<DMuon>(comm, params, options, orth);
     }},
};

constexpr bool in_enum_order() {
  for (std::size_t i = 0; i < std::size(kKinds); ++i)
    if (static_cast<std::size_t>(kKinds[i].info.kind) != i) return false;
  return true;
}
static_assert(in_enum_order(), "kKinds: one row per OptimKind, in the enum's order");

constexpr auto kInfos = [] {
  std::array<OptimKindInfo, std::size(kKinds)> out{};
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = kKinds[i].info;
  return out;
}();

const KindRow& row_of(OptimKind kind) {
  const auto i = static_cast<std::size_t>(kind);
  DMUON_CHECK(i < std::size(kKinds), "unknown OptimKind ", static_cast<int>(kind));
  return kKinds[i];
}

}  // namespace

std::span<const OptimKindInfo> optim_kinds() { return kInfos; }
const OptimKindInfo& optim_kind_info(OptimKind kind) { return row_of(kind).info; }

std::string_view to_string(OptimKind kind) {
  const auto i = static_cast<std::size_t>(kind);
  return i < kInfos.size() ? kInfos[i].name : "?";
}

OptimKind parse_optim_kind(std::string_view text) {
  std::string valid;
  for (const OptimKindInfo& k : kInfos) {
    if (text == k.name) return k.kind;
    valid += (valid.empty() ? "" : ", ") + std::string(k.name);
  }
  DMUON_FAIL("unknown optimizer '", text, "' (valid: ", valid, ")");
}

OptimizerStack make_optimizer_stack(std::shared_ptr<comm::Comm> comm, const std::vector<ParamSpec>& specs,
                                    const OptimizerStackOptions& options) {
  DMUON_CHECK(comm != nullptr, "make_optimizer_stack needs a communicator (a world of one: comm::self())");
  const KindRow& row = row_of(options.kind);
  const OptimKindInfo& kind = row.info;
  DMUON_CHECK(!kind.single_process || comm->size() == 1, "OptimizerStackOptions.kind ", kind.name,
              " is single-process (here ", comm->size(), " ranks): use dmuon or muon-gather");
  std::vector<int> owners = options.owners;
  if (kind.takes_owners) {
    DMUON_CHECK(owners.size() == specs.size(), kind.name, " needs an owner per parameter (the planner's), got ",
                owners.size(), " for ", specs.size(), " parameters");
  } else {
    DMUON_CHECK(owners.empty(), "OptimizerStackOptions.kind ", kind.name, " places no owners, got ", owners.size());
  }
  if (kind.owner_aligned && !kind.takes_owners) {  // one rank owns every matrix
    for (const ParamSpec& s : specs) owners.push_back(s.role == ParamRole::matrix ? 0 : -1);
  }

  shard::ParamRegistry registry;
  for (const ParamSpec& s : specs) registry.add(s);
  const shard::ShardOptions shard_options{kind.owner_aligned ? shard::Layout::owner_aligned : shard::Layout::even,
                                          options.mode, options.grad_reduce, options.two_stage, options.backend};
  OptimizerStack stack;
  stack.params = std::make_unique<shard::ShardedParams>(comm, std::move(registry), shard_options, std::move(owners));
  const Orthogonalizer orth = options.orth ? options.orth : ns_orthogonalizer(options.optimizer.muon.ns);
  stack.optimizer = row.make(comm, *stack.params, options.optimizer, orth);
  return stack;
}

}  // namespace dmuon
