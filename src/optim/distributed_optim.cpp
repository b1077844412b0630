// Optimizers over sharded parameters (include/dmuon/distributed_optim.hpp).
#include "dmuon/distributed_optim.hpp"

#include <map>

#include "dmuon/error.hpp"

namespace dmuon {

namespace {

// Rank `rank`'s piece of every registry parameter (count 0 where it holds none), in registry order. No
// pointers: the optimizer asks ShardedParams for the piece's memory whenever it touches it.
std::vector<ParamRef> local_refs(const shard::ShardedParams& params, int rank) {
  const std::vector<ParamSpec>& specs = params.registry().specs();
  std::vector<ParamRef> refs(specs.size());
  std::vector<bool> seen(specs.size(), false);
  for (size_t p = 0; p < specs.size(); ++p) refs[p] = {specs[p], nullptr, nullptr, 0, 0};
  for (int unit = 0; unit < params.num_units(); ++unit) {
    for (const shard::LocalPiece& piece : params.layout(unit).local_pieces(rank)) {
      DMUON_CHECK(!seen[piece.param], "parameter '", specs[piece.param].name, "' has more than one piece in rank ",
                  rank, "'s shard; the optimizer expects one contiguous piece per rank");
      seen[piece.param] = true;
      refs[piece.param].offset = piece.offset_in_param;
      refs[piece.param].count = piece.length;
    }
  }
  return refs;
}

}  // namespace

ShardedOptimizer::ShardedOptimizer(std::shared_ptr<comm::Comm> comm, shard::ShardedParams& params,
                                   OptimizerOptions options, Orthogonalizer orth)
    : Optimizer(local_refs(params, comm->rank()), std::move(options), std::move(orth), params.backend()),
      comm_(std::move(comm)),
      params_(params) {
  rank_ = comm_->rank();
  world_size_ = comm_->size();
}

void ShardedOptimizer::sum_across_ranks(std::span<double> values) {
  comm_->all_reduce<double>(values, ReduceOp::sum).wait();
}

float* ShardedOptimizer::values_of(const Slot& s) const {
  return s.ref.count == 0 ? nullptr : params_.local_params(s.index).data();
}

const float* ShardedOptimizer::grad_of(const Slot& s) const {
  return s.ref.count == 0 ? nullptr : params_.local_grads(s.index).data();
}

ShardedAdamW::ShardedAdamW(std::shared_ptr<comm::Comm> comm, shard::ShardedParams& params, OptimizerOptions options)
    : ShardedOptimizer(std::move(comm), params, all_adamw(std::move(options)), Orthogonalizer{}) {}

DMuon::DMuon(std::shared_ptr<comm::Comm> comm, shard::ShardedParams& params, OptimizerOptions options)
    : DMuon(std::move(comm), params, options, ns_orthogonalizer(options.muon.ns)) {}

DMuon::DMuon(std::shared_ptr<comm::Comm> comm, shard::ShardedParams& params, OptimizerOptions options,
             Orthogonalizer orth)
    : ShardedOptimizer(std::move(comm), params, std::move(options), std::move(orth)) {
  // Both conditions are the same on every rank, so every rank refuses alike.
  DMUON_CHECK(params.options().layout == shard::Layout::owner_aligned,
              "DMuon needs the owner-aligned layout (the even layout splits matrices: use MuonGatherCompute)");
  for (const Slot& s : slots()) {
    DMUON_CHECK(s.group != OptimGroup::muon || s.ref.spec.role == ParamRole::matrix, "parameter '", s.ref.spec.name,
                "' is in the Muon group but its role is elementwise, so the owner-aligned layout splits it; "
                "give it role matrix to update it with DMuon");
  }
}

MuonGatherCompute::MuonGatherCompute(std::shared_ptr<comm::Comm> comm, shard::ShardedParams& params,
                                     OptimizerOptions options)
    : MuonGatherCompute(std::move(comm), params, options, ns_orthogonalizer(options.muon.ns)) {}

MuonGatherCompute::MuonGatherCompute(std::shared_ptr<comm::Comm> comm, shard::ShardedParams& params,
                                     OptimizerOptions options, Orthogonalizer orth)
    : ShardedOptimizer(std::move(comm), params, std::move(options), std::move(orth)) {
  // Every rank's piece of every Muon matrix (pure layout arithmetic, the same on every rank).
  pieces_.resize(world_size_);
  for (int r = 0; r < world_size_; ++r) {
    const std::vector<ParamRef> refs = local_refs(params, r);
    for (size_t p = 0; p < refs.size(); ++p) {
      if (slots()[p].group == OptimGroup::muon) pieces_[r].push_back(refs[p]);
    }
  }
}

std::vector<Optimizer::MuonMatrix> MuonGatherCompute::muon_matrices() {
  std::vector<MuonMatrix> out;
  for (Slot& s : slots()) {
    if (s.group != OptimGroup::muon) continue;
    out.push_back({s.ref.count > 0 ? &s : nullptr, &s.ref.spec, Buffer(backend(), DType::f32, s.ref.spec.numel()),
                   s.muon_options});
  }
  counts_.assign(world_size_, 0);
  int64_t total = 0;
  for (int r = 0; r < world_size_; ++r) {
    for (const ParamRef& piece : pieces_[r]) counts_[r] += piece.count;
    total += counts_[r];
  }
  send_ = Buffer(backend(), DType::f32, counts_[rank_]);
  recv_ = Buffer(backend(), DType::f32, total);
  return out;
}

void MuonGatherCompute::prepare_muon_inputs(float grad_scale, std::span<MuonMatrix> matrices) {
  // Momentum on my pieces, packed in matrix order (registry order, as pieces_): my block of the all-gather.
  int64_t at = 0;
  for (MuonMatrix& m : matrices) {
    if (!m.slot) continue;
    momentum_into(*m.slot, grad_scale, send_.f32() + at);
    at += m.slot->ref.count;
  }
  comm().all_gatherv<float>({send_.f32(), size_t(send_.size())}, {recv_.f32(), size_t(recv_.size())}, counts_).wait();
  // Reassemble every whole U: rank r's block holds its pieces in matrix order.
  int64_t block = 0;
  for (int r = 0; r < world_size_; ++r) {
    int64_t in_block = block;
    for (size_t k = 0; k < matrices.size(); ++k) {
      const ParamRef& piece = pieces_[r][k];
      backend().copy(matrices[k].full.f32() + piece.offset, recv_.f32() + in_block, piece.count * sizeof(float));
      in_block += piece.count;
    }
    block += counts_[r];
  }
}

}  // namespace dmuon
