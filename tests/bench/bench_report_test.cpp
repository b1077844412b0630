// dmuon-bench-report (bench/report) on a tiny folder of benchmark output: the headline figures computed from the fixture's
// numbers, the tables in the optimizer order, the command lines from the .cmd files, a note in place of each
// benchmark that did not run, and errors naming the file and the key for corrupt input.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "dmuon/atomic_file.hpp"
#include "test_data.hpp"

namespace dmuon {
namespace {

// Benchmark output as scripts/bench.sh leaves it; everything else (np 1 and 4, ablation, Pi0, ...) did not run.
// Measured at np 2: AdamW 250 ms, muon-gather-plain 2000 ms, muon-gather 1000 ms, DMuon 500 ms (listed out of
// table order). Simulated at 2 devices: 500, 2600, 960, 600 ms.
const std::map<std::string, std::string> kFixture = {
    {"date.txt", "2026-01-02T03:04Z\n"},
    {"optimizer-np2.json.cmd", "mpirun -np 2 build/dmuon bench optimizer --steps 3 --json\n"},
    // mpirun may print lines around the JSON.
    {"optimizer-np2.json", R"json(a warning from mpirun
{"cpu": "Test CPU", "cores": 2, "blas": "TestBLAS 1.0", "threads_per_rank": 1, "oversubscribed": false,
 "muon_weight_norm_rel_spread": 1e-9, "dmuon_overhead_vs_adamw": 1.0,
 "plan": {"balancer": "milp", "fell_back": false, "predicted_makespan_s": 0.4, "rr_predicted_makespan_s": 0.6},
 "results": [
  {"optimizer": "dmuon", "step_s_median": 0.5, "sent_bytes_per_rank": 1e6, "exposed_comm_s": 0.002,
   "weight_norm": 2.5, "ns_s_per_rank": [0.45, 0.5], "predicted_ns_s_per_rank": [0.4, 0.4]},
  {"optimizer": "adamw", "step_s_median": 0.25, "sent_bytes_per_rank": 16, "exposed_comm_s": 0.001,
   "weight_norm": 3.0, "dmuon_speedup": 0.5},
  {"optimizer": "muon-gather-plain", "step_s_median": 2.0, "sent_bytes_per_rank": 3e6, "exposed_comm_s": 0.01,
   "weight_norm": 2.5, "dmuon_speedup": 4.0},
  {"optimizer": "muon-gather", "step_s_median": 1.0, "sent_bytes_per_rank": 3e6, "exposed_comm_s": 0.01,
   "weight_norm": 2.5, "dmuon_speedup": 2.0}]}
done)json"},
    {"e2e-demo-np2.json.cmd", "mpirun -np 2 build/dmuon bench e2e --config demo --json\n"},
    {"e2e-demo-np2.json", R"json({"threads_per_rank": 1, "oversubscribed": false, "dmuon_overhead_vs_adamw": 0.25,
 "batch": 64, "tokens_per_step": 4096,
 "results": [
  {"optimizer": "adamw", "step_s_median": 0.1, "fwd_bwd_s": 0.09, "optimizer_s": 0.002, "comm_wait_s": 0.005,
   "dmuon_speedup": 0.8},
  {"optimizer": "muon-gather-plain", "step_s_median": 0.2, "fwd_bwd_s": 0.09, "optimizer_s": 0.1,
   "comm_wait_s": 0.005, "dmuon_speedup": 1.6},
  {"optimizer": "dmuon", "step_s_median": 0.125, "fwd_bwd_s": 0.09, "optimizer_s": 0.03, "comm_wait_s": 0.005}]})json"},
    // Killed before it printed its JSON.
    {"e2e-demo-np4.json", "mpirun noticed that process rank 0 exited on signal 9\n"},
    {"this-cpu.json", R"json({"ns_flops": 5e10, "ns_efficiency": 0.5, "hbm_bytes_per_s": 1e10,
 "intra_node_bytes_per_s": 2e9, "intra_node_latency_s": 5e-6, "kernel_launch_s": 2e-6})json"},
    // 4 devices has no measured run to compare with.
    {"sim-this-cpu.json", R"json({"results": [
  {"devices": 2, "adamw": {"optimizer_s": 0.5}, "muon-gather-plain": {"optimizer_s": 2.6},
   "muon-gather": {"optimizer_s": 0.96}, "dmuon": {"optimizer_s": 0.6}},
  {"devices": 4, "adamw": {"optimizer_s": 0.5}, "muon-gather-plain": {"optimizer_s": 2.6},
   "muon-gather": {"optimizer_s": 0.96}, "dmuon": {"optimizer_s": 0.6}}]})json"},
    // The GPT demo simulated at 2 devices: training steps 110, 220, 150 ms against measured 100, 200, 125 ms.
    {"sim-gpt-demo-this-cpu.json", R"json({"results": [
  {"devices": 2, "adamw": {"step_s": 0.11}, "muon-gather-plain": {"step_s": 0.22}, "dmuon": {"step_s": 0.15}}]})json"},
    {"sim-qwen7b-a800.json.cmd", "build/dmuon simulate --model qwen2.5-7b --json\n"},
    {"sim-qwen7b-a800.json", R"json({"syrk_speedup": 1.7, "sym_gemm_speedup": 1.6, "results": [
  {"devices": 8, "adamw": {"step_s": 1.0, "optimizer_s": 0.01}, "muon-gather-plain": {"step_s": 1.5, "optimizer_s": 0.6},
   "muon-gather": {"step_s": 1.2, "optimizer_s": 0.2}, "dmuon": {"step_s": 1.02, "optimizer_s": 0.02}},
  {"devices": 16, "adamw": {"step_s": 1.0, "optimizer_s": 0.01}, "muon-gather-plain": {"step_s": 2.0, "optimizer_s": 0.9},
   "muon-gather": {"step_s": 1.2, "optimizer_s": 0.1}, "dmuon": {"step_s": 0.99, "optimizer_s": 0.015}}]})json"},
};

