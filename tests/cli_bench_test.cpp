// The benchmark commands end to end at 2 ranks on a tiny Qwen2-shaped model: `dmuon bench optimizer`,
// `bench ablation`, `bench e2e` and `bench calibrate` print JSON with the expected keys and finite figures, the Muon
// variants compute the same weights, and the counted traffic matches the collectives' sizes.
// No timing is asserted.
#include <gtest/gtest.h>

#include <cmath>
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
  EXPECT_TRUE(positive_finite(j.at("dmuon_overhead_vs_adamw").get<double>() + 1));
  EXPECT_TRUE(positive_finite(by_name["muon-gather-plain"].at("dmuon_speedup")));
  // The Muon variants run the same math (plain, tuned standard or Gram NS): after 2 steps of the same
  // gradients their weights agree to NS's float32 differences (DESIGN 2.2: Gram within 2e-4 of standard).
  EXPECT_LT(j.at("muon_weight_norm_rel_spread").get<double>(), 1e-3);
  // Gather-then-compute sends every Muon matrix's update once more than DMuon, as a ring over 2 ranks:
  // (2−1)/2 of the float32 bytes; both send the same small all-reduces otherwise.
  const double extra = by_name["muon-gather"].at("sent_bytes_per_rank").get<double>() -
                       by_name["dmuon"].at("sent_bytes_per_rank").get<double>();
  EXPECT_DOUBLE_EQ(extra, kMatrixElements * 4 / 2);
  // DMuon's NS per rank: measured in the step (each rank owns matrices here, so a positive time) beside
  // the owner plan's prediction; the gather variants run NS on every rank and predict nothing.
  const auto& dmuon = by_name["dmuon"];
  ASSERT_EQ(dmuon.at("ns_s_per_rank").size(), 2u) << dmuon;
  ASSERT_EQ(dmuon.at("predicted_ns_s_per_rank").size(), 2u) << dmuon;
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(positive_finite(dmuon.at("ns_s_per_rank")[r])) << dmuon;
    EXPECT_TRUE(positive_finite(dmuon.at("predicted_ns_s_per_rank")[r])) << dmuon;
  }
  EXPECT_EQ(by_name["muon-gather"].at("ns_s_per_rank").size(), 2u);
  EXPECT_FALSE(by_name["muon-gather"].contains("predicted_ns_s_per_rank"));
  EXPECT_FALSE(by_name["adamw"].contains("ns_s_per_rank"));
  // The gradient reduce before the step moves the same bytes in both layouts (DESIGN 3.1).
  EXPECT_DOUBLE_EQ(by_name["dmuon"].at("backward_sent_bytes_per_rank").get<double>(),
                   by_name["adamw"].at("backward_sent_bytes_per_rank").get<double>());
}

TEST(CliBench, AblationAtTwoRanks) {
  test::TempDir dir;
  const auto j =
      run_json("bench ablation --model " + tiny_model(dir) + " --steps 1 --json --tune-cache " + dir.file("tune.json"));
  ASSERT_TRUE(j.is_object());
  ASSERT_EQ(j.at("parts").size(), 6u);
  double total = 0;
  for (const auto& p : j.at("parts")) {
    EXPECT_TRUE(positive_finite(p.at("step_s"))) << p;
    EXPECT_TRUE(positive_finite(p.at("slowdown"))) << p;
    EXPECT_GE(p.at("share_pct").get<double>(), 0) << p;
    total += p.at("share_pct").get<double>();
  }
  EXPECT_TRUE(std::abs(total - 100) < 1e-6 || total == 0) << total;
  EXPECT_EQ(j.at("groups").size(), 3u);
}

TEST(CliBench, EndToEndAtTwoRanks) {
  test::TempDir dir;
  const auto j = run_json("bench e2e --config demo --steps 1 --warmup 1 --json --tune-cache " + dir.file("tune.json"));
  ASSERT_TRUE(j.is_object());
  ASSERT_EQ(j.at("results").size(), 3u);
  for (const auto& r : j.at("results")) {
    EXPECT_TRUE(positive_finite(r.at("step_s_median"))) << r;
    EXPECT_TRUE(positive_finite(r.at("fwd_bwd_s"))) << r;
    EXPECT_TRUE(positive_finite(r.at("optimizer_s"))) << r;
  }
  EXPECT_TRUE(positive_finite(j.at("dmuon_overhead_vs_adamw").get<double>() + 1));
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
  const sim::HardwareProfile hw = sim::load_hardware_profile(dir.file("hw.json"));
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
