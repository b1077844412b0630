// The benchmark commands end to end at 2 ranks on a tiny Qwen2-shaped model: `dmuon bench optimizer`,
// `bench ablation`, `bench e2e` and `bench calibrate` print JSON with the expected keys and finite figures, the Muon
// variants compute the same weights, the counted traffic equals the closed form of each layout's collectives, and
// the derived figures (overheads, speedups, shares, the plan's makespan) follow from the measured ones as their
// definitions say. No timing is asserted against a number.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>

#include "dmuon/atomic_file.hpp"
#include "dmuon/sim.hpp"
#include "test_data.hpp"

namespace dmuon {
namespace {

// hidden 64, MLP 128, 4 heads of 16 (2 KV heads), vocab 256, 2 layers.
constexpr const char* kTinyModel = R"({
  "name": "tiny", "description": "test model", "sources": {"config": "made up for tests"},
  "components": [{"config": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    "tie_word_embeddings": true}}]
})";

// Muon elements of kTinyModel: per layer q, o 64×64; k, v 32×64; gate, up 128×64; down 64×128.
constexpr double kMatrixElements = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64);
// All its elements: the matrices, the tied embedding 256×64, per layer two norms of 64 and the q, k, v
// biases (64, 32, 32), and the final norm.
constexpr double kElements = kMatrixElements + 256 * 64 + 2 * (2 * 64 + 64 + 32 + 32) + 64;

// Runs the CLI at 2 ranks and parses the JSON it printed (MPI or BLAS may add lines around it).
nlohmann::json run_json(const std::string& args) {
  const auto r = test::run_cli(args, 2);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const auto begin = r.output.find('{'), end = r.output.rfind('}');
  if (begin == std::string::npos || end == std::string::npos) {
    ADD_FAILURE() << "no JSON in: " << r.output;
    return {};
  }
  return nlohmann::json::parse(r.output.substr(begin, end - begin + 1));
}

// Writes kTinyModel into `dir`; returns its path.
std::string tiny_model(const test::TempDir& dir) {
  write_file_atomically(dir.file("tiny.json"), kTinyModel);
  return dir.file("tiny.json");
}

bool positive_finite(const nlohmann::json& v) {
  return v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() > 0;
}

