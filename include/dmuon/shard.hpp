// Sharded parameters: a registry of ParamSpec, per-unit packed buffers sharded across ranks
// (layouts in shard_layout.hpp), and the gather / release / reduce operations a training loop
// drives through five hooks (before_forward, after_forward, before_backward, after_backward,
// finish_backward). Talks to other ranks only through dmuon::comm::Comm.
//
// Buffers per unit u on rank r (float32, in the memory of ShardOptions::backend: host or GPU):
//   shard params  (layout.shard_size(r)): persistent; the optimizer updates them in place.
//   packed params (layout.total()): the gathered unit; exists between gather(u) and release(u).
//   packed grads  (layout.total()): written through grad(p) during backward; freed when the
//                  reduce completes.
//   shard grads   (layout.shard_size(r)): the reduced gradients of my shard (sum or mean over
//                  ranks, ShardOptions::grad_reduce). With the owner-aligned layout these are
//                  the full reduced gradients of the matrices I own.
// param(p)/grad(p) are full, contiguous views (DeviceSpan: in backend memory, which on a GPU the host
// reaches only by copies). A parameter stored as one segment of the packed buffer is viewed in place; one cut into
// several segments (an elementwise parameter spread over several shards in the owner-aligned layout)
// is copied out of the packed buffer after the gather (and into it before the reduce), which costs
// only its own bytes. The host touches none of these buffers: every copy is a backend operation.
//
// Modes:
//   z3: a unit is released after its forward and gathered again for its backward.
//   z2: a unit stays gathered from its forward until its backward ends.
//   replicated: every rank keeps every packed buffer; gradients are all-reduced (every rank gets
//     the full reduced gradient; shard_grads(u) views my shard of it); owners update their shard
//     (shard_params(u) views my shard of the packed parameters) and gather(u) all-gathers the
//     updated shards in place.
//
// Uneven owner-aligned shards (DESIGN 3.1): gathers and reduces use comm's all_gatherv /
// reduce_scatterv, so the strategy is Options::v_algorithm of the communicator: native MPI
// (the default, measured no worse on one machine) or per_owner (one broadcast from / reduce to
// each owner, about unit bytes / bandwidth instead of (D−1)·largest shard / bandwidth on a ring
// network). `dmuon bench comm` measures both on uneven blocks; see comm.hpp for the figures.
//
// Two-stage reduce: with several nodes of several ranks (Comm::topology().two_level(), e.g.
// DMUON_RANKS_PER_NODE=2 at 4 ranks) reduce_grads reduces inside each node first, then across
// nodes (comm::reduce_scatterv_two_stage); ShardOptions::two_stage = false forces one stage. That
// helper permutes blocks in host memory, so buffers on a device backend (host_memory() false) always
// take one stage (NCCL's collectives are topology-aware themselves).
//
// Overlap and progress: at most one gather and one reduce per unit are in flight. The hooks
// poll every in-flight operation (comm progress is by polling); a long compute may call
// progress() between its pieces. Per unit, UnitTimes records how long the hooks blocked.
//
// Every operation is collective: all ranks call the same operations and hooks in the same order.
#pragma once

#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "dmuon/backend.hpp"
#include "dmuon/comm.hpp"
#include "dmuon/device_span.hpp"
#include "dmuon/params.hpp"
#include "dmuon/shard_layout.hpp"

namespace dmuon::shard {

class ParamRegistry {
 public:
  // Appends a parameter; returns its index. Throws on a duplicate name, an empty or non-positive
  // shape, or a negative unit.
  int add(ParamSpec spec);
  const std::vector<ParamSpec>& specs() const { return specs_; }
  int size() const { return static_cast<int>(specs_.size()); }
  int num_units() const;                  // 1 + the largest unit index (0 if empty)
  int find(std::string_view name) const;  // index, or -1
  // Collective. Returns if every rank registered the same parameters (name, shape, role, unit)
  // in the same order; otherwise throws on every rank an Error naming the first differing
  // parameter index and, for each distinct registration of it, the ranks that made it.
  void verify_across(comm::Comm& comm) const;

