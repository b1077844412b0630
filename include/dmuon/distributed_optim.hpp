// Muon and AdamW over sharded parameters (include/dmuon/shard.hpp): the optimizer updates this rank's
// shard in place after finish_backward(); the next gather delivers the updated weights to all ranks.
//
//   shard::ShardedParams params(comm, registry, {shard::Layout::owner_aligned, shard::Mode::z3});
//   dmuon::DMuon optimizer(comm, params, options);
//   for (...) { /* hooks: forward, backward, finish_backward() */ optimizer.step(); }
//
// Both variants hold, per parameter, the piece of it in this rank's shard (possibly none). AdamW
// runs on those pieces; the global gradient norm and the non-finite decision are all-reduced, so
// every rank clips by the same factor and skips (or fails) the same step.
//   DMuon: owner-aligned layout (any mode, replicated included). Every Muon matrix lies whole in its
//     owner's shard, so the owner alone runs momentum + NS + update, batching same-shape matrices;
//     no extra communication.
//   MuonGatherCompute: the baseline of DESIGN 3.2 on the even layout. Each rank runs momentum on its
//     slices, all-gathers the full momentum updates U of every Muon matrix (one all_gatherv), runs
//     NS on all of them (the same engine and thread settings as DMuon) and applies its slices.
//   ShardedAdamW: AdamW on every parameter's piece (the AdamW-only baseline of `dmuon bench optimizer`).
// Both Muon variants equal single-process dmuon::Muon up to float32 rounding
// (tests/optim/distributed_optim_mpi_test.cpp). Checkpoints (include/dmuon/checkpoint.hpp) save each rank's
// pieces and load into any variant, layout or world size; load before the next gather, which then
// delivers the loaded weights to every rank.
#pragma once

#include <memory>

#include "dmuon/comm.hpp"
#include "dmuon/optim.hpp"
#include "dmuon/shard.hpp"

namespace dmuon {

class ShardedOptimizer : public Optimizer {
 public:
  // Collective. `params` must outlive the optimizer.
  ShardedOptimizer(std::shared_ptr<comm::Comm> comm, shard::ShardedParams& params, OptimizerOptions options,
                   Orthogonalizer orth);
  void sum_across_ranks(std::span<double> values) override;

 protected:
  // This rank's piece of the slot's parameter, asked of ShardedParams (local_params, local_grads) each time.
  float* values_of(const Slot& s) const override;
  const float* grad_of(const Slot& s) const override;
  comm::Comm& comm() { return *comm_; }
  shard::ShardedParams& sharded() { return params_; }

 private:
  std::shared_ptr<comm::Comm> comm_;
  shard::ShardedParams& params_;
};

// AdamW on every parameter's local piece, whatever its role (any layout and mode).
class ShardedAdamW : public ShardedOptimizer {
 public:
  ShardedAdamW(std::shared_ptr<comm::Comm> comm, shard::ShardedParams& params, OptimizerOptions options);
};

class DMuon : public ShardedOptimizer {
 public:
  // NS from include/dmuon/ns.hpp with options.muon.ns.
  DMuon(std::shared_ptr<comm::Comm> comm, shard::ShardedParams& params, OptimizerOptions options);
  DMuon(std::shared_ptr<comm::Comm> comm, shard::ShardedParams& params, OptimizerOptions options,
        Orthogonalizer orth);
};

class MuonGatherCompute : public ShardedOptimizer {
 public:
  MuonGatherCompute(std::shared_ptr<comm::Comm> comm, shard::ShardedParams& params, OptimizerOptions options);
  MuonGatherCompute(std::shared_ptr<comm::Comm> comm, shard::ShardedParams& params, OptimizerOptions options,
                    Orthogonalizer orth);

 protected:
  std::vector<MuonMatrix> muon_matrices() override;  // every Muon matrix, whole
  void prepare_muon_inputs(float grad_scale, std::span<MuonMatrix> matrices) override;

 private:
  std::vector<std::vector<ParamRef>> pieces_;  // [rank][k]: rank's piece of the k-th Muon matrix
  std::vector<int64_t> counts_;                // [rank]: values of its pieces, all matrices
  Buffer send_, recv_;                         // my pieces' U; every rank's, rank by rank
};

}  // namespace dmuon