TEST(CliBench, OptimizerAtTwoRanks) {
  test::TempDir dir;
  const auto j = run_json("bench optimizer --model " + tiny_model(dir) + " --steps 2 --json --tune-cache " +
                          dir.file("tune.json"));
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j.at("ranks"), 2);
  EXPECT_GE(j.at("threads_per_rank").get<int>(), 1);
  EXPECT_TRUE(j.at("oversubscribed").is_boolean());
  const auto& results = j.at("results");
  ASSERT_EQ(results.size(), 4u);
  std::map<std::string, nlohmann::json> by_name;
  for (const auto& r : results) {
    by_name[r.at("optimizer")] = r;
    EXPECT_TRUE(positive_finite(r.at("step_s_median"))) << r;
    EXPECT_EQ(r.at("step_s").size(), 2u) << r;
    EXPECT_TRUE(positive_finite(r.at("weight_norm"))) << r;
    EXPECT_TRUE(r.at("exposed_comm_s").get<double>() >= 0) << r;
  }
  for (const char* name : {"adamw", "muon-gather-plain", "muon-gather", "dmuon"})
    ASSERT_TRUE(by_name.count(name)) << name;
  const auto median_s = [&](const char* name) { return by_name[name].at("step_s_median").get<double>(); };
  EXPECT_DOUBLE_EQ(j.at("dmuon_overhead_vs_adamw").get<double>(), median_s("dmuon") / median_s("adamw") - 1);
  for (const char* name : {"adamw", "muon-gather-plain", "muon-gather"})
    EXPECT_DOUBLE_EQ(by_name[name].at("dmuon_speedup").get<double>(), median_s(name) / median_s("dmuon")) << name;
  EXPECT_FALSE(by_name["dmuon"].contains("dmuon_speedup"));
  // The Muon variants run the same math (plain, tuned standard or Gram NS): after 2 steps of the same
  // gradients their weights agree to NS's float32 differences (DESIGN 2.2: Gram within 2e-4 of standard).
  EXPECT_LT(j.at("muon_weight_norm_rel_spread").get<double>(), 1e-3);
  // Traffic per rank as a ring over 2 ranks moves (2−1)/2 of a collective's bytes, an all-reduce twice that.
  // In the step every optimizer all-reduces {Σ g², non-finite count} (2 doubles: 16 bytes out); gather-then-
  // compute also all-gathers every Muon matrix's float32 update, and DMuon nothing more. Before it, the
  // z2 hooks gather each unit once and reduce-scatter its float32 gradients, in either layout.
  const double norm_bytes = 2 * 8 / 2.0 * 2;
  EXPECT_DOUBLE_EQ(by_name["adamw"].at("sent_bytes_per_rank").get<double>(), norm_bytes);
  EXPECT_DOUBLE_EQ(by_name["dmuon"].at("sent_bytes_per_rank").get<double>(), norm_bytes);
  for (const char* name : {"muon-gather-plain", "muon-gather"})
    EXPECT_DOUBLE_EQ(by_name[name].at("sent_bytes_per_rank").get<double>(), norm_bytes + kMatrixElements * 4 / 2)
        << name;
  for (const char* name : {"adamw", "muon-gather-plain", "muon-gather", "dmuon"})
    EXPECT_DOUBLE_EQ(by_name[name].at("backward_sent_bytes_per_rank").get<double>(), 2 * kElements * 4 / 2) << name;
  // DMuon's NS per rank: measured in the step (each rank owns matrices here, so a positive time) beside
  // the owner plan's prediction; the gather variants run NS on every rank and predict nothing.
  const auto& dmuon = by_name["dmuon"];
  ASSERT_EQ(dmuon.at("ns_s_per_rank").size(), 2u) << dmuon;
  ASSERT_EQ(dmuon.at("predicted_ns_s_per_rank").size(), 2u) << dmuon;
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(positive_finite(dmuon.at("ns_s_per_rank")[r])) << dmuon;
    EXPECT_TRUE(positive_finite(dmuon.at("predicted_ns_s_per_rank")[r])) << dmuon;
  }
  // The prediction per rank is the MILP plan's load for that rank: the plan's makespan is its largest.
  const auto& predicted = dmuon.at("predicted_ns_s_per_rank");
  EXPECT_DOUBLE_EQ(std::max(predicted[0].get<double>(), predicted[1].get<double>()),
                   j.at("plan").at("predicted_makespan_s").get<double>());
  EXPECT_EQ(by_name["muon-gather"].at("ns_s_per_rank").size(), 2u);
  EXPECT_FALSE(by_name["muon-gather"].contains("predicted_ns_s_per_rank"));
  EXPECT_FALSE(by_name["adamw"].contains("ns_s_per_rank"));
  // Memory per rank: the bytes counted in every Buffer each optimizer holds between steps are, on every rank, the
  // simulator's model of them (sim::rank_memory, what `dmuon simulate` reports at scale), byte for byte; its pooled
  // Newton–Schulz workspace is part of them (none for AdamW), and a later step allocates nothing more (its buffers
  // are kept).
  for (const char* name : {"adamw", "muon-gather-plain", "muon-gather", "dmuon"}) {
    const auto& r = by_name[name];
    ASSERT_EQ(r.at("held_bytes_per_rank").size(), 2u) << r;
    for (int rank = 0; rank < 2; ++rank) {
      const double held = r.at("held_bytes_per_rank")[rank].get<double>();
      EXPECT_GT(held, 0) << name;
      EXPECT_EQ(held, r.at("model_held_bytes_per_rank")[rank].get<double>()) << name << " rank " << rank;
      EXPECT_LE(r.at("ns_workspace_bytes_per_rank")[rank].get<double>(), held) << name;
      EXPECT_EQ(r.at("step_peak_bytes_per_rank")[rank].get<double>(), 0) << name << " rank " << rank;
    }
  }
  EXPECT_EQ(by_name["adamw"].at("ns_workspace_bytes_per_rank")[0].get<double>(), 0);
}

TEST(CliBench, AblationAtTwoRanks) {
  test::TempDir dir;
  const auto j =
      run_json("bench ablation --model " + tiny_model(dir) + " --steps 1 --json --tune-cache " + dir.file("tune.json"));
  ASSERT_TRUE(j.is_object());
  ASSERT_EQ(j.at("parts").size(), 6u);
  // share_i = max(0, ln slowdown_i) / Σ_j max(0, ln slowdown_j), in percent; all 0 when no removal slowed
  // the step (possible on a loaded machine: then Σ is 0). Groups add their parts' shares.
  double log_sum = 0, lo = INFINITY, hi = 0;
  for (const auto& p : j.at("parts")) {
    EXPECT_TRUE(positive_finite(p.at("step_s"))) << p;
    EXPECT_TRUE(positive_finite(p.at("slowdown"))) << p;
    log_sum += std::max(0.0, std::log(p.at("slowdown").get<double>()));
    lo = std::min(lo, p.at("weight_norm").get<double>());
    hi = std::max(hi, p.at("weight_norm").get<double>());
  }
  std::map<std::string, double> group_share;
  double total = 0;
  for (const auto& p : j.at("parts")) {
    const double want = log_sum > 0 ? 100 * std::max(0.0, std::log(p.at("slowdown").get<double>())) / log_sum : 0;
    EXPECT_NEAR(p.at("share_pct").get<double>(), want, 1e-9) << p;
    group_share[p.at("group")] += p.at("share_pct").get<double>();
    total += p.at("share_pct").get<double>();
  }
  EXPECT_NEAR(total, log_sum > 0 ? 100 : 0, 1e-9);
  ASSERT_EQ(j.at("groups").size(), 3u);
  for (const auto& g : j.at("groups")) EXPECT_NEAR(g.at("share_pct").get<double>(), group_share[g.at("group")], 1e-9) << g;
  // Every variant without a part still computes Muon: the same weights (as muon_weight_norm_rel_spread above).
  EXPECT_LT((hi - lo) / hi, 1e-3) << lo << " vs " << hi;
}

