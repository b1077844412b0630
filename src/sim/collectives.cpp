// Closed-form costs of the collectives (latency + bytes/bandwidth), as in nccl-tests'
// PERFORMANCE.md and the usual ring/tree/pipeline analyses.
#include <algorithm>
#include <cmath>

#include "dmuon/error.hpp"
#include "dmuon/sim.hpp"

namespace dmuon::sim {

int Cluster::nodes() const { return (devices + devices_per_node - 1) / devices_per_node; }

Link world_link(const HardwareProfile& hw, const Cluster& cluster) {
  DMUON_CHECK(cluster.devices >= 1 && cluster.devices_per_node >= 1, "a cluster needs devices ≥ 1 and ",
              "devices per node ≥ 1, got ", cluster.devices, " and ", cluster.devices_per_node);
  if (cluster.nodes() == 1) return {hw.intra_node_bytes_per_s, hw.intra_node_latency_s};
  // A ring crossing nodes runs at its slowest hop: each device's share of its node's NICs.
  const double per_device_network = hw.inter_node_bytes_per_s / std::min(cluster.devices, cluster.devices_per_node);
  return {std::min(hw.intra_node_bytes_per_s, per_device_network), hw.inter_node_latency_s};
}

double ring_all_gatherv_s(double max_block_bytes, int p, const Link& link) {
  if (p <= 1) return 0;
  return (p - 1) * (link.latency_s + max_block_bytes / link.bytes_per_s);
}

double ring_all_gather_s(double bytes, int p, const Link& link) { return ring_all_gatherv_s(bytes / p, p, link); }

double ring_reduce_scatter_s(double bytes, int p, const Link& link) { return ring_all_gather_s(bytes, p, link); }

double ring_all_reduce_s(double bytes, int p, const Link& link) { return 2 * ring_all_gather_s(bytes, p, link); }

double tree_all_reduce_s(double bytes, int p, const Link& link) {
  if (p <= 1) return 0;
  return 2 * (std::ceil(std::log2(static_cast<double>(p))) * link.latency_s + bytes / link.bytes_per_s);
}

double pipelined_broadcast_s(double bytes, int p, const Link& link) {
  if (p <= 1) return 0;
  // Chunks flow down a chain: the first reaches the last rank after p−1 hops, the rest follow at β.
  return (p - 1) * link.latency_s + bytes / link.bytes_per_s;
}

double two_stage_reduce_scatterv_s(const std::vector<double>& block_bytes, const HardwareProfile& hw,
                                   const Cluster& cluster) {
  DMUON_CHECK(static_cast<int>(block_bytes.size()) == cluster.devices, "two-stage reduce-scatterv: ",
              block_bytes.size(), " blocks for ", cluster.devices, " devices");
  const int per_node = std::min(cluster.devices, cluster.devices_per_node);
  // Stage 1, within each node: local rank j ends up with the node's sum of every node's rank-j block.
  std::vector<double> local(per_node, 0.0);
  for (size_t r = 0; r < block_bytes.size(); ++r) local[r % per_node] += block_bytes[r];
  const Link nvlink{hw.intra_node_bytes_per_s, hw.intra_node_latency_s};
  const double intra = ring_all_gatherv_s(*std::max_element(local.begin(), local.end()), per_node, nvlink);
  if (cluster.nodes() == 1) return intra;
  // Stage 2: ranks with the same local index reduce across nodes, all local indices at once, so each
  // uses 1/per_node of the node's network.
  const Link network{hw.inter_node_bytes_per_s / per_node, hw.inter_node_latency_s};
  return intra + ring_all_gatherv_s(*std::max_element(block_bytes.begin(), block_bytes.end()), cluster.nodes(),
                                    network);
}

double two_stage_reduce_scatter_s(double bytes, const HardwareProfile& hw, const Cluster& cluster) {
  return two_stage_reduce_scatterv_s(std::vector<double>(cluster.devices, bytes / cluster.devices), hw, cluster);
}

}  // namespace dmuon::sim
