// Cluster simulator: an event-level model of one sharded training step on D devices, for the
// clusters this machine is not (DESIGN.md 3, issue "reproduce the paper's evaluation").
//
// Pure functions of (model parameters, hardware profile, topology, options): no MPI, no BLAS.
// What it models, and every assumption, is printed by `dmuon simulate` with the result:
//  - compute: forward 2·P_unit·tokens and backward 4·P_unit·tokens flops per unit at
//    peak_flops·mfu (the 6·params·tokens rule; attention's T² term is ignored);
//  - collectives: ring all-gather / reduce-scatter / all-reduce and pipelined broadcast / reduce,
//    latency + bytes/bandwidth, on intra-node links, or across nodes on each device's share of its
//    node's network;
//  - overlap: one compute stream and one communication stream; unit i+1's gather runs during unit
//    i's forward, unit i's reduce-scatter during unit i−1's backward (Z3: weights gathered again
//    for backward);
//  - optimizer: AdamW is HBM-bound; Newton–Schulz GEMMs follow a roofline (compute at
//    ns_flops·ns_efficiency, capped by HBM bandwidth and by SM occupancy of small shapes) plus
//    kernel launches; DMuon runs each rank's planned matrices (the plan's makespan, batched,
//    symmetric/Gram engine); gather-then-compute all-gathers every Muon gradient over the world and
//    runs every matrix on every rank.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dmuon/params.hpp"
#include "dmuon/plan.hpp"

namespace dmuon::sim {

// One device kind and its interconnect. Loaded from models/hardware/<name>.json, which cites the
// public specification of every number (or says ASSUMED).
struct HardwareProfile {
  std::string name;
  std::string description;
  double peak_flops = 0;              // flop/s for forward/backward (bf16 dense)
  double mfu = 0;                     // fraction of peak_flops training compute reaches
  double ns_flops = 0;                // flop/s available to Newton–Schulz GEMMs
  double ns_efficiency = 0;           // fraction of ns_flops a large NS GEMM reaches
  double hbm_bytes_per_s = 0;         // device memory bandwidth
  double intra_node_bytes_per_s = 0;  // per device, per direction (NVLink)
  double inter_node_bytes_per_s = 0;  // per node, per direction (all NICs together)
  double intra_node_latency_s = 0;    // per step of a collective within a node
  double inter_node_latency_s = 0;    // per step across nodes
  double kernel_launch_s = 0;         // per kernel
  int sm_count = 1;                   // streaming multiprocessors (occupancy of small GEMMs)
  double comm_bytes_per_element = 2;  // bytes per gathered weight / reduced gradient element
  std::map<std::string, std::string> sources;  // field -> citation or "ASSUMED: why"
};

// By name (models/hardware/<name>.json, searched like model manifests) or path. Throws
// dmuon::Error naming the file and the missing or invalid field.
HardwareProfile load_hardware_profile(const std::string& name_or_path);

struct Topology {
  int devices = 1;
  int devices_per_node = 8;
  int nodes() const;  // ceil(devices / devices_per_node)
};

// A link as one collective sees it: per-device bandwidth and per-step latency.
struct Link {
  double bytes_per_s = 0;
  double latency_s = 0;
};
// The link a collective over all `topology.devices` runs on: NVLink within one node; across
// nodes, each device's share of its node's network (never more than NVLink).
Link world_link(const HardwareProfile& hw, const Topology& topology);

// Collective costs in seconds over p ranks; `bytes` is the size of the whole (gathered or
// reduced) buffer. Closed forms (latency α, bandwidth β):
//   ring all-gather, reduce-scatter:  (p−1)·α + (p−1)/p · bytes/β
//   ring all-reduce:                  2·[(p−1)·α + (p−1)/p · bytes/β]
//   pipelined broadcast, reduce:      ⌈log2 p⌉·α + bytes/β          (0 when p = 1)
double ring_all_gather_s(double bytes, int p, const Link& link);
double ring_reduce_scatter_s(double bytes, int p, const Link& link);
double ring_all_reduce_s(double bytes, int p, const Link& link);
double pipelined_broadcast_s(double bytes, int p, const Link& link);
// Two-stage reduce-scatter (DESIGN 3.3): within each node over NVLink, then across nodes among
// ranks with the same local index, each carrying 1/devices_per_node of the bytes.
double two_stage_reduce_scatter_s(double bytes, const HardwareProfile& hw, const Topology& topology);

// Newton–Schulz time on one device for `batch` same-shape matrices run together.
enum class NsEngine {
  plain,  // the public reference: standard recurrence, full GEMMs, one matrix per kernel
  dmuon,  // ours: the cheaper of standard-with-SYRK and Gram (DESIGN 2.3), batched kernels
};
double ns_time_s(int64_t rows, int64_t cols, int batch, NsEngine engine, const HardwareProfile& hw);

enum class Optimizer { adamw, muon_gather_plain, muon_gather, dmuon };
std::string to_string(Optimizer o);
const std::vector<Optimizer>& all_optimizers();

struct SimOptions {
  double tokens_per_device = 4096;  // tokens each device processes per step
  bool zero3 = true;                // gather weights again for backward
  PlanOptions plan;                 // how DMuon assigns owners
};

struct StepBreakdown {
  double step_s = 0;            // one training step, end to end
  double compute_s = 0;         // forward + backward compute
  double exposed_comm_s = 0;    // communication not hidden behind compute
  double optimizer_s = 0;       // the optimizer step (including its own communication)
  double optimizer_comm_s = 0;  // of which communication (gather-then-compute's all-gather)
  double bytes_per_device = 0;  // bytes each device sends in the step
};

struct SimResult {
  int devices = 0;
  std::map<Optimizer, StepBreakdown> steps;
  Plan plan;  // DMuon's owner plan (makespan = the NS part of its optimizer step)
};

SimResult simulate_step(const std::vector<ParamSpec>& params, const HardwareProfile& hw, const Topology& topology,
                        const SimOptions& options);

}  // namespace dmuon::sim