TEST(CliBench, EndToEndAtTwoRanks) {
  test::TempDir dir;
  const auto j = run_json("bench e2e --config demo --steps 1 --warmup 1 --json --tune-cache " + dir.file("tune.json"));
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j.at("batch").get<int>(), 64);  // the demo configuration: 64 sequences of 64 tokens
  EXPECT_EQ(j.at("tokens_per_step").get<int>(), 64 * 64);
  ASSERT_EQ(j.at("results").size(), 3u);
  std::map<std::string, double> step_s;
  for (const auto& r : j.at("results")) {
    EXPECT_TRUE(positive_finite(r.at("step_s_median"))) << r;
    EXPECT_TRUE(positive_finite(r.at("fwd_bwd_s"))) << r;
    EXPECT_TRUE(positive_finite(r.at("optimizer_s"))) << r;
    // Each rank's step contains its forward+backward and its optimizer step; one timed step, so the
    // medians are that step's slowest-rank figures, and the step's is at least each part's.
    EXPECT_GE(r.at("step_s_median").get<double>(), r.at("fwd_bwd_s").get<double>()) << r;
    EXPECT_GE(r.at("step_s_median").get<double>(), r.at("optimizer_s").get<double>()) << r;
    step_s[r.at("optimizer")] = r.at("step_s_median").get<double>();
  }
  ASSERT_EQ(step_s.size(), 3u);
  EXPECT_DOUBLE_EQ(j.at("dmuon_overhead_vs_adamw").get<double>(), step_s["dmuon"] / step_s["adamw"] - 1);
  for (const auto& r : j.at("results")) {
    if (r.at("optimizer") != "dmuon") {
      EXPECT_DOUBLE_EQ(r.at("dmuon_speedup").get<double>(), step_s[r.at("optimizer")] / step_s["dmuon"]) << r;
    }
  }
}

TEST(CliBench, CalibrateWritesAProfile) {
  test::TempDir dir;
  const auto r = test::run_cli("bench calibrate --model " + tiny_model(dir) + " --out " + dir.file("hw.json"), 2);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(read_file(dir.file("hw.json")));
  for (const char* key : {"peak_flops", "mfu", "ns_flops", "ns_efficiency", "hbm_bytes_per_s", "intra_node_bytes_per_s",
                          "inter_node_bytes_per_s", "intra_node_latency_s", "inter_node_latency_s", "kernel_launch_s",
                          "sm_count", "comm_bytes_per_element", "syrk_speedup", "sym_gemm_speedup",
                          "ns_bytes_per_element", "shared_cores", "calibration_ranks", "single_rank_speedup",
                          "single_rank_ns_speedup"})
    EXPECT_TRUE(positive_finite(j.at(key))) << key;
  EXPECT_EQ(j.at("calibration_ranks").get<int>(), 2);
  EXPECT_FALSE(j.at("batched_kernels").get<bool>());
  EXPECT_LE(j.at("ns_efficiency").get<double>(), 1.0);
  // The simulator accepts it as a hardware profile.
  const HardwareProfile hw = load_hardware_profile(dir.file("hw.json"));
  EXPECT_EQ(hw.name, "this-cpu");
  EXPECT_EQ(hw.sources.size(), j.at("sources").size());
}

TEST(CliBench, SimulatesTheGptExampleAsBenchE2eSplitsIt) {
  const auto r = test::run_cli("simulate --gpt demo --profile a800 --devices 1,2,4 --gpus-per-node 4 --json", 1);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  EXPECT_EQ(j.at("gpt").at("batch_sequences").get<int>(), 64);  // bench e2e --config demo's batch
  ASSERT_EQ(j.at("results").size(), 3u);
  for (const auto& row : j.at("results")) {
    // 64 sequences of 64 tokens over the devices.
    EXPECT_DOUBLE_EQ(row.at("tokens_per_device").get<double>(), 64.0 * 64 / row.at("devices").get<int>()) << row;
    for (const char* key : {"optimizer_ns_s", "optimizer_elementwise_s", "optimizer_launch_s", "fwd_bwd_s"})
      EXPECT_TRUE(positive_finite(row.at("dmuon").at(key))) << key;
    EXPECT_GE(row.at("dmuon").at("step_s").get<double>(), row.at("adamw").at("step_s").get<double>());
  }
  const auto bad = test::run_cli("simulate --gpt demo --model gpt2 --profile a800", 1);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("--gpt"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace dmuon
