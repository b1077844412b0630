// Cluster simulator: an event-level model of one sharded training step on D devices, for the
// clusters this machine is not (DESIGN.md 3, issue "reproduce the paper's evaluation").
//
// Pure functions of (model parameters, hardware profile, cluster, options): no MPI, no BLAS.
// What it models, and every assumption, is printed by `dmuon simulate` with the result
// (docs/simulator.md derives every closed form):
//  - compute: forward flops per unit (2·P_unit·tokens by default, or given, e.g. the GPT example's own
//    count) and backward twice that, at peak_flops·mfu;
//  - collectives: ring all-gather(v) / reduce-scatter(v) whose D−1 steps are paced by the largest block
//    (even for FSDP's layout, uneven for DMuon's owner-aligned one), two-stage reduce-scatter(v) across
//    nodes, tree all-reduce for small messages; latency + bytes/bandwidth, on intra-node links, or
//    across nodes on each device's share of its node's network;
//  - overlap: one compute stream and one communication stream; unit i+1's gather runs during unit
//    i's forward, unit i's reduce-scatter during unit i−1's backward (Z3: weights gathered again
//    for backward);
//  - optimizer: every kernel the algorithm issues (src/ns's Newton–Schulz calls, the momentum, weight
//    and AdamW updates, the gradient-norm pass) pays a launch; GEMMs follow a roofline (ns_flops ·
//    ns_efficiency, capped by memory bandwidth and by SM occupancy of small shapes), symmetric products
//    take the full GEMM's time / the profile's measured or assumed speedup, elementwise passes move
//    their bytes at memory bandwidth; the gradient-norm all-reduce pays its latency. DMuon runs each
//    rank's planned matrices (the plan's makespan, batched, symmetric/Gram engine); gather-then-compute
//    all-gathers every Muon gradient over the world and runs every matrix on every rank.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dmuon/hardware_profile.hpp"
#include "dmuon/params.hpp"
#include "dmuon/plan.hpp"
#include "dmuon/plan_mesh.hpp"

