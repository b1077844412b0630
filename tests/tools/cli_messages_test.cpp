// What the dmuon CLI tells its user: every --help shows every option's default; a flag that does not
// apply is a warning or an error; a user's error is one line without the library's source locations
// (DMUON_DEBUG=1 shows them); a file that is not a tuning cache is never replaced; one name for the
// tuning cache flag everywhere; small models' parameter counts read as numbers.
#include <gtest/gtest.h>

#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dmuon/atomic_file.hpp"
#include "dmuon/metrics_csv.hpp"
#include "test_data.hpp"

namespace dmuon {
namespace {

test::CommandResult run(const std::string& args, const std::string& env = "") {
  return test::run_command(env + " timeout 120 " + std::string(DMUON_CLI_PATH) + " " + args);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The subcommands a help text lists under "Subcommands:".
std::vector<std::string> subcommands(const std::string& help) {
  std::vector<std::string> out;
  bool in_list = false;
  for (const std::string& line : lines_of(help)) {
    if (line.rfind("Subcommands:", 0) == 0) {
      in_list = true;
      continue;
    }
    std::smatch m;
    if (in_list && std::regex_match(line, m, std::regex(R"(  ([a-z0-9-]+)\s.*)"))) out.push_back(m[1]);
  }
  return out;
}

// Every option that takes a value shows its default ("=300"), or its description says what happens
// without it ("default", "none") or that it is required; no flag reads "{false}"/"{true}" (CLI11's
// rendering of "--x,!--no-x", which reads as "off by default").
TEST(CliMessages, EveryHelpShowsEveryDefault) {
  std::vector<std::string> paths;
  for (const std::string& top : subcommands(run("--help").output)) {
    const std::vector<std::string> nested = subcommands(run(top + " --help").output);
    if (nested.empty()) paths.push_back(top);
    for (const std::string& sub : nested) paths.push_back(top + " " + sub);
  }
  // 14: `bench report` is the developer tool dmuon-bench-report now (its help: bench_report_test).
  ASSERT_GE(paths.size(), 14u);
  // "  --steps INT:in [1, inf)=300   optimizer steps": names, one space, then a type word in capitals.
  const std::regex takes_value(R"(^\s+(-\w,)?--[\w-]+(,--[\w-]+)* [A-Z]+.*)");
  for (const std::string& path : paths) {
    SCOPED_TRACE("dmuon " + path + " --help");
    const auto help = run(path + " --help");
    ASSERT_EQ(help.exit_code, 0) << help.output;
    // One entry per option: CLI11 continues a long one on indented lines.
    std::vector<std::string> entries;
    for (const std::string& line : lines_of(help.output)) {
      if (line.rfind("  -", 0) == 0) entries.push_back(line);
      else if (line.rfind("      ", 0) == 0 && !entries.empty()) entries.back() += " " + line;
    }
    for (const std::string& line : entries) {
      EXPECT_EQ(line.find("{false}"), std::string::npos) << line;
      EXPECT_EQ(line.find("{true}"), std::string::npos) << line;
      if (!std::regex_match(line, takes_value) || line.find("--help") != std::string::npos) continue;
      const bool shown = line.find('=') != std::string::npos || line.find("default") != std::string::npos ||
                         line.find("(none") != std::string::npos || line.find("REQUIRED") != std::string::npos ||
                         line.find("required") != std::string::npos;
      EXPECT_TRUE(shown) << "no default shown: " << line;
    }
  }
}

TEST(CliMessages, TrainHelpSaysTuningIsOnAndTheBatchIsTheDemos) {
  const auto help = run("train --help").output;
  EXPECT_NE(help.find("--batch INT:in [1, inf)=64"), std::string::npos) << help;
  EXPECT_TRUE(std::regex_search(help, std::regex(R"(\n\s+--tune\s+.*; the default\n)"))) << help;
  EXPECT_TRUE(std::regex_search(help, std::regex(R"(\n\s+--no-tune\s+turn --tune off)"))) << help;
}

TEST(CliMessages, FlagsThatDoNotApplyAreSaid) {
  test::TempDir dir;
  const std::string tiny = "train --optim adamw --steps 1 --layers 1 --width 32 --heads 2 --context 16 --batch 4 "
                           "--progress plain --csv /dev/null";
  const auto warned = run(tiny + " --adamw-lr 0.01");
  ASSERT_EQ(warned.exit_code, 0) << warned.output;
  EXPECT_NE(warned.output.find("dmuon: warning: --adamw-lr sets the AdamW group of Muon runs; with --optim adamw "
                               "every parameter follows --lr, and --adamw-lr is ignored\n"),
            std::string::npos)
      << warned.output;
  const auto quiet = run(tiny);
  ASSERT_EQ(quiet.exit_code, 0) << quiet.output;
  EXPECT_EQ(quiet.output.find("warning"), std::string::npos) << quiet.output;

  const auto sim = run("simulate --model gpt2 --layers 1 --devices 8 --batch 16");
  EXPECT_NE(sim.exit_code, 0) << sim.output;
  EXPECT_NE(sim.output.find("--batch requires --gpt"), std::string::npos) << sim.output;
}

// dmuon::Error carries "[src/...cpp:N]"; the user sees the message alone unless DMUON_DEBUG=1.
TEST(CliMessages, UserErrorsAreOneLineWithoutSourceLocations) {
  test::TempDir dir;
  const std::string missing = dir.file("missing.npy");
  const auto plain = run("ns --in " + missing + " --out " + dir.file("o.npy"));
  EXPECT_EQ(plain.exit_code, 1) << plain.output;
  EXPECT_EQ(plain.output.rfind("dmuon: error: ", 0), 0u) << plain.output;
  EXPECT_NE(plain.output.find(missing), std::string::npos) << plain.output;
  EXPECT_EQ(lines_of(plain.output).size(), 1u) << plain.output;
  EXPECT_FALSE(std::regex_search(plain.output, std::regex(R"(\.(cpp|hpp):[0-9]+)"))) << plain.output;
  const auto debug = run("ns --in " + missing + " --out " + dir.file("o.npy"), "DMUON_DEBUG=1");
  EXPECT_EQ(debug.exit_code, 1) << debug.output;
  EXPECT_TRUE(std::regex_search(debug.output, std::regex(R"( \[[^\]\s]*src/[a-z_/]+\.cpp:[0-9]+\])"))) << debug.output;
  // An error raised in CUDA code (.cu; or, in a build without CUDA, in the backend's .cpp): no GPU visible.
  const auto gpu = run("bench ns --device cuda --shapes 64x128 --repeats 1", "CUDA_VISIBLE_DEVICES=");
  EXPECT_EQ(gpu.exit_code, 1) << gpu.output;
  EXPECT_EQ(gpu.output.rfind("dmuon: error: ", 0), 0u) << gpu.output;
  EXPECT_EQ(lines_of(gpu.output).size(), 1u) << gpu.output;
  EXPECT_FALSE(std::regex_search(gpu.output, std::regex(R"(\.(cpp|hpp|cu|cuh):[0-9]+)"))) << gpu.output;
}

// Plots into a folder that cannot exist (under a file) is the user's error, exit 1, before any work.
TEST(CliMessages, CompareOutThatCannotBeWrittenIsAUserError) {
  test::TempDir dir;
  const std::string csv = dir.file("run.csv");
  {
    MetricsCsvWriter w(csv);
    w.write({1, 2.0, 1.5, 0.1, 0.05, 0.03, 0.01});
  }
  const auto r = run("compare --run A=" + csv + " --out " + csv + "/plots");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(r.output, "dmuon: error: --out " + csv + "/plots: cannot write the plots there: " + csv +
                          " is not a folder\n");
}

// `dmuon tune --tune-cache notes.txt` refuses before tuning and leaves the file; the old flag name is gone.
TEST(CliMessages, TuneRefusesAFileThatIsNotATuningCache) {
  test::TempDir dir;
  const std::string notes = dir.file("notes.txt");
  write_file_atomically(notes, "my notes\n");
  const auto r = run("tune --model gpt2 --layers 1 --rounds 1 --tune-cache " + notes);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(r.output, "dmuon: error: " + notes +
                          " is not a dmuon tuning cache; refusing to replace it (name another file with --tune-cache)\n");
  EXPECT_EQ(read_file(notes), "my notes\n");
  const auto old_name = run("tune --model gpt2 --layers 1 --cache " + dir.file("c.json"));
  EXPECT_NE(old_name.exit_code, 0);
  EXPECT_NE(old_name.output.find("--cache"), std::string::npos) << old_name.output;
}

TEST(CliMessages, PlanCountsSmallModelsInReadableUnits) {
  test::TempDir dir;
  const std::string config = dir.file("tiny.json");
  write_file_atomically(config, R"({"model_type": "params", "params": [
    {"name": "a", "shape": [64, 128], "role": "matrix"}, {"name": "b", "shape": [64, 64], "role": "matrix"},
    {"name": "n", "shape": [64], "role": "elementwise"}]})");
  const auto r = run("plan --hf-config " + config + " --ranks 2 --balancer lpt");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(": 12.4k parameters, 2 Muon matrices"), std::string::npos) << r.output;
  const auto big = run("plan --model qwen2.5-0.5b --ranks 2 --balancer lpt");
  ASSERT_EQ(big.exit_code, 0) << big.output;
  EXPECT_NE(big.output.find(": 494.03M parameters"), std::string::npos) << big.output;
}

