#include <gtest/gtest.h>

#include <map>

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
  hw.syrk_speedup = 1.7;
  hw.sym_gemm_speedup = 1.5;
  hw.ns_bytes_per_element = 2;
  hw.batched_kernels = true;
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
  EXPECT_DOUBLE_EQ(pipelined_broadcast_s(1000, 5, link), 4 * 1.0 + 10);  // a chain: 4 hops, then 10 s of bytes
  EXPECT_DOUBLE_EQ(pipelined_broadcast_s(1000, 8, link), 7 * 1.0 + 10);
  EXPECT_DOUBLE_EQ(ring_all_gatherv_s(300, 4, link), 3 * (1.0 + 3));     // 3 steps, each 300 bytes at most
  EXPECT_DOUBLE_EQ(tree_all_reduce_s(1000, 5, link), 2 * (3 * 1.0 + 10));  // ceil(log2 5) = 3 levels, up and down
}

TEST(Collectives, UnevenBlocksArePacedByTheLargest) {
  const Link link{100.0, 1.0};
  // Even blocks: the even ring all-gather.
  EXPECT_DOUBLE_EQ(ring_all_gatherv_s(250, 4, link), ring_all_gather_s(1000, 4, link));
  // Two nodes of two ranks; NVLink 100 B/s and 1 s per step, network 200 B/s per node and 2 s per step.
  HardwareProfile hw = test_profile();
  hw.intra_node_bytes_per_s = 100;
  hw.intra_node_latency_s = 1;
  hw.inter_node_bytes_per_s = 200;
  hw.inter_node_latency_s = 2;
  // Stage 1: local rank 0 sums blocks 0 and 2 (400 bytes), rank 1 blocks 1 and 3 (50): 1·(1 + 400/100) = 5.
  // Stage 2: the largest block (300) over 1 step on 200/2 B/s: 1·(2 + 300/100) = 5.
  EXPECT_DOUBLE_EQ(two_stage_reduce_scatterv_s({100, 0, 300, 50}, hw, {4, 2}), 10);
  EXPECT_DOUBLE_EQ(two_stage_reduce_scatterv_s({100, 100, 100, 100}, hw, {4, 2}),
                   two_stage_reduce_scatter_s(400, hw, {4, 2}));
  EXPECT_THROW(two_stage_reduce_scatterv_s({1, 2, 3}, hw, {4, 2}), Error);
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

// A device whose NS costs are exactly flops (1 flop/s, no memory or occupancy limit) plus `launch` per kernel.
HardwareProfile flop_counting_profile(double syrk, double sym_gemm, double launch) {
  HardwareProfile hw = test_profile();
  hw.ns_flops = 1;
  hw.ns_efficiency = 1;
  hw.sm_count = 1;
  hw.hbm_bytes_per_s = 1e300;
  hw.kernel_launch_s = launch;
  hw.syrk_speedup = syrk;
  hw.sym_gemm_speedup = sym_gemm;
  return hw;
}

TEST(NsCost, MatchesHandCountedFlopsAndKernels) {
  // X is 2×4 (m = 2, n = 4): XXᵀ costs 2m²n = 32 flops, an m×m product 2m³ = 16, Q·X 2m²n = 32.
  const HardwareProfile hw = flop_counting_profile(2, 2, 0);
  // Plain: 5 steps of XXᵀ, A·A, B·X, all full: 5·(32 + 16 + 32).
  EXPECT_DOUBLE_EQ(ns_time_s(2, 4, 1, NsEngine::plain, hw), 400);
  EXPECT_DOUBLE_EQ(ns_time_s(4, 2, 3, NsEngine::plain, hw), 1200);  // tall: the same on Xᵀ; a batch runs one by one
  // Standard with SYRK at 2x: 5·(16 + 8 + 32) = 280. Gram with restart at 2: two XXᵀ (16 each), five squares
  // (8 each), nine symmetric m×m products (8 each), two Q·X (32 each) = 32 + 40 + 72 + 64 = 208.
  EXPECT_DOUBLE_EQ(ns_time_s(2, 4, 1, NsEngine::dmuon, hw), 208);
  // Upper-triangle products no faster than the GEMM: Gram 32 + 40 + 144 + 64 = 280, standard 280.
  EXPECT_DOUBLE_EQ(ns_time_s(2, 4, 1, NsEngine::dmuon, flop_counting_profile(2, 1, 0)), 280);
  // Kernels, one launch each: plain 5·(3 products + 2 copies) + norm, copy in, scale, copy out = 29; Gram 39.
  HardwareProfile only_launches = flop_counting_profile(2, 2, 1);
  only_launches.ns_flops = 1e300;
  EXPECT_EQ(ns_cost(2, 4, 1, NsEngine::plain, only_launches).kernels, 29);
  EXPECT_DOUBLE_EQ(ns_cost(2, 4, 3, NsEngine::plain, only_launches).launch_s, 3 * 29);
  const NsCost ours = ns_cost(2, 4, 3, NsEngine::dmuon, only_launches);
  EXPECT_EQ(ours.kernels, 29);  // standard-with-SYRK: as many kernels as plain, fewer than Gram's 39
  EXPECT_DOUBLE_EQ(ours.launch_s, 29);  // batched: one launch per operation for the whole batch
  only_launches.batched_kernels = false;
  EXPECT_DOUBLE_EQ(ns_cost(2, 4, 3, NsEngine::dmuon, only_launches).launch_s, 3 * 29);
}

TEST(NsCost, MemoryPassesMoveTheirBytesAtMemoryBandwidth) {
  // Only memory costs: norm (mn) + copy in (2mn) + scale (2mn) + copy out (2mn) + 5 steps of copies
  // (2m² + 2mn) = 7·8 + 5·(8 + 16) = 176 elements of 2 bytes, at 1 byte/s.
  HardwareProfile hw = flop_counting_profile(2, 2, 0);
  hw.ns_flops = 1e300;
  hw.hbm_bytes_per_s = 1;
  const NsCost c = ns_cost(2, 4, 1, NsEngine::plain, hw);
  EXPECT_DOUBLE_EQ(c.passes_s, 176 * 2);
}

SimOptions quick_options() {
  SimOptions o;
  o.tokens_per_device = 2048;
  o.plan.balancer = Balancer::lpt;
  return o;
}

// One AdamW step worked by hand from the closed forms of sim.hpp (docs/simulator.md): 2 devices on one
// node, units of 1000 and 3000 elementwise parameters, 1000 tokens per device, ZeRO-3.
//   link (one node): 1e9 B/s, 1e-5 s per step; 2 bytes per element; compute at 1e12 · 0.5 flop/s.
//   forward: 2·1000·1000/5e11 = 4 µs and 2·3000·1000/5e11 = 12 µs; backward twice that; compute 48 µs.
//   gather = reduce = (p−1)·(α + largest block/β): unit 0 10 + 1 = 11 µs, unit 1 10 + 3 = 13 µs.
//   one stream each for compute and communication (µs): gather 0 [0, 11]; fwd 0 [11, 15]; gather 1
//   [11, 24]; fwd 1 [24, 36]; backward 1 [36, 60] while gather 0 again [36, 47]; reduce 1 [60, 73];
//   backward 0 [60, 68]; reduce 0 [73, 84]. End 84 µs: exposed communication 84 − 48 = 36 µs.
//   bytes per device: 8000 bytes of units · (p−1)/p · 3 collectives (gather, gather again, reduce) = 12000.
//   optimizer: norm all-reduce as a tree 2·⌈log2 2⌉·α + 2·16/β = 20.032 µs; norm pass over 2000 local
//   elements 2000·4/1e11 + 1 µs launch = 1.08 µs; AdamW 2000·7·4/1e11 + 1 µs = 1.56 µs; total 22.672 µs.
TEST(Simulator, AdamWStepWorkedByHand) {
  HardwareProfile hw = test_profile();
  hw.peak_flops = 1e12, hw.mfu = 0.5, hw.hbm_bytes_per_s = 1e11;
  hw.intra_node_bytes_per_s = 1e9, hw.intra_node_latency_s = 1e-5, hw.kernel_launch_s = 1e-6;
  hw.comm_bytes_per_element = 2;
  const std::vector<ParamSpec> params = {{"a", {1000}, ParamRole::elementwise, 0},
                                         {"b", {3000}, ParamRole::elementwise, 1}};
  SimOptions o;
  o.tokens_per_device = 1000;
  const SimResult r = simulate_step(params, hw, {2, 8}, o);
  const StepBreakdown& s = r.steps.at(ComparedOptimizer::adamw);
  const auto near = [](double x, double want) { EXPECT_NEAR(x, want, 1e-12 * want) << "want " << want; };
  near(s.compute_s, 48e-6);
  near(s.exposed_comm_s, 36e-6);
  near(s.bytes_per_device, 12000);
  near(s.optimizer_comm_s, 20.032e-6);
  near(s.optimizer_elementwise_s, 1.08e-6 + 1.56e-6);
  near(s.optimizer_launch_s, 2e-6);
  EXPECT_EQ(s.optimizer_ns_s, 0);
  near(s.optimizer_s, 22.672e-6);
  near(s.step_s, 84e-6 + 22.672e-6);
  // No matrices: DMuon's owner-aligned layout is the even one, so its forward and backward are AdamW's.
  const StepBreakdown& d = r.steps.at(ComparedOptimizer::dmuon);
  near(d.step_s - d.optimizer_s, 84e-6);
  near(d.bytes_per_device, 12000);
}

// Memory per rank by hand: one unit of an elementwise 10 and two matrices 4×6 (24) and 2×3 (6), 40 elements, at 2
// ranks. Even layout: rank 0 [0, 20) holds the 10 elementwise and 10 of the 4×6, rank 1 its other 14 and the 2×3.
// DMuon's owners: the 4×6 on rank 1, the 2×3 on rank 0, the elementwise 5 and 5.
TEST(Simulator, MemoryPerRankWorkedByHand) {
  HardwareProfile hw = test_profile();
  hw.ns_bytes_per_element = 2;
  hw.batched_kernels = true;
  const std::vector<ParamSpec> params = {{"n", {10}, ParamRole::elementwise, 0},
                                         {"a", {4, 6}, ParamRole::matrix, 0},
                                         {"b", {2, 3}, ParamRole::matrix, 0}};
  const std::vector<int> owner = {-1, 1, 0};
  const auto at = [&](ComparedOptimizer o) { return rank_memory(params, owner, 2, o, hw); };
  const std::vector<RankMemory> adamw = at(ComparedOptimizer::adamw);
  for (const RankMemory& r : adamw) {  // 20 elements each: weights, gradients, m and v; a sum slot per parameter
    EXPECT_EQ(r.weights, 80);
    EXPECT_EQ(r.gradients, 80);
    EXPECT_EQ(r.state, 160);
    EXPECT_EQ(r.step_buffers + r.ns_workspace, 0);
    EXPECT_EQ(r.slots, 24);
    EXPECT_EQ(r.held(), 344);
  }
  // Gather-then-compute: momentum on its matrix pieces, m and v on its elementwise ones; U of both matrices (30), its
  // all-gather's send (its pieces) and receive (30) buffers; the workspace of the 4×6 (m 4, n 6: 2·24 + 4·16) at 2
  // bytes and 8 bytes of norms (one matrix per shape); a norm slot per matrix.
  const std::vector<RankMemory> gather = at(ComparedOptimizer::muon_gather);
  EXPECT_EQ(gather[0].state, 4 * (10 + 2 * 10));
  EXPECT_EQ(gather[1].state, 4 * (14 + 6));
  EXPECT_EQ(gather[0].step_buffers, 4 * (30 + 10 + 30));
  EXPECT_EQ(gather[1].step_buffers, 4 * (30 + 20 + 30));
  EXPECT_EQ(gather[0].ns_workspace, 2 * (2 * 24 + 4 * 16) + 8);
  EXPECT_EQ(gather[0].slots, 8 * (3 + 2));
  // DMuon: rank 1 holds the 4×6 whole and 5 elementwise (29), rank 0 the 2×3 and 5 (11), and each a whole copy of
  // the elementwise 10 (cut across both: ShardedParams' multi-segment copy); each its own U and workspace (the 2×3:
  // m 2, n 3).
  const std::vector<RankMemory> dmuon = at(ComparedOptimizer::dmuon);
  EXPECT_EQ(dmuon[1].weights, 4 * (29 + 10));
  EXPECT_EQ(dmuon[0].weights, 4 * (11 + 10));
  EXPECT_EQ(dmuon[0].gradients, dmuon[0].weights);
  EXPECT_EQ(dmuon[1].state, 4 * (24 + 2 * 5));
  EXPECT_EQ(dmuon[1].step_buffers, 4 * 24);
  EXPECT_EQ(dmuon[0].step_buffers, 4 * 6);
  EXPECT_EQ(dmuon[1].ns_workspace, 2 * (2 * 24 + 4 * 16) + 8);
  EXPECT_EQ(dmuon[0].ns_workspace, 2 * (2 * 6 + 4 * 4) + 8);
  EXPECT_EQ(fullest_rank(dmuon), 1);
  // simulate_step reports the same for its plan's owners.
  SimOptions o;
  const SimResult r = simulate_step(params, hw, {2, 8}, o);
  EXPECT_EQ(r.memory.at(ComparedOptimizer::dmuon)[0].held(),
            rank_memory(params, r.plan.owner, 2, ComparedOptimizer::dmuon, hw)[0].held());
}

TEST(Simulator, OneDeviceHasNoCommunication) {
  const SimResult r = simulate_step(small_model(), test_profile(), {1, 8}, quick_options());
  for (ComparedOptimizer o : compared_optimizers()) {
    const StepBreakdown& s = r.steps.at(o);
    EXPECT_NEAR(s.exposed_comm_s, 0, 1e-15) << to_string(o);
    EXPECT_EQ(s.optimizer_comm_s, 0) << to_string(o);
    EXPECT_EQ(s.bytes_per_device, 0) << to_string(o);
    EXPECT_GT(s.compute_s, 0);
    EXPECT_DOUBLE_EQ(s.step_s, s.compute_s + s.optimizer_s) << to_string(o);
  }
}

TEST(Simulator, ComputeUsesTheGivenForwardFlops) {
  SimOptions o = quick_options();
  o.unit_forward_flops = {0, 1e12, 3e12};  // embeddings, two layers
  const HardwareProfile hw = test_profile();
  const SimResult r = simulate_step(small_model(), hw, {1, 8}, o);
  // Forward + backward = 3 × forward, at peak × MFU = 50 TFLOP/s.
  EXPECT_DOUBLE_EQ(r.steps.at(ComparedOptimizer::adamw).compute_s, 3 * 4e12 / 50e12);
  o.unit_forward_flops = {1, 2};
  EXPECT_THROW(simulate_step(small_model(), hw, {1, 8}, o), Error);
}

TEST(Simulator, FixedCostsNeverMakeAStepFaster) {
  const auto params = small_model();
  HardwareProfile free = test_profile();
  free.kernel_launch_s = 0;
  free.intra_node_latency_s = free.inter_node_latency_s = 0;
  for (int devices : {1, 2, 8, 16}) {
    const SimResult base = simulate_step(params, free, {devices, 8}, quick_options());
    for (int field = 0; field < 3; ++field) {
      HardwareProfile hw = free;
      double* fields[] = {&hw.kernel_launch_s, &hw.intra_node_latency_s, &hw.inter_node_latency_s};
      *fields[field] = 20e-6;
      const SimResult r = simulate_step(params, hw, {devices, 8}, quick_options());
      for (ComparedOptimizer o : compared_optimizers()) {
        EXPECT_GE(r.steps.at(o).step_s, base.steps.at(o).step_s * (1 - 1e-12))
            << to_string(o) << " at " << devices << " devices, field " << field;
        if (field == 0) {
          EXPECT_GT(r.steps.at(o).optimizer_launch_s, 0) << to_string(o);
        }
      }
      if (field == 0) {
        // Every optimizer launches kernels: each step gets strictly slower.
        for (ComparedOptimizer o : compared_optimizers()) EXPECT_GT(r.steps.at(o).optimizer_s, base.steps.at(o).optimizer_s);
      }
    }
  }
}

TEST(Simulator, DMuonIsNeverFasterThanAdamW) {
  // The owner-aligned layout moves the same bytes as FSDP's in blocks that are uneven, never smaller at
  // the largest; the optimizer does AdamW's memory traffic and Newton–Schulz on top.
  std::vector<std::pair<std::string, std::vector<ParamSpec>>> models = {
      {"small", small_model()}, {"qwen2.5-0.5b", load_model_manifest("qwen2.5-0.5b", 2)},
      {"qwen2.5-7b", load_model_manifest("qwen2.5-7b", 4)}};
  std::vector<HardwareProfile> profiles = {test_profile(), load_hardware_profile("a800"),
                                           load_hardware_profile("h200")};
  HardwareProfile cpu = test_profile();
  cpu.shared_cores = 2;
  cpu.calibration_ranks = 2;
  cpu.batched_kernels = false;
  profiles.push_back(cpu);
  for (const auto& [name, params] : models) {
    for (const HardwareProfile& hw : profiles) {
      for (int devices : {1, 2, 4, 8, 16, 64, 256}) {
        const SimResult r = simulate_step(params, hw, {devices, 8}, quick_options());
        const StepBreakdown& dm = r.steps.at(ComparedOptimizer::dmuon);
        const StepBreakdown& adamw = r.steps.at(ComparedOptimizer::adamw);
        EXPECT_GE(dm.step_s, adamw.step_s) << name << " on " << hw.name << " at " << devices << " devices";
        EXPECT_GE(dm.step_s - dm.optimizer_s, (adamw.step_s - adamw.optimizer_s) * (1 - 1e-12))
            << name << " on " << hw.name << " at " << devices << " devices: forward+backward";
        EXPECT_GT(dm.optimizer_s, adamw.optimizer_s) << name << " on " << hw.name << " at " << devices;
      }
    }
  }
}

TEST(HardwareProfile, SharedCoresSplitTheMachineAmongRanks) {
  HardwareProfile hw = test_profile();
  EXPECT_EQ(at_devices(hw, 64).peak_flops, hw.peak_flops);  // own hardware per device: unchanged
  hw.shared_cores = 2;
  hw.calibration_ranks = 2;  // measured with one core per rank
  hw.single_rank_speedup = 1.5;  // a rank alone with both cores: 1.5x a rank of the pair
  hw.single_rank_ns_speedup = 1.8;
  const HardwareProfile four = at_devices(hw, 4), one = at_devices(hw, 1);
  EXPECT_DOUBLE_EQ(four.peak_flops, hw.peak_flops / 2);  // half a core each
  EXPECT_DOUBLE_EQ(four.ns_flops, hw.ns_flops / 2);
  EXPECT_DOUBLE_EQ(four.hbm_bytes_per_s, hw.hbm_bytes_per_s / 2);
  EXPECT_DOUBLE_EQ(four.kernel_launch_s, hw.kernel_launch_s * 2);
  EXPECT_DOUBLE_EQ(four.intra_node_latency_s, hw.intra_node_latency_s * 2);
  EXPECT_DOUBLE_EQ(one.peak_flops, hw.peak_flops * 1.5);  // two BLAS threads, as measured
  EXPECT_DOUBLE_EQ(one.ns_flops, hw.ns_flops * 1.8);
  EXPECT_DOUBLE_EQ(one.hbm_bytes_per_s, hw.hbm_bytes_per_s);  // single-threaded code: one core either way
  hw.shared_cores = 4;
  hw.calibration_ranks = 4;  // 4 cores, 4 ranks; alone 2.5x: at 2 ranks 1 + 1.5·(4/2 − 1)/(4 − 1) = 1.5x
  hw.single_rank_ns_speedup = 2.5;
  EXPECT_DOUBLE_EQ(at_devices(hw, 2).ns_flops, hw.ns_flops * 1.5);
  EXPECT_DOUBLE_EQ(at_devices(hw, 2).hbm_bytes_per_s, hw.hbm_bytes_per_s);
  EXPECT_DOUBLE_EQ(at_devices(hw, 1).ns_flops, hw.ns_flops * 2.5);
  hw.shared_cores = 2;
  hw.calibration_ranks = 1;  // measured alone with both cores
  EXPECT_DOUBLE_EQ(at_devices(hw, 4).peak_flops, hw.peak_flops / 4);
  EXPECT_DOUBLE_EQ(at_devices(hw, 4).hbm_bytes_per_s, hw.hbm_bytes_per_s / 2);
  EXPECT_THROW(at_devices(hw, 0), Error);
}

TEST(Simulator, MoreBandwidthOrFlopsIsNeverSlower) {
  const auto params = small_model();
  const HardwareProfile base = test_profile();
  std::vector<HardwareProfile> faster;
  for (int field = 0; field < 7; ++field) {
    HardwareProfile hw = base;
    double* fields[] = {&hw.peak_flops,          &hw.ns_flops,     &hw.hbm_bytes_per_s, &hw.intra_node_bytes_per_s,
                        &hw.inter_node_bytes_per_s, &hw.syrk_speedup, &hw.sym_gemm_speedup};
    *fields[field] *= 2;
    faster.push_back(hw);
  }
  for (int devices : {2, 8, 16, 64}) {
    const SimResult slow = simulate_step(params, base, {devices, 8}, quick_options());
    for (size_t f = 0; f < faster.size(); ++f) {
      const SimResult fast = simulate_step(params, faster[f], {devices, 8}, quick_options());
      for (ComparedOptimizer o : compared_optimizers()) {
        EXPECT_LE(fast.steps.at(o).step_s, slow.steps.at(o).step_s * (1 + 1e-12))
            << to_string(o) << " at " << devices << " devices, field " << f;
        EXPECT_LE(fast.steps.at(o).optimizer_s, slow.steps.at(o).optimizer_s * (1 + 1e-12));
      }
    }
  }
}

TEST(Simulator, OwnerExecutionDoesLessOptimizerWorkThanGatherThenCompute) {
  const SimResult r = simulate_step(small_model(), test_profile(), {8, 8}, quick_options());
  const double dmuon = r.steps.at(ComparedOptimizer::dmuon).optimizer_s;
  EXPECT_LT(dmuon, r.steps.at(ComparedOptimizer::muon_gather).optimizer_s);
  EXPECT_LT(r.steps.at(ComparedOptimizer::muon_gather).optimizer_s, r.steps.at(ComparedOptimizer::muon_gather_plain).optimizer_s);
  EXPECT_GT(r.steps.at(ComparedOptimizer::muon_gather_plain).optimizer_comm_s, 0);
  EXPECT_EQ(r.plan.ranks, 8);
}

// A matrix split for Newton–Schulz (SimOptions::ns_blocks, optim.hpp's muon_blocks) runs its blocks: gather-then-
// compute's NS is the batched cost of the blocks' shapes (ns_cost, by hand), DMuon's plan is make_plan's with the
// blocks costed; the bytes stay the whole matrices'. A split into one block per matrix changes nothing.
TEST(Simulator, SplitMatricesRunTheirBlocks) {
  const std::vector<ParamSpec> params = small_model();
  const HardwareProfile hw = test_profile();
  std::vector<std::vector<MatrixBlock>> one_block(params.size()), heads(params.size());
  std::map<std::pair<int64_t, int64_t>, int> shapes;  // what gather-then-compute orthogonalizes, by hand
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& p = params[i];
    if (p.role != ParamRole::matrix) continue;
    one_block[i] = {MatrixBlock{0, 0, p.rows(), p.cols()}};
    heads[i] = one_block[i];
    if (p.name.ends_with("proj")) {  // 256×256 by 4 heads of 64 rows
      heads[i].clear();
      for (int64_t h = 0; h < 4; ++h) heads[i].push_back(MatrixBlock{64 * h, 0, 64, 256});
    }
    for (const MatrixBlock& b : heads[i]) ++shapes[{b.rows, b.cols}];
  }
  SimOptions o = quick_options();
  const SimResult base = simulate_step(params, hw, {8, 8}, o);
  o.ns_blocks = one_block;
  const SimResult unsplit = simulate_step(params, hw, {8, 8}, o);
  o.ns_blocks = heads;
  const SimResult split = simulate_step(params, hw, {8, 8}, o);
  for (ComparedOptimizer c : compared_optimizers()) {
    EXPECT_EQ(unsplit.steps.at(c).step_s, base.steps.at(c).step_s) << to_string(c);
    EXPECT_EQ(split.steps.at(c).bytes_per_device, base.steps.at(c).bytes_per_device) << to_string(c);
  }
  const HardwareProfile at8 = at_devices(hw, 8);
  double gather_ns = 0;
  for (const auto& [shape, count] : shapes)
    gather_ns += ns_cost(shape.first, shape.second, count, NsEngine::dmuon, at8).total_s;
  EXPECT_DOUBLE_EQ(split.steps.at(ComparedOptimizer::muon_gather).optimizer_ns_s, gather_ns);
  EXPECT_NE(split.steps.at(ComparedOptimizer::muon_gather).optimizer_ns_s,
            base.steps.at(ComparedOptimizer::muon_gather).optimizer_ns_s);
  const BatchTimeFn dmuon_time = [&at8](int64_t rows, int64_t cols, int batch) {
    return ns_time_s(rows, cols, batch, NsEngine::dmuon, at8);
  };
  const Plan want = make_plan(params, make_plan_items(params, 8, dmuon_time, heads), 8, o.plan);
  EXPECT_EQ(split.plan.owner, want.owner);
  EXPECT_DOUBLE_EQ(split.plan.makespan_s, want.makespan_s);
  o.ns_blocks.pop_back();
  EXPECT_THROW(simulate_step(params, hw, {8, 8}, o), Error);
}

TEST(HardwareProfile, ShippedProfilesLoadWithSources) {
  for (const char* name : {"a800", "h200"}) {
    const HardwareProfile hw = load_hardware_profile(name);
    EXPECT_EQ(hw.name, name);
    EXPECT_GT(hw.peak_flops, 1e14);
    EXPECT_TRUE(hw.sources.count("peak_flops")) << name;
    EXPECT_TRUE(hw.sources.count("inter_node_bytes_per_s")) << name;
    EXPECT_TRUE(hw.sources.count("syrk_speedup")) << name;
    EXPECT_TRUE(hw.sources.count("sym_gemm_speedup")) << name;
    EXPECT_GT(hw.syrk_speedup, 1);
    EXPECT_LT(hw.syrk_speedup, 2);  // not half the time: measured kernels do not reach it
    EXPECT_EQ(hw.shared_cores, 0);
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