// Runs the report generator, a developer tool beside the benchmarks (not a dmuon subcommand).
test::CommandResult report(const std::string& args) {
  return test::run_command(std::string(DMUON_BENCH_REPORT_PATH) + " " + args);
}

void write_fixture(const test::TempDir& dir) {
  for (const auto& [name, text] : kFixture) write_file_atomically(dir.file(name), text);
}

// Every expected line must be a whole line of the report.
void expect_lines(const std::string& report, const std::vector<std::string>& lines) {
  for (const auto& line : lines) EXPECT_NE(report.find("\n" + line + "\n"), std::string::npos) << line;
}

TEST(BenchReport, HeadlineFiguresTablesAndCommands) {
  test::TempDir dir;
  write_fixture(dir);
  const auto r = report("--dir " + dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_lines(
      r.output,
      {"Machine: **Test CPU**, 2 cores, TestBLAS 1.0. Date: 2026-01-02T03:04Z. The machine is shared with other jobs, "
       "so every table compares variants measured side by side in one run (one process per rank, variants "
       "interleaved step by step), never figures from different runs.",
       // Headline figures: 500 ms; 2000 / 500; 1000 / 500.
       "- Optimizer step, Qwen2.5-0.5B (4 layers), np 2: DMuon 500.0 ms, 4.00x faster than muon-gather-plain (paper "
       "baseline) and 2.00x faster than muon-gather (same NS engine).",
       // 125 / 100 ms - 1; 200 / 125 ms.
       "- End to end, GPT demo, np 2: DMuon +25.0% step time over AdamW, 1.60x faster than muon-gather-plain.",
       "- End to end, GPT demo, np 2, DMuon's overhead over AdamW by tokens per step: +25.0% at 4096 (paper +2%).",
       // The tokens-per-step sweep: only the default batch ran.
       "| 64 | 4096 | 100.0 | 125.0 | 30.0 | +25.0% |",
       "- *Not run: " + dir.file("e2e-demo-np2-b256.json") + ".*",
       // Simulated / measured - 1: 500/250, 2600/2000, 960/1000, 600/500; ratios (2600/600) / (2000/500) and
       // (960/600) / (1000/500).
       "- Simulator with the `this-cpu` profile against measured optimizer steps: absolute times 2 of 4 within 25% "
       "(np 2 adamw +100%, np 2 muon-gather-plain +30%, np 2 muon-gather -4%, np 2 dmuon +20%); speedup ratios 2 of "
       "2 within 25% (+8%, -20%).",
       // 110 / 100, 220 / 200, 150 / 125; ratio (220 / 150) / (200 / 125).
       "- Simulator with the `this-cpu` profile against measured GPT demo training steps: absolute times 3 of 3 "
       "within 25% (np 2 adamw +10%, np 2 muon-gather-plain +10%, np 2 dmuon +20%); speedup ratios 1 of 1 within 25% "
       "(-8%).",
       // 600 / 20 ms at 8 devices, 900 / 15 ms at 16.
       "- Simulated Qwen2.5-7B on 8-256 A800s: DMuon's optimizer step 30.0x - 60x faster than muon-gather-plain "
       "(paper: 6.85x - 163x).",
       // Command lines.
       "`mpirun -np 2 build/dmuon bench optimizer --steps 3 --json`",
       "`mpirun -np 2 build/dmuon bench e2e --config demo --json`", "`build/dmuon simulate --model qwen2.5-7b --json`",
       "`(not run)` against the measured optimizer steps of section 1 (error = simulated / measured - 1; goal within "
       "25%):",
       // Tables.
       "| optimizer | step ms | sent MB/rank | exposed ms | weight norm | vs AdamW | DMuon speedup |",
       "|---|---|---|---|---|---|---|", "| adamw | 250.0 | 0.0 | 1.0 | 3 | 1.000x | 0.50x |",
       "| dmuon | 500.0 | 1.0 | 2.0 | 2.5 | 2.000x |  |",
       "Plan: milp, predicted NS makespan 400.0 ms (round-robin: 600.0 ms). Muon variants' weight norms agree within "
       "1.0e-09 (same math). DMuon's overhead over AdamW: +100%.",
       // 400 / 450 - 1, 400 / 500 - 1.
       "DMuon's Newton-Schulz per rank, predicted by the plan from the tune cache / measured in the step: rank 0 "
       "400.0 / 450.0 ms (-11%), rank 1 400.0 / 500.0 ms (-20%).",
       "| muon-gather-plain | 200.0 | 90.0 | 100.0 | 5.0 | 2.000x | 1.60x |",
       "sgemm 50 GFLOP/s per rank, plain-NS efficiency 0.50, AdamW stream 10.0 GB/s, link 2.00 GB/s, latency 5.0 us, "
       "per-call 2.0 us.",
       "| 2 | muon-gather-plain | 2000.0 | 2600.0 | +30% |", "| 2 | muon-gather / dmuon | 2.00x | 1.60x | -20% |",
       "| 8 | 600.0 | 20.0 | 30.00x | 10.00x | 1000.0 | 1020.0 | +2.0% | 1.47x |",
       "| 16 | 900.0 | 15.0 | 60.00x | 6.67x | 1000.0 | 990.0 | -1.0% | 2.02x |",
       "- **Qwen2.5-7B**: at 8 devices the simulated speedup factors into the NS engine (muon-gather-plain / "
       "muon-gather = 3.00x) times owner execution (muon-gather / dmuon = 10.00x, ideal 8x). End to end over "
       "muon-gather-plain: 1.47x - 2.02x (paper 1.48x - 3.01x); over AdamW: -1.0% to +2.0% (paper +2%).",
       // Benchmarks that did not run, or were cut short.
       "*Not run: " + dir.file("optimizer-np1.json") + " is missing or holds no JSON (a run cut short).*",
       "*Not run: " + dir.file("ablation-np2.json") + " is missing or holds no JSON (a run cut short).*",
       "*Not run: " + dir.file("e2e-demo-np4.json") + " is missing or holds no JSON (a run cut short).*",
       "*Not run: " + dir.file("sim-pi0-a800.json") + " is missing or holds no JSON (a run cut short).*"});
  // Rows in the order adamw, muon-gather-plain, muon-gather, dmuon, whatever the JSON's order.
  const auto row = [&](const std::string& name) { return r.output.find("| " + name + " | "); };
  EXPECT_LT(row("adamw"), row("muon-gather-plain"));
  EXPECT_LT(row("muon-gather-plain"), row("muon-gather"));
  EXPECT_LT(row("muon-gather"), row("dmuon"));
  // The headline comes after the introduction, before section 1.
  EXPECT_LT(r.output.find("Definitions"), r.output.find("## Headline figures"));
  EXPECT_LT(r.output.find("## Headline figures"), r.output.find("## 1. Optimizer step"));
  // Only the simulated 2 devices were measured.
  EXPECT_EQ(r.output.find("| 4 | adamw |"), std::string::npos);
}

// The ablation's summary: DMuon's and muon-gather-plain's medians and the ratio of those two medians (not
// the pairwise slowdown, whose DMuon steps are those of one pair only).
TEST(BenchReport, AblationRatioIsTheRatioOfTheMediansItPrints) {
  test::TempDir dir;
  write_fixture(dir);
  write_file_atomically(dir.file("ablation-np2.json"), R"json({"model": "Test model", "share_definition": "S",
 "dmuon_step_s": 1.5419, "muon_gather_plain_step_s": 6.1088, "muon_gather_plain_slowdown": 4.07,
 "parts": [{"removed": "owners", "variant": "v", "group": "g", "step_s": 3.0, "slowdown": 2.0, "share_pct": 100}],
 "groups": [{"group": "g", "share_pct": 100, "paper_share_pct": 50}]})json");
  const auto r = report("--dir " + dir.path());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // 6108.8 / 1541.9 = 3.96
  EXPECT_NE(r.output.find("DMuon 1541.9 ms (median over the pairs); muon-gather-plain 6108.8 ms (3.96x). "),
            std::string::npos)
      << r.output;
}

