// Hardware profiles: one device kind and its interconnect, as models/hardware/<name>.json describes it
// (and `dmuon bench calibrate` writes for this CPU). The simulator (sim.hpp) reads every field; the
// planner's flop-estimated costs (plan.hpp: flop_batch_time) read ns_flops and ns_efficiency.
#pragma once

#include <map>
#include <string>

namespace dmuon {

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
  double kernel_launch_s = 0;         // per kernel (CPU: per BLAS / elementwise call)
  int sm_count = 1;                   // streaming multiprocessors (occupancy of small GEMMs)
  double comm_bytes_per_element = 2;  // bytes per gathered weight / reduced gradient element
  // Symmetric products: time of the full GEMM of the same shape / time of the symmetric kernel
  // (2 would be "half the flops at full efficiency").
  double syrk_speedup = 1;       // C = A·Aᵀ by SYRK
  double sym_gemm_speedup = 1;   // C = A·B known symmetric, upper block triangle only
  double ns_bytes_per_element = 2;  // Newton–Schulz buffers (bf16 on GPUs, float32 on the CPU)
  bool batched_kernels = true;   // a batch of same-shape matrices runs as one kernel per operation
  // Devices that share one machine's cores (the CPU profile): 0 = every device has its own hardware.
  // Then the rates above are per rank as measured with `calibration_ranks` ranks at once, and a run
  // with D ranks rescales them (at_devices).
  int shared_cores = 0;
  int calibration_ranks = 1;
  double single_rank_speedup = 1;     // peak_flops of one rank alone with every core / of one calibration rank
  double single_rank_ns_speedup = 1;  // the same for ns_flops
  std::map<std::string, std::string> sources;  // field -> citation or "ASSUMED: why"
};

// By name (models/hardware/<name>.json, searched like model manifests) or path. Throws
// dmuon::Error naming the file and the missing or invalid field.
HardwareProfile load_hardware_profile(const std::string& name_or_path);

}  // namespace dmuon
