#include <gtest/gtest.h>

#include "dmuon/atomic_file.hpp"
#include "dmuon/error.hpp"
#include "dmuon/models.hpp"
#include "dmuon/sim.hpp"
#include "test_data.hpp"

namespace dmuon::sim {
namespace {

HardwareProfile test_profile() {
  HardwareProfile hw;
  hw.name = "test";
  hw.peak_flops = 100e12;
  hw.mfu = 0.5;
  hw.ns_flops = 100e12;
  hw.ns_efficiency = 0.5;
  hw.hbm_bytes_per_s = 1e12;
  hw.intra_node_bytes_per_s = 100e9;
  hw.inter_node_bytes_per_s = 200e9;
  hw.intra_node_latency_s = 5e-6;
  hw.inter_node_latency_s = 10e-6;
  hw.kernel_launch_s = 5e-6;
  hw.sm_count = 100;
  hw.comm_bytes_per_element = 2;
  return hw;
}

// Two layers of a small transformer: 4 matrices per layer, norms, embeddings.
std::vector<ParamSpec> small_model() {
  std::vector<ParamSpec> p;
  p.push_back({"embed", {1000, 256}, ParamRole::elementwise, 0});
  for (int l = 1; l <= 2; ++l) {
    const std::string pre = "layers." + std::to_string(l) + ".";
    p.push_back({pre + "qkv", {768, 256}, ParamRole::matrix, l});
    p.push_back({pre + "proj", {256, 256}, ParamRole::matrix, l});
    p.push_back({pre + "up", {1024, 256}, ParamRole::matrix, l});
    p.push_back({pre + "down", {256, 1024}, ParamRole::matrix, l});
    p.push_back({pre + "norm", {256}, ParamRole::elementwise, l});
  }
  return p;
}

TEST(Collectives, MatchClosedForms) {
  const Link link{100.0, 1.0};  // 100 bytes/s, 1 s per step
  EXPECT_DOUBLE_EQ(ring_all_gather_s(1000, 4, link), 3 * 1.0 + 0.75 * 10);
  EXPECT_DOUBLE_EQ(ring_reduce_scatter_s(1000, 4, link), 3 * 1.0 + 0.75 * 10);
  EXPECT_DOUBLE_EQ(ring_all_reduce_s(1000, 4, link), 2 * (3 * 1.0 + 0.75 * 10));
  EXPECT_DOUBLE_EQ(pipelined_broadcast_s(1000, 5, link), 3 * 1.0 + 10);  // ceil(log2 5) = 3
  EXPECT_DOUBLE_EQ(pipelined_broadcast_s(1000, 8, link), 3 * 1.0 + 10);
}

TEST(Collectives, OneRankCommunicatesNothing) {
  const Link link{100.0, 1.0};
  EXPECT_EQ(ring_all_gather_s(1e9, 1, link), 0);
  EXPECT_EQ(ring_reduce_scatter_s(1e9, 1, link), 0);
  EXPECT_EQ(ring_all_reduce_s(1e9, 1, link), 0);
  EXPECT_EQ(pipelined_broadcast_s(1e9, 1, link), 0);
  EXPECT_EQ(two_stage_reduce_scatter_s(1e9, test_profile(), {1, 8}), 0);
}

TEST(Collectives, LinksAcrossNodesUseEachDevicesShareOfTheNetwork) {
  const HardwareProfile hw = test_profile();
  const Link one_node = world_link(hw, {8, 8});
  EXPECT_EQ(one_node.bytes_per_s, hw.intra_node_bytes_per_s);
  const Link two_nodes = world_link(hw, {16, 8});
  EXPECT_EQ(two_nodes.bytes_per_s, hw.inter_node_bytes_per_s / 8);
  EXPECT_EQ(two_nodes.latency_s, hw.inter_node_latency_s);
  // Two stages: intra-node ring over 8, then 1/8 of the bytes over 2 nodes on 1/8 of the network.
  const double bytes = 1e9;
  const double expected = ring_reduce_scatter_s(bytes, 8, {hw.intra_node_bytes_per_s, hw.intra_node_latency_s}) +
                          ring_reduce_scatter_s(bytes / 8, 2, {hw.inter_node_bytes_per_s / 8, hw.inter_node_latency_s});
  EXPECT_DOUBLE_EQ(two_stage_reduce_scatter_s(bytes, hw, {16, 8}), expected);
}

TEST(NsCost, BatchingAndOurEngineAreNeverSlowerThanThePlainPath) {
  const HardwareProfile hw = test_profile();
  for (auto [r, c] : std::vector<std::pair<int64_t, int64_t>>{{128, 896}, {896, 4864}, {2048, 2048}, {4864, 896}}) {
    const double plain = ns_time_s(r, c, 8, NsEngine::plain, hw);
    const double ours = ns_time_s(r, c, 8, NsEngine::dmuon, hw);
    EXPECT_LT(ours, plain) << r << "x" << c;
    EXPECT_LE(ns_time_s(r, c, 8, NsEngine::dmuon, hw), 8 * ns_time_s(r, c, 1, NsEngine::dmuon, hw)) << r << "x" << c;
    EXPECT_DOUBLE_EQ(ns_time_s(r, c, 8, NsEngine::plain, hw), 8 * ns_time_s(r, c, 1, NsEngine::plain, hw));
  }
  EXPECT_EQ(ns_time_s(64, 64, 0, NsEngine::dmuon, hw), 0);
}

SimOptions quick_options() {
  SimOptions o;
  o.tokens_per_device = 2048;
  o.plan.balancer = Balancer::lpt;
  return o;
}

TEST(Simulator, OneDeviceHasNoCommunication) {
  const SimResult r = simulate_step(small_model(), test_profile(), {1, 8}, quick_options());
  for (Optimizer o : all_optimizers()) {
    const StepBreakdown& s = r.steps.at(o);
    EXPECT_NEAR(s.exposed_comm_s, 0, 1e-15) << to_string(o);
    EXPECT_EQ(s.optimizer_comm_s, 0) << to_string(o);
    EXPECT_EQ(s.bytes_per_device, 0) << to_string(o);
    EXPECT_GT(s.compute_s, 0);
    EXPECT_DOUBLE_EQ(s.step_s, s.compute_s + s.optimizer_s) << to_string(o);
  }
}

TEST(Simulator, MoreBandwidthOrFlopsIsNeverSlower) {
  const auto params = small_model();
  const HardwareProfile base = test_profile();
  std::vector<HardwareProfile> faster;
  for (int field = 0; field < 5; ++field) {
    HardwareProfile hw = base;
    double* fields[] = {&hw.peak_flops, &hw.ns_flops, &hw.hbm_bytes_per_s, &hw.intra_node_bytes_per_s,
                        &hw.inter_node_bytes_per_s};
    *fields[field] *= 2;
    faster.push_back(hw);
  }
  for (int devices : {2, 8, 16, 64}) {
    const SimResult slow = simulate_step(params, base, {devices, 8}, quick_options());
    for (size_t f = 0; f < faster.size(); ++f) {
      const SimResult fast = simulate_step(params, faster[f], {devices, 8}, quick_options());
      for (Optimizer o : all_optimizers()) {
        EXPECT_LE(fast.steps.at(o).step_s, slow.steps.at(o).step_s * (1 + 1e-12))
            << to_string(o) << " at " << devices << " devices, field " << f;
        EXPECT_LE(fast.steps.at(o).optimizer_s, slow.steps.at(o).optimizer_s * (1 + 1e-12));
      }
    }
  }
}

TEST(Simulator, OwnerExecutionDoesLessOptimizerWorkThanGatherThenCompute) {
  const SimResult r = simulate_step(small_model(), test_profile(), {8, 8}, quick_options());
  const double dmuon = r.steps.at(Optimizer::dmuon).optimizer_s;
  EXPECT_LT(dmuon, r.steps.at(Optimizer::muon_gather).optimizer_s);
  EXPECT_LT(r.steps.at(Optimizer::muon_gather).optimizer_s, r.steps.at(Optimizer::muon_gather_plain).optimizer_s);
  EXPECT_GT(r.steps.at(Optimizer::muon_gather_plain).optimizer_comm_s, 0);
  EXPECT_EQ(r.plan.ranks, 8);
}

TEST(HardwareProfile, ShippedProfilesLoadWithSources) {
  for (const char* name : {"a800", "h200"}) {
    const HardwareProfile hw = load_hardware_profile(name);
    EXPECT_EQ(hw.name, name);
    EXPECT_GT(hw.peak_flops, 1e14);
    EXPECT_TRUE(hw.sources.count("peak_flops")) << name;
    EXPECT_TRUE(hw.sources.count("inter_node_bytes_per_s")) << name;
  }
}

TEST(HardwareProfile, BadProfilesAreRefusedByField) {
  test::TempDir dir;
  write_file_atomically(dir.file("bad.json"), R"({"name": "bad", "peak_flops": -1})");
  try {
    load_hardware_profile(dir.file("bad.json"));
    FAIL() << "accepted a negative peak";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("peak_flops"), std::string::npos) << e.what();
  }
  EXPECT_THROW(load_hardware_profile("no-such-profile"), Error);
}

}  // namespace
}  // namespace dmuon::sim
