// The optimizer stack of one kind: the sharded parameters (shard.hpp) and the optimizer over them
// (distributed_optim.hpp), built the same way for a world of one and for many ranks. The GPT trainer
// (trainer.hpp) and `dmuon bench optimizer` build theirs here.
//
//   adamw        ShardedAdamW on every parameter over even shards (FSDP/ZeRO + AdamW: the baseline)
//   muon         single-process Muon (matrices) + AdamW (the rest): a world of one only. Built as DMuon
//                with every matrix owned by that one rank, which is the single-process definition
//                (tests/optim/optimizer_factory_mpi_test.cpp compares it with dmuon::Muon)
//   muon-gather  MuonGatherCompute over even shards: gather-then-compute (DESIGN 3.2)
//   dmuon        DMuon over owner-aligned shards: each matrix updated by its owner alone (DESIGN 3.1);
//                the owners come from the planner (plan.hpp: plan_across_ranks)
//
//   auto stack = dmuon::make_optimizer_stack(comm, specs, {.kind = dmuon::OptimKind::dmuon, .owners = plan.owner});
//   on GPUs: gpu = backend_for(DeviceKind::cuda, comm::rank_device(*mpi_world)), comm = comm::nccl_world(mpi_world, gpu)
//   and .backend = &gpu (comm_nccl.hpp)
//   for (int p = 0; p < n; ++p) stack.params->load_full(p, initial[p]);
//   for (...) { /* forward and backward through stack.params' hooks */ stack.optimizer->step(); }
#pragma once

#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "dmuon/comm.hpp"
#include "dmuon/ns.hpp"
#include "dmuon/optim.hpp"
#include "dmuon/params.hpp"
#include "dmuon/shard.hpp"

namespace dmuon {

enum class OptimKind { adamw, muon, muon_gather, dmuon };
std::string_view to_string(OptimKind kind);
// "adamw" | "muon" | "muon-gather" | "dmuon"; throws dmuon::Error naming the accepted values.
OptimKind parse_optim_kind(std::string_view text);

// What the library knows of a kind, one row each (src/optim/optimizer_factory.cpp: kKinds, where each row also
// names the function that builds its optimizer). A new kind is its enumerator above and its row there;
// the tests iterate tests/support/optimizer_kinds.hpp's table, one row a kind too.
struct OptimKindInfo {
  OptimKind kind = OptimKind::dmuon;
  const char* name = "";      // to_string, parse_optim_kind, `dmuon train --optim`
  double default_lr = 0;      // the trainer's peak learning rate when none is given (trainer.hpp: default_lr)
  bool single_process = false;  // a world of one only (muon)
  bool takes_owners = false;    // needs OptimizerStackOptions::owners, one per parameter (dmuon); others refuse owners
  bool owner_aligned = false;   // owner-aligned shards, each matrix whole on one rank (without owners: rank 0's)
};
std::span<const OptimKindInfo> optim_kinds();  // every kind, in OptimKind's order
const OptimKindInfo& optim_kind_info(OptimKind kind);

struct OptimizerStackOptions {
  OptimKind kind = OptimKind::dmuon;
  shard::Mode mode = shard::Mode::z3;                    // how parameters are gathered (shard.hpp)
  ReduceOp grad_reduce = ReduceOp::average;  // sum or average over ranks
  bool two_stage = true;                                 // two-stage gradient reduce on two-level topologies
  OptimizerOptions optimizer;                            // adamw: every parameter goes to AdamW
  Orthogonalizer orth;                                   // Muon kinds; empty: ns_orthogonalizer(optimizer.muon.ns)
  std::vector<int> owners;  // dmuon: the owning rank of each parameter, −1 for elementwise; others: empty
  // Where parameters, gradients and optimizer state live and every update runs; null: the CPU. A GPU backend
  // needs a communicator that takes its memory (comm_nccl.hpp: one GPU per rank, rank_device + nccl_world).
  Backend* backend = nullptr;
};

struct OptimizerStack {
  std::unique_ptr<shard::ShardedParams> params;  // this rank's shards; parameters start at zero (load_full)
  std::unique_ptr<Optimizer> optimizer;          // updates params' shards in place; holds a reference to params
};

// Collective: every rank passes the same specs and options. Throws dmuon::Error for muon on several
// ranks, for dmuon without an owner per parameter (or owners given to another kind), and for a device
// backend with a communicator that takes host memory only.
OptimizerStack make_optimizer_stack(std::shared_ptr<comm::Comm> comm, const std::vector<ParamSpec>& specs,
                                    const OptimizerStackOptions& options);

}  // namespace dmuon