namespace dmuon::sim {

// The profile one of `devices` ranks sees. Unchanged unless hw.shared_cores > 0; then, with c cores
// and R = calibration_ranks: BLAS rates (peak_flops, ns_flops) × R/D for D ≥ R (the machine's BLAS
// throughput split over D ranks by time slices), and for D < R linearly in R/D from 1 to
// single_rank_speedup (peak_flops) or single_rank_ns_speedup (ns_flops) at D = 1 (threads help a lone rank
// less than R-fold); single-threaded rates
// (memory, links) × min(1, c/D)/min(1, c/R), per-call overheads and latencies ÷ that same factor.
HardwareProfile at_devices(const HardwareProfile& hw, int devices);

// The simulated machines: `devices` devices, devices_per_node to a node (comm::Topology is where the ranks of
// a real run sit).
struct Cluster {
  int devices = 1;
  int devices_per_node = 8;
  int nodes() const;  // ceil(devices / devices_per_node)
};

// A link as one collective sees it: per-device bandwidth and per-step latency.
struct Link {
  double bytes_per_s = 0;
  double latency_s = 0;
};
// The link a collective over all `cluster.devices` runs on: NVLink within one node; across
// nodes, each device's share of its node's network (never more than NVLink).
Link world_link(const HardwareProfile& hw, const Cluster& cluster);

// Collective costs in seconds over p ranks; `bytes` is the size of the whole (gathered or
// reduced) buffer. Closed forms (latency α, bandwidth β):
//   ring all-gather, reduce-scatter:  (p−1)·α + (p−1)/p · bytes/β
//   ring all-reduce:                  2·[(p−1)·α + (p−1)/p · bytes/β]
//   ring all-gatherv, reduce-scatterv: (p−1)·(α + max_block/β)   (each step waits for its largest block)
//   tree all-reduce (small messages):  2⌈log2 p⌉·α + 2·bytes/β     (reduce up a tree, broadcast down)
//   pipelined (chain) broadcast, reduce: (p−1)·α + bytes/β          (0 when p = 1)
double ring_all_gather_s(double bytes, int p, const Link& link);
double ring_reduce_scatter_s(double bytes, int p, const Link& link);
double ring_all_reduce_s(double bytes, int p, const Link& link);
double ring_all_gatherv_s(double max_block_bytes, int p, const Link& link);
double tree_all_reduce_s(double bytes, int p, const Link& link);
double pipelined_broadcast_s(double bytes, int p, const Link& link);
// Two-stage reduce-scatter (DESIGN 3.3): within each node over NVLink, then across nodes among
// ranks with the same local index, each carrying 1/devices_per_node of the bytes.
double two_stage_reduce_scatter_s(double bytes, const HardwareProfile& hw, const Cluster& cluster);
// The same with uneven blocks (bytes per rank, rank r on node r / devices_per_node): stage 1 is a ring
// reduce-scatterv over the node whose block j sums the blocks of every node's local rank j; stage 2 a
// ring reduce-scatterv across nodes on the per-rank blocks. Even blocks give two_stage_reduce_scatter_s.
double two_stage_reduce_scatterv_s(const std::vector<double>& block_bytes, const HardwareProfile& hw,
                                   const Cluster& cluster);

// Newton–Schulz time on one device for `batch` same-shape matrices run together.
enum class NsEngine {
  plain,  // the public reference: standard recurrence, full GEMMs, one matrix per kernel
  dmuon,  // ours: the cheaper of standard-with-SYRK and Gram (DESIGN 2.3), batched where the profile batches
};
// Where the time goes: GEMM/SYRK kernels (roofline), memory passes (norm, scale, copies), launches.
struct NsCost {
  double total_s = 0;
  double products_s = 0;  // matrix products, without their launches
  double passes_s = 0;    // elementwise passes, without their launches
  double launch_s = 0;    // kernel launches (one per operation per batch, or per matrix)
  int kernels = 0;        // operations of one matrix (what ns_cost issues per batch or per matrix)
};
NsCost ns_cost(int64_t rows, int64_t cols, int batch, NsEngine engine, const HardwareProfile& hw);
double ns_time_s(int64_t rows, int64_t cols, int batch, NsEngine engine, const HardwareProfile& hw);

// The optimizers the simulator and every benchmark compare (the one list of their names: `dmuon bench`'s
// tables, its --optim values and the benchmark report read it): AdamW; gather-then-compute Muon with the
// public reference NS (plain: standard recurrence, full products, one matrix per call), the paper's
// baseline; the same with our batched engine; DMuon. optimizer_factory.hpp's OptimKind is what the
// library builds: muon-gather-plain is OptimKind::muon_gather with plain NS.
enum class ComparedOptimizer { adamw, muon_gather_plain, muon_gather, dmuon };
std::string to_string(ComparedOptimizer o);
const std::vector<ComparedOptimizer>& compared_optimizers();  // in the order above

struct SimOptions {
  double tokens_per_device = 4096;  // tokens each device processes per step
  // Forward flops of each unit per device and step; empty: 2·(unit parameters)·tokens_per_device.
  std::vector<double> unit_forward_flops;
  bool zero3 = true;                // gather weights again for backward
  PlanOptions plan;                 // how DMuon assigns owners
  // DMuon's owners planned on this mesh (plan_mesh.hpp; its ranks must be the cluster's devices): among the ranks
  // that hold each matrix, with the plan's per-rank step() bytes. The step itself is still modelled as above.
  std::optional<Mesh> mesh;
  // Per parameter (optim.hpp: muon_blocks), the blocks a matrix split for Newton–Schulz runs on: DMuon's plan costs
  // it as its blocks (make_plan_items' ns_blocks) and gather-then-compute runs its blocks; empty: every matrix whole.
  // Memory and communication stay the whole matrices'.
  std::vector<std::vector<MatrixBlock>> ns_blocks;
};

struct StepBreakdown {
  double step_s = 0;            // one training step, end to end
  double compute_s = 0;         // forward + backward compute
  double exposed_comm_s = 0;    // communication not hidden behind compute
  double optimizer_s = 0;       // the optimizer step (including its own communication)
  double optimizer_comm_s = 0;  // of which communication (gather-then-compute's all-gather, the norm's all-reduce)
  double optimizer_ns_s = 0;    // of which Newton–Schulz (DMuon: the slowest rank's planned matrices)
  double optimizer_elementwise_s = 0;  // of which memory-bound updates (norm, momentum, weights, AdamW)
  double optimizer_launch_s = 0;       // launches inside optimizer_ns_s and optimizer_elementwise_s
  double bytes_per_device = 0;  // bytes each device sends in the step
};

// What one rank holds between steps, in bytes, on the C++ engine's buffers (src/shard, src/optim, src/ns), sharded
// modes; float32 but the Newton–Schulz workspace (the profile's ns_bytes_per_element). The weights are float32, so they
// are their own masters. docs/simulator.md, "Memory per rank".
struct RankMemory {
  double weights = 0;       // the rank's shard of every unit: the even layout's, or DMuon's owner-aligned one (its
                            // matrices whole, an even share of the elementwise parameters, and a whole copy of
                            // each elementwise parameter that share cuts across ranks)
  double gradients = 0;     // the same for the gradients (kept by ShardedParams between steps)
  double state = 0;         // AdamW's m and v of what it updates with AdamW; the Muon momentum of its matrix pieces
  double step_buffers = 0;  // what the Muon step allocates at its first update and keeps: U (then O) of every matrix
                            // the rank orthogonalizes (DMuon: those it owns; gather-then-compute: all), a column
                            // split's gathered blocks beside it, and gather-then-compute's all-gather send (its pieces)
                            // and receive (every matrix) buffers
  double ns_workspace = 0;  // the Newton–Schulz workspace pooled after the rank's batches: two m×n and four m×m
                            // iterates per matrix of its largest chunk (a batch where kernels are batched, else one)
  double slots = 0;         // the step's 8-byte slots: one per parameter (its gradient's sum of squares) and one per
                            // matrix or block the rank orthogonalizes (its input's norm)
  double held() const;      // their sum
};
// Per rank, for `owner` (DMuon's plan: ParamSpec index → rank, −1 for elementwise parameters; the other optimizers
// ignore it) and `ns_blocks` (SimOptions'). The step allocates nothing beyond these once it has run once (its buffers
// are kept), so the rank's peak in a step is held() plus its unit gathers' (the forward's and backward's).
std::vector<RankMemory> rank_memory(const std::vector<ParamSpec>& params, const std::vector<int>& owner, int devices,
                                    ComparedOptimizer optimizer, const HardwareProfile& hw,
                                    const std::vector<std::vector<MatrixBlock>>& ns_blocks = {});
int fullest_rank(const std::vector<RankMemory>& ranks);  // the one with the most held bytes (the first of equals)

struct SimResult {
  int devices = 0;
  std::map<ComparedOptimizer, StepBreakdown> steps;
  std::map<ComparedOptimizer, std::vector<RankMemory>> memory;  // rank_memory of each optimizer (DMuon's: the plan's)
  Plan plan;  // DMuon's owner plan (makespan = the NS part of its optimizer step)
  HardwareProfile device;  // the profile one device saw: at_devices(hw, devices)
};

// `hw` as loaded: simulate_step applies at_devices itself.
SimResult simulate_step(const std::vector<ParamSpec>& params, const HardwareProfile& hw, const Cluster& cluster,
                        const SimOptions& options);

}  // namespace dmuon::sim