TEST(BenchReport, OutWritesTheSameReport) {
  test::TempDir dir;
  write_fixture(dir);
  const auto printed = report("--dir " + dir.path());
  ASSERT_EQ(printed.exit_code, 0) << printed.output;
  const auto written = report("--dir " + dir.path() + " --out " + dir.file("BENCHMARKS.md"));
  ASSERT_EQ(written.exit_code, 0) << written.output;
  EXPECT_EQ(read_file(dir.file("BENCHMARKS.md")), printed.output);
}

TEST(BenchReport, OutKeepsTheSectionsWrittenByHandBelowTheMarker) {
  test::TempDir dir;
  write_fixture(dir);
  const auto printed = report("--dir " + dir.path());
  ASSERT_EQ(printed.exit_code, 0) << printed.output;
  const std::string tail =
      "<!-- Sections below: measured by hand, each with its command; make bench regenerates what is above and keeps "
      "them. -->\n\n## Measured by hand\n\n| a | b |\n|---|---|\n| 1 | 2 |\n";
  write_file_atomically(dir.file("BENCHMARKS.md"), "an older generated report\n\n" + tail);
  const auto written = report("--dir " + dir.path() + " --out " + dir.file("BENCHMARKS.md"));
  ASSERT_EQ(written.exit_code, 0) << written.output;
  EXPECT_EQ(read_file(dir.file("BENCHMARKS.md")), printed.output + "\n" + tail);
  // Without the marker nothing of the old file is kept (OutWritesTheSameReport: a fresh file).
  write_file_atomically(dir.file("BENCHMARKS.md"), "## Measured by hand\n");
  ASSERT_EQ(report("--dir " + dir.path() + " --out " + dir.file("BENCHMARKS.md")).exit_code, 0);
  EXPECT_EQ(read_file(dir.file("BENCHMARKS.md")), printed.output);
}

