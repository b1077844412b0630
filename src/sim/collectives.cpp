// Closed-form costs of the collectives (latency + bytes/bandwidth), as in nccl-tests'
// PERFORMANCE.md and the usual ring/pipeline analyses.
#include <algorithm>
#include <cmath>

#include "dmuon/error.hpp"
#include "dmuon/sim.hpp"

namespace dmuon::sim {

int Topology::nodes() const { return (devices + devices_per_node - 1) / devices_per_node; }

Link world_link(const HardwareProfile& hw, const Topology& topology) {
  DMUON_CHECK(topology.devices >= 1 && topology.devices_per_node >= 1, "topology needs devices ≥ 1 and ",
              "devices per node ≥ 1, got ", topology.devices, " and ", topology.devices_per_node);
  if (topology.nodes() == 1) return {hw.intra_node_bytes_per_s, hw.intra_node_latency_s};
  // A ring crossing nodes runs at its slowest hop: each device's share of its node's NICs.
  const double per_device_network = hw.inter_node_bytes_per_s / std::min(topology.devices, topology.devices_per_node);
  return {std::min(hw.intra_node_bytes_per_s, per_device_network), hw.inter_node_latency_s};
}

double ring_all_gather_s(double bytes, int p, const Link& link) {
  if (p <= 1) return 0;
  return (p - 1) * link.latency_s + (p - 1.0) / p * bytes / link.bytes_per_s;
}

double ring_reduce_scatter_s(double bytes, int p, const Link& link) { return ring_all_gather_s(bytes, p, link); }

double ring_all_reduce_s(double bytes, int p, const Link& link) { return 2 * ring_all_gather_s(bytes, p, link); }

double pipelined_broadcast_s(double bytes, int p, const Link& link) {
  if (p <= 1) return 0;
  return std::ceil(std::log2(static_cast<double>(p))) * link.latency_s + bytes / link.bytes_per_s;
}

double two_stage_reduce_scatter_s(double bytes, const HardwareProfile& hw, const Topology& topology) {
  const int per_node = std::min(topology.devices, topology.devices_per_node);
  const Link nvlink{hw.intra_node_bytes_per_s, hw.intra_node_latency_s};
  const double intra = ring_reduce_scatter_s(bytes, per_node, nvlink);
  if (topology.nodes() == 1) return intra;
  // Ranks with the same local index reduce their 1/per_node share across nodes, all local indices
  // at once, so each uses 1/per_node of the node's network.
  const Link network{hw.inter_node_bytes_per_s / per_node, hw.inter_node_latency_s};
  return intra + ring_reduce_scatter_s(bytes / per_node, topology.nodes(), network);
}

}  // namespace dmuon::sim