// A dense matrix and 4 experts on an EP x EFSDP mesh (1x2x1x2, rank = 2·shard + expert): plan's table has a row
// per rank with its coordinate; its JSON keeps each expert among its holders (experts 0, 1 on ranks 0, 2; 2, 3 on
// 1, 3) and counts what step() moves: the 64x64 matrix, 16 rows a rank, sends 3·4 KiB of U to its owner and gets
// 3·4 KiB of O back; each 32x64 expert, 16 rows on each of 2 ranks, 4 KiB each way: 57344 bytes sent in all, and
// received. simulate shows the same plan's ranks.
TEST(CliMessages, PlanAndSimulateShowEachRanksBytesOnAMesh) {
  test::TempDir dir;
  const std::string config = dir.file("moe.json");
  std::string params = R"({"name": "l.attn.w", "shape": [64, 64], "role": "matrix"})";
  for (int e = 0; e < 4; ++e)
    params += R"(, {"name": "l.experts.)" + std::to_string(e) + R"(.w", "shape": [32, 64], "role": "matrix"})";
  write_file_atomically(config, R"({"model_type": "params", "params": [)" + params + "]}");
  const auto table = run("plan --hf-config " + config + " --mesh 1x2x1x2 --balancer lpt");
  ASSERT_EQ(table.exit_code, 0) << table.output;
  EXPECT_NE(table.output.find("per rank on mesh 1x2x1x2 (dp_replicate x dp_shard x tp x ep)"), std::string::npos)
      << table.output;
  EXPECT_TRUE(std::regex_search(table.output, std::regex(R"(\n +3 +0,1,1,0 \| +[0-9.]+ +[0-9.]+ +[0-9.]+\n)")))
      << table.output;

  const auto json = run("plan --hf-config " + config + " --mesh 1x2x1x2 --balancer all --time-limit 1 --json");
  ASSERT_EQ(json.exit_code, 0) << json.output;
  const auto out = nlohmann::json::parse(json.output);
  EXPECT_EQ(out.at("ranks"), 4);
  EXPECT_EQ(out.at("mesh").at("ep"), 2);
  for (const auto& plan : out.at("plans")) {
    SCOPED_TRACE(plan.at("balancer").get<std::string>());
    const auto owner = plan.at("owner").get<std::vector<int>>();
    ASSERT_EQ(owner.size(), 5u);
    for (int e = 0; e < 4; ++e) EXPECT_EQ(owner[1 + e] % 2, e / 2) << "expert " << e << " on rank " << owner[1 + e];
    int64_t sent = 0, received = 0;
    for (const auto& r : plan.at("per_rank")) {
      sent += r.at("step_sent_bytes").get<int64_t>();
      received += r.at("step_received_bytes").get<int64_t>();
    }
    EXPECT_EQ(sent, 57344);
    EXPECT_EQ(received, 57344);
  }

  const auto sim = run("simulate --hf-config " + config + " --mesh 1x2x1x2 --balancer lpt --json");
  ASSERT_EQ(sim.exit_code, 0) << sim.output;
  const auto result = nlohmann::json::parse(sim.output).at("results").at(0);
  EXPECT_EQ(result.at("devices"), 4);
  ASSERT_EQ(result.at("plan_per_rank").size(), 4u);
  int64_t sim_sent = 0;
  for (const auto& r : result.at("plan_per_rank")) sim_sent += r.at("step_sent_bytes").get<int64_t>();
  EXPECT_EQ(sim_sent, 57344);
}

}  // namespace
}  // namespace dmuon