 private:
  std::vector<ParamSpec> specs_;
};

// z3: gathered for forward, released, gathered again for backward; z2: kept gathered from forward to
// backward; replicated: every rank holds every parameter (no gathers).
enum class Mode { z3, z2, replicated };
std::string_view to_string(Mode mode);
// "z3" | "z2" | "replicated"; throws dmuon::Error naming the accepted values.
Mode parse_mode(std::string_view text);

struct ShardOptions {
  Layout layout = Layout::owner_aligned;
  Mode mode = Mode::z3;
  ReduceOp grad_reduce = ReduceOp::average;  // sum or average
  bool two_stage = true;
  // Where the unit buffers (shards, gathered parameters, gradients) live; null: cpu_backend(). The
  // communicator must reach that memory (MPI: host memory; NCCL, Comm::device_buffers(): GPU memory).
  Backend* backend = nullptr;
};

// Exposed communication of a unit: seconds the hooks (or wait) blocked on its gathers and
// reduces, and how many waits blocked at all (an operation already complete costs nothing).
// Summed until reset_times().
struct UnitTimes {
  double gather_wait_s = 0;
  double reduce_wait_s = 0;
  int gather_blocks = 0;
  int reduce_blocks = 0;
};

class ShardedParams {
 public:
  // Collective: verifies the registry across ranks. owners[p] is the rank that owns matrix p (−1 for
  // elementwise parameters), the same on every rank: the planner's answer (plan.hpp: plan_across_ranks,
  // or default_owners). The owner-aligned layout needs one per parameter; the even layout places no
  // owners and takes an empty table. Shard parameters start at zero (see load_full). Throws when the
  // backend's memory is not host memory and comm does not take device memory (Comm::device_buffers).
  ShardedParams(std::shared_ptr<comm::Comm> comm, ParamRegistry registry, ShardOptions options,
                std::vector<int> owners);
  // Completes every gather and reduce still in flight (Work::settle: bounded by the comm timeout,
  // never throwing) before freeing the buffers they write into; if one cannot complete (the
  // communicator failed), leaks the buffers instead. Not collective: it waits only for the peers
  // to progress operations they have already posted (the hooks are collective).
  ~ShardedParams();
  ShardedParams(const ShardedParams&) = delete;
  ShardedParams& operator=(const ShardedParams&) = delete;

  const ParamRegistry& registry() const { return registry_; }
  const ShardOptions& options() const { return options_; }
  Backend& backend() const { return options_.backend ? *options_.backend : cpu_backend(); }
  const std::vector<int>& owners() const { return owners_; }  // empty for the even layout
  int num_units() const { return static_cast<int>(units_.size()); }
  const UnitLayout& layout(int unit) const;
  // My shard's parameter ranges in unit `unit` (layout(unit).local_pieces(rank)).
  std::vector<LocalPiece> local_pieces(int unit) const;
  DeviceSpan<float> shard_params(int unit);
  // Valid after reduce_grads(unit) completed, until the next reduce of that unit starts.
  DeviceSpan<float> shard_grads(int unit);
  // My piece of parameter p in its unit's shard (elements [offset_in_param, + length) of p; empty where I hold
  // none): what the optimizer updates. A view is valid until the unit's buffers change (a gather, release or
  // reduce may free and allocate them), so a holder asks again rather than keeping data(). Throws when the
  // layout gives me more than one piece of p.
  DeviceSpan<float> local_params(int p);
  DeviceSpan<float> local_grads(int p);  // valid as shard_grads

  // Sets parameter p from its full value (numel elements, the same on every rank): my shard's
  // part (the whole packed buffer in replicated mode). Views show it after the next gather.
  void load_full(int param, std::span<const float> values);

  // ---- operations (collective, asynchronous) ----
  // Starts gathering the unit's packed parameters; wait(unit) (or the Work) completes it.
  comm::Work gather(int unit);
  // Frees the gathered buffers (no-op in replicated mode). The unit's gather must be complete.
  void release(int unit);
  // Zeroes the packed gradient buffer of the unit (allocating it); grad(p) is then writable.
  void zero_grads(int unit);
  // Starts reducing the unit's gradients into shard_grads(unit).
  comm::Work reduce_grads(int unit);
  // Completes the unit's in-flight gather and reduce.
  void wait(int unit);
  // Advances every in-flight operation without blocking.
  void progress();

  // Full view of parameter p; its unit must be gathered (after the gather completed).
  DeviceSpan<float> param(int p);
  // Full view of p's gradient; its unit's gradients must have been zeroed since the last reduce.
  DeviceSpan<float> grad(int p);
  bool gathered(int unit) const;

  // ---- training-loop hooks (units run forward 0..U-1, backward U-1..0) ----
  void before_forward(int unit);   // unit gathered on return; next unit's gather started
  void after_forward(int unit);    // z3: release
  void before_backward(int unit);  // unit gathered and its grads zeroed; previous unit's gather started (z3)
  void after_backward(int unit);   // reduce started, unit released (not in replicated mode); the
                                   // reduce of unit+1 completed
  void finish_backward();          // every reduce complete: shard_grads ready for the optimizer
  const UnitTimes& times(int unit) const;
  void reset_times();

 private:
  struct Unit;
  Unit& unit_at(int unit, const char* what);
  // My piece of parameter p (length 0: none), from the unit's local pieces.
  LocalPiece my_piece(int p, const char* what) const;
  void start_gather(Unit& u);
  void wait_gather(Unit& u);
  void wait_reduce(Unit& u);

  std::shared_ptr<comm::Comm> comm_;
  ParamRegistry registry_;
  ShardOptions options_;
  std::vector<int> owners_;
  std::vector<std::unique_ptr<Unit>> units_;
};

}  // namespace dmuon::shard