// Runs the report on the fixture with `name` replaced by `text`; returns what it printed, expecting failure.
std::string failure_with(const std::string& name, const std::string& text) {
  test::TempDir dir;
  write_fixture(dir);
  write_file_atomically(dir.file(name), text);
  const auto r = report("--dir " + dir.path());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(dir.file(name)), std::string::npos) << r.output;
  return r.output;
}

TEST(BenchReport, CorruptJsonNamesTheFile) {
  const auto output = failure_with("e2e-demo-np2.json", R"({"threads_per_rank": 1, "results": [})");
  EXPECT_NE(output.find("e2e-demo-np2.json: not valid JSON"), std::string::npos) << output;
}

TEST(BenchReport, MissingKeyOrWrongTypeNamesTheFileAndKey) {
  std::string json = kFixture.at("sim-qwen7b-a800.json");
  json.replace(json.find("\"step_s\": 1.02"), 8, "\"steps\"");
  auto output = failure_with("sim-qwen7b-a800.json", json);
  EXPECT_NE(output.find("sim-qwen7b-a800.json: missing key 'results[0].dmuon.step_s'"), std::string::npos) << output;

  json = kFixture.at("optimizer-np2.json");
  json.replace(json.find("false"), 5, "\"no\"");
  output = failure_with("optimizer-np2.json", json);
  EXPECT_NE(output.find("optimizer-np2.json: 'oversubscribed' must be true or false, got string"), std::string::npos)
      << output;
}

TEST(BenchReport, MissingFolderIsAnError) {
  test::TempDir dir;
  const auto r = report("--dir " + dir.file("nothing"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("--dir " + dir.file("nothing") + ": no such folder"), std::string::npos) << r.output;
}

// Its help shows each option's default, as every dmuon command's does (cli_messages_test).
TEST(BenchReport, HelpShowsTheDefaults) {
  const auto r = report("--help");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--dir TEXT=docs/bench"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(default: stdout)"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace dmuon
