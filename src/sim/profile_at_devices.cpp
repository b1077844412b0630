// The hardware profile one of D ranks sees when they share one machine's cores (include/dmuon/sim.hpp).
#include <algorithm>

#include "dmuon/error.hpp"
#include "dmuon/sim.hpp"

namespace dmuon::sim {

HardwareProfile at_devices(const HardwareProfile& hw, int devices) {
  DMUON_CHECK(devices >= 1, "at_devices: devices must be at least 1, got ", devices);
  if (hw.shared_cores <= 0) return hw;
  const double cores = hw.shared_cores;
  HardwareProfile out = hw;
  // Fewer ranks than measured: interpolate linearly in R/D from 1 (D = R) to the measured gain of one rank
  // alone (D = 1).
  const double ranks = hw.calibration_ranks;
  const auto blas = [&](double alone) {
    return devices >= ranks ? ranks / devices : 1 + (alone - 1) * (ranks / devices - 1) / (ranks - 1);
  };
  const double single = std::min(1.0, cores / devices) / std::min(1.0, cores / hw.calibration_ranks);
  out.peak_flops *= blas(hw.single_rank_speedup);
  out.ns_flops *= blas(hw.single_rank_ns_speedup);
  out.hbm_bytes_per_s *= single;
  out.intra_node_bytes_per_s *= single;
  out.inter_node_bytes_per_s *= single;
  out.kernel_launch_s /= single;
  out.intra_node_latency_s /= single;
  out.inter_node_latency_s /= single;
  return out;
}

}  // namespace dmuon::sim
