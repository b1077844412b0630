// Owner assignment (DESIGN.md 3.4): which rank runs Newton–Schulz for each Muon matrix.
//
// Pure functions of (parameters, per-matrix costs, rank count, options): no MPI, no BLAS.
// rr and lpt are deterministic. milp runs CBC with a time limit, and what CBC finds within a
// time limit depends on machine speed, so the plan is NOT guaranteed identical when every
// rank solves it. Contract for distributed use: rank 0 calls make_plan, broadcasts
// Plan::owner (one int per parameter) and every other rank calls plan_from_owners with it
// (tests/plan/plan_mpi_test.cpp does exactly this).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dmuon/hardware_profile.hpp"
#include "dmuon/params.hpp"
#include "dmuon/tune.hpp"

namespace dmuon {

// One Muon matrix to place.
struct PlanItem {
  int param = 0;       // index into the model's ParamSpec vector
  int64_t rows = 0;    // ParamSpec::rows()
  int64_t cols = 0;    // ParamSpec::cols()
  int unit = 0;        // ParamSpec::unit (a transformer layer)
  double time_s = 0;   // predicted NS time of this matrix: its share of its same-shape batch
  int64_t bytes = 0;   // what its owner holds for it: weight, gradient and momentum in float32
  // Where the matrix lies when step() starts, from a mesh layout (plan_mesh.hpp: lay_out_on_mesh); empty when no
  // layout is given: any rank may own it and the plan counts no step() bytes (what the C++ engine's owner-aligned
  // shards need: its step moves nothing).
  std::vector<int64_t> held = {};  // per rank: elements of the matrix it holds (its piece of U before step())
  int replicas = 1;               // the ranks form `replicas` equal consecutive blocks, each holding the matrix once
};

// The ranks that may own an item: those that hold part of it ("where its shards already are": an expert's owner is
// in its expert-parallel group), every rank when its layout is unknown.
std::vector<int> candidate_owners(const PlanItem& item, int ranks);

// Bytes step() moves for an item owned by `owner`, added per rank (DMuon's all-to-all mode, float32): the pieces of
// U that the other ranks of the owner's replica hold travel to the owner, and every holder's piece of O comes back
// from it (docs/planning.md, "Meshes"). Nothing for an item without a layout.
void add_step_bytes(const PlanItem& item, int owner, std::vector<int64_t>& sent, std::vector<int64_t>& received);

// Predicted seconds to orthogonalize `batch` same-shape rows×cols matrices together.
using BatchTimeFn = std::function<double(int64_t rows, int64_t cols, int batch)>;

// Flops of NS for one rows×cols matrix on the cheaper of the two algorithms with NsOptions' defaults
// (symmetric products: SYRK, 8 upper-triangle tiles; Gram restart [2]), as the engine executes them:
// recorded by running it on the recording backend (ns_kernel_calls). For large m they approach DESIGN
// 2.3's table (m = min dim, n = max dim): standard steps·(3m²n + m³), Gram 6m²n + 2.8·steps·m³.
double ns_flops_estimate(int64_t rows, int64_t cols, int steps = 5);

// Batch time from flops at a hardware profile's Newton–Schulz rate, ns_flops · ns_efficiency (linear in the
// batch size): costs for hardware not present (hardware_profile.hpp: load_hardware_profile).
BatchTimeFn flop_batch_time(const HardwareProfile& device);
// Flops alone, in units of 10^12 (a 1 TFLOP/s device): for owners where no device is known, since
// the balancers depend only on the ratios of the costs.
BatchTimeFn relative_flop_batch_time();

// Batch times from tuned entries (tune.hpp: measured load balancing, --costs measured). Asking for a
// (shape, batch) the entries lack throws dmuon::Error naming it.
BatchTimeFn tuned_batch_time(const std::vector<TuneEntry>& entries);

// The Muon matrices of `params` as plan items. A shape's matrices are expected to run in batches of
// ceil(count/ranks) per rank, so each item's time is batch_time(shape, that batch) / that batch. With `ns_blocks`
// (per ParamSpec index; optim.hpp: muon_blocks), a matrix split for Newton–Schulz costs the sum of its blocks' times,
// each block counted among the matrices and blocks of its shape; an empty entry, or no `ns_blocks`: the whole matrix.
// A split matrix stays one item: its blocks have one owner.
std::vector<PlanItem> make_plan_items(const std::vector<ParamSpec>& params, int ranks, const BatchTimeFn& batch_time,
                                      const std::vector<std::vector<MatrixBlock>>& ns_blocks = {});

enum class Balancer { rr, lpt, milp };
std::string to_string(Balancer b);
Balancer parse_balancer(const std::string& text);  // "rr", "lpt" or "milp"

struct PlanOptions {
  Balancer balancer = Balancer::milp;
  // Memory bound: a rank holds at most (1 + memory_slack)·S/D bytes of matrices (S: all of them),
  // raised to the largest single matrix when that is bigger (else no assignment exists).
  double memory_slack = 0.25;
  // Spread each unit's matrices over distinct owners: at most ceil(n_unit/D) per rank (milp only).
  bool spread_units = false;
  // Memory beside time: > 0 lets the balancer's makespan grow by up to this fraction (0.05: 5%) to lower the
  // fullest rank's bytes (balance_memory, after the balancer); 0: time alone.
  double memory_balance = 0;
  double time_limit_s = 2.0;  // milp: CBC's wall-clock limit
  double relative_gap = 1e-4; // milp: stop once within this fraction of CBC's best bound
  bool verbose = false;       // milp: CBC's log on stdout
};

// Same-shape matrices one rank runs together.
struct PlanBatch {
  int64_t rows = 0, cols = 0;
  std::vector<int> params;  // ParamSpec indices, ascending
  double time_s = 0;        // sum of the items' times
};

struct RankPlan {
  double time_s = 0;    // predicted NS time of all its matrices
  int64_t bytes = 0;    // bytes of the matrices it owns
  int64_t step_sent_bytes = 0;      // what step() sends from it (add_step_bytes; 0 without a layout)
  int64_t step_received_bytes = 0;  // what step() delivers to it
  std::vector<PlanBatch> batches;
};

struct Plan {
  int ranks = 0;
  Balancer balancer = Balancer::milp;  // what was asked for
  double memory_balance = 0;           // PlanOptions::memory_balance in force (0: time alone)
  bool fell_back = false;              // milp did not improve on its LPT start, failed, or was infeasible
  std::string note;                    // why it fell back, or CBC's status
  std::vector<int> owner;              // per ParamSpec index: owning rank, −1 for AdamW parameters
  std::vector<RankPlan> per_rank;
  double makespan_s = 0;               // max over ranks of time_s
  // max(Σt/D, max t, t_(D) + t_(D+1)): a valid lower bound on any assignment's makespan; the last
  // term (items sorted by time, descending, when there are more than D) because two of the D+1
  // largest must share a rank.
  double lower_bound_s = 0;
  double gap_pct = 0;                  // 100·(makespan − lower bound)/lower bound
  bool proven_optimal = false;         // the makespan equals the lower bound, or CBC proved optimality
  int64_t memory_cap_bytes = 0;        // the memory bound in force
  bool memory_ok = true;               // every rank within memory_cap_bytes
  double solve_s = 0;                  // time the balancer took
};

// Assignments: rank per item, items in the order given; every item on one of its candidate_owners.
std::vector<int> balance_rr(const std::vector<PlanItem>& items, int ranks);
// Longest first onto the least-loaded candidate that still has memory room (any candidate when none has); of equally
// loaded ones, the one that holds the most of it (the fewest step() bytes), then the lowest rank.
std::vector<int> balance_lpt(const std::vector<PlanItem>& items, int ranks, int64_t memory_cap_bytes);

// Memory beside time: starting from `assignment`, moves a matrix of the fullest rank (the most bytes) to another
// rank, or swaps it for a smaller one there, choosing each time the change that leaves the two ranks least full,
// while the change lowers the fullest rank's bytes and keeps both ranks' times within time_cap_s (and, with
// spread_units, every unit's spread); stops when none does. So the fullest rank never gets fuller, and a rank's
// time passes time_cap_s only if it did before. Every item stays on one of its candidate_owners.
std::vector<int> balance_memory(const std::vector<PlanItem>& items, int ranks, std::vector<int> assignment,
                                double time_cap_s, bool spread_units = false);

// Builds a plan with the chosen balancer (milp: warm-started from LPT, falling back to it), then, with
// options.memory_balance > 0, weighs memory in it (weigh_memory).
Plan make_plan(const std::vector<ParamSpec>& params, const std::vector<PlanItem>& items, int ranks,
               const PlanOptions& options);

// by_time, a plan of these items by time alone, with memory weighed: balance_memory from its owners within
// (1 + options.memory_balance)·its makespan; its balancer, note and fall-back kept. Both plans of one solve, for a
// caller that shows them side by side (milp's solve stops at a time limit, so two solves may differ).
Plan weigh_memory(const std::vector<ParamSpec>& params, const std::vector<PlanItem>& items, int ranks,
                  const Plan& by_time, const PlanOptions& options);

// Rebuilds the plan's per-rank figures from an owner vector (e.g. received from rank 0).
// Throws dmuon::Error when `owner` does not fit `params` (wrong size, a matrix without a valid rank).
Plan plan_from_owners(const std::vector<ParamSpec>& params, const std::vector<PlanItem>& items, int ranks,
                      const std::vector<int>& owner, const PlanOptions& options);

// Owners without a solver or measurements (a caller of shard::ShardedParams with no plan of its own, the
// tests): make_plan with the lpt balancer
// (default memory slack) on flop costs (ns_flops_estimate on the "cpu-dev" profile; only their ratios
// matter). Deterministic: every rank computes the same table without communicating. −1 for
// elementwise parameters.
std::vector<int> default_owners(const std::vector<ParamSpec>& params, int ranks);

// The memory bound of PlanOptions::memory_slack for these items.
int64_t memory_cap_bytes(const std::vector<PlanItem>& items, int ranks, double memory_slack);

}  // namespace dmuon
