// The built CLI (path from DMUON_CLI_PATH) run as a user would: `dmuon train --data <bad>` exits
// non-zero with one clear line naming the data source and does not hang (alone and under mpirun,
// also when only one rank fails); a short run writes its metrics; `dmuon compare` tabulates two runs of known
// figures.
#include <gtest/gtest.h>

#include <fstream>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "dmuon/checkpoint.hpp"
#include "dmuon/checkpoint_rotation.hpp"
#include "dmuon/metrics_csv.hpp"
#include "test_data.hpp"

namespace dmuon {
namespace {

// The CLI under `timeout`: a hang becomes exit code 124 instead of a stuck test.
test::CommandResult run(const std::string& args, int ranks = 0) {
  std::string command = std::string(DMUON_CLI_PATH) + " " + args;
  if (ranks > 0) command = std::string(DMUON_MPIRUN) + " -np " + std::to_string(ranks) + " " + command;
  return test::run_command("timeout 120 " + command);
}

// --no-tune: these runs stay away from the user's tuning cache (TunedRun... uses its own).
const std::string kSmallRun =
    "train --steps 2 --layers 1 --width 32 --heads 2 --context 16 --batch 4 --no-tune --csv /dev/null";

std::string train_args(const std::string& data) { return kSmallRun + " --data '" + data + "'"; }

void expect_one_clear_line(const test::CommandResult& r, const std::string& path, const std::string& what) {
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "timed out: " << r.output;  // timeout's code: the run hung
  EXPECT_EQ(r.output.rfind("dmuon: error: ", 0), 0u) << r.output;
  EXPECT_NE(r.output.find(path), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(what), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << "more than one line: " << r.output;
}

TEST(TrainCli, MissingEmptyAndBinaryDataAreOneLineErrors) {
  test::TempDir dir;
  const std::string missing = dir.file("no-such-corpus");
  expect_one_clear_line(run(train_args(missing)), missing, "does not exist");

  const std::string empty = dir.file("empty.txt");
  std::ofstream(empty).close();
  expect_one_clear_line(run(train_args(empty)), empty, "empty");

  const std::string binary = dir.file("binary.bin");
  {
    std::ofstream f(binary, std::ios::binary);
    for (int i = 0; i < 4096; ++i) f.put(static_cast<char>(i % 7 == 0 ? 0 : i % 256));
  }
  expect_one_clear_line(run(train_args(binary)), binary, "binary");
}

// --context 16 needs 17 bytes in each split; this file's training part is "a\n" (the split falls at the
// last newline before 90%): an error before the first step.
TEST(TrainCli, DataTooShortForOneSequenceIsAOneLineError) {
  test::TempDir dir;
  const std::string short_train = dir.file("short.txt");
  std::ofstream(short_train) << "a\n" << std::string(100, 'x');
  expect_one_clear_line(run(train_args(short_train)), short_train, "training part");
}

TEST(TrainCli, BadDataOrMetricsPathUnderMpirunStopsEveryRank) {
  test::TempDir dir;
  const std::string missing = dir.file("no-such-corpus");
  const test::CommandResult r = run(train_args(missing), 2);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "timed out: " << r.output;
  EXPECT_NE(r.output.find("dmuon: error: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(missing), std::string::npos) << r.output;

  // Rank 0 cannot create the metrics file: every rank stops at once instead of waiting for it.
  const std::string bad_csv = "/proc/no-such-folder/run.csv";
  const test::CommandResult c =
      run("train --steps 2 --layers 1 --width 32 --heads 2 --context 16 --batch 4 --no-tune --csv " + bad_csv, 2);
  EXPECT_NE(c.exit_code, 0) << c.output;
  EXPECT_NE(c.exit_code, 124) << "timed out: " << c.output;
  EXPECT_NE(c.output.find(bad_csv), std::string::npos) << c.output;
}

// Only rank 1 gets a missing corpus (mpirun's MPMD form: one program per rank, each with its own
// arguments), so rank 0 waits for it in a collective. Rank 1 must end the whole job at once rather
// than return from main and leave rank 0 waiting: the comm timeout here lies far beyond the 120 s
// guard, so a job that waits for it ends with timeout's exit code 124.
TEST(TrainCli, OneRankFailingAloneEndsTheWholeJob) {
  test::TempDir dir;
  const std::string missing = dir.file("no-such-corpus");
  const std::string cli = DMUON_CLI_PATH;
  const test::CommandResult r =
      test::run_command("DMUON_COMM_TIMEOUT_S=600 timeout 120 " + std::string(DMUON_MPIRUN) + " -np 1 " + cli + " " +
                        kSmallRun + " : -np 1 " + cli + " " + train_args(missing));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "rank 0 waited for the comm timeout: " << r.output;
  EXPECT_NE(r.output.find("dmuon: error: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(missing), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("timed out"), std::string::npos) << "rank 0 reported a misleading timeout: " << r.output;
}

// The words of the first output line that starts with `label` and a space (empty if none).
std::vector<std::string> row_of(const std::string& output, const std::string& label) {
  std::istringstream lines(output);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind(label + " ", 0) != 0) continue;
    std::istringstream words(line);
    std::vector<std::string> out;
    for (std::string w; words >> w;) out.push_back(w);
    return out;
  }
  return {};
}

// A short run end to end: `dmuon train` writes one CSV row per step (validation on the last).
TEST(TrainCli, TrainWritesOneMetricsRowPerStep) {
  test::TempDir dir;
  const std::string csv = dir.file("run.csv");
  const std::string args = "train --optim adamw --steps 3 --layers 1 --width 32 --heads 2 --context 16 --batch 4 ";
  const test::CommandResult train = run(args + "--progress plain --csv " + csv);
  ASSERT_EQ(train.exit_code, 0) << train.output;
  EXPECT_NE(train.output.find("done: 3 steps"), std::string::npos) << train.output;
  const std::vector<StepMetrics> rows = read_metrics_csv(csv);
  ASSERT_EQ(rows.size(), 3u);
  for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(rows[i].step, i + 1);
  EXPECT_FALSE(rows[1].val_loss.has_value());
  EXPECT_TRUE(rows[2].val_loss.has_value());
}

// `dmuon compare` on two runs whose figures are known: per run the last validation loss and the medians
// of each time (an odd count: the middle value; an even one: the mean of the two middle values), and
// the second run's step time against the first's; it draws both plots.
TEST(TrainCli, CompareTabulatesKnownMediansAndPlots) {
  test::TempDir dir;
  {
    MetricsCsvWriter a(dir.file("a.csv"));
    a.write({1, 3.0, std::nullopt, 0.010, 0.006, 0.002, 0.001});
    a.write({2, 2.8, 2.9, 0.030, 0.020, 0.004, 0.003});
    a.write({3, 2.6, std::nullopt, 0.020, 0.010, 0.003, 0.002});
    MetricsCsvWriter b(dir.file("b.csv"));
    b.write({1, 3.1, std::nullopt, 0.025, 0.010, 0.004, 0.000});
    b.write({2, 2.7, 2.5, 0.100, 0.050, 0.004, 0.010});
    b.write({3, 2.4, std::nullopt, 0.026, 0.012, 0.004, 0.001});
    b.write({4, 2.2, 2.25, 0.020, 0.014, 0.004, 0.003});
  }
  const test::CommandResult cmp =
      run("compare --run A=" + dir.file("a.csv") + " --run B=" + dir.file("b.csv") + " --out " + dir.path());
  ASSERT_EQ(cmp.exit_code, 0) << cmp.output;
  // run, steps, val loss, step ms, fwd+bwd ms, optim ms, comm wait ms, step vs first. B's step median is
  // (25 + 26)/2 = 25.5 ms, 27.5% above A's 20 ms.
  EXPECT_EQ(row_of(cmp.output, "A"),
            (std::vector<std::string>{"A", "3", "2.9000", "20.0", "10.0", "3.0", "2.0", "baseline"}))
      << cmp.output;
  EXPECT_EQ(row_of(cmp.output, "B"),
            (std::vector<std::string>{"B", "4", "2.2500", "25.5", "13.0", "4.0", "2.0", "+27.5%"}))
      << cmp.output;
  EXPECT_TRUE(std::ifstream(dir.file("loss.png")).good());
  EXPECT_TRUE(std::ifstream(dir.file("step_time.png")).good());
}

// Tuning is on by default: rank 0 tunes the model's shapes into --tune-cache with progress on stderr,
// and a second run finds every shape in the cache.
TEST(TrainCli, TunedRunWritesTheCacheAndReusesIt) {
  test::TempDir dir;
  const std::string cache = dir.file("cache/tune.json");
  const std::string args = "train --steps 1 --layers 1 --width 32 --heads 2 --context 16 --batch 4 --progress plain "
                           "--csv /dev/null --tune-cache " + cache;
  const test::CommandResult first = run(args, 2);
  ASSERT_EQ(first.exit_code, 0) << first.output;
  EXPECT_NE(first.output.find("tuning Newton-Schulz for the model's shapes (cache " + cache + ")"), std::string::npos)
      << first.output;
  EXPECT_NE(first.output.find("tuned Newton-Schulz: 4 shape(s) ready in"), std::string::npos) << first.output;
  EXPECT_TRUE(std::ifstream(cache).good());
  const test::CommandResult second = run(args, 2);
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("(cached)"), std::string::npos) << second.output;
}

// --muon-group: per-matrix Muon options by name, on 2 ranks. The attention matrices run NorMuon with 6 Newton-Schulz
// steps, the MLP's output projection (32x128) split Newton-Schulz by 4 heads of columns: the checkpoint holds their
// normuon.v and none for the MLP's, and records both rules; a resume that changes the rules says so; and the bad
// rules are one-line errors naming the rule and what is wrong with it, a split that does not fit naming the matrix.
TEST(TrainCli, MuonGroupSetsOptionsPerMatrixByName) {
  test::TempDir dir;
  const std::string save = dir.file("ckpt");
  const std::string rule =
      " --muon-group 'blocks.*.attn.*:ns-steps=6,variant=normuon' --muon-group 'blocks.*.mlp.proj.*:split-heads=4,split-dim=1'";
  const test::CommandResult r = run(kSmallRun + rule + " --progress plain --save " + save, 2);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const CheckpointContents saved = read_checkpoint_contents(newest_checkpoint(save));
  EXPECT_TRUE(saved.params.at("blocks.0.attn.qkv.weight").kinds.count("normuon.v"));
  EXPECT_TRUE(saved.params.at("blocks.0.attn.proj.weight").kinds.count("normuon.v"));
  EXPECT_FALSE(saved.params.at("blocks.0.mlp.fc.weight").kinds.count("normuon.v"));
  const std::string saved_rules = "blocks.*.attn.*:ns-steps=6,variant=normuon blocks.*.mlp.proj.*:split-heads=4,split-dim=1";
  EXPECT_EQ(saved.run.at("muon_group"), saved_rules);
  const test::CommandResult resumed =
      run(std::regex_replace(kSmallRun, std::regex("--steps 2"), "--steps 3") +
              " --muon-group 'blocks.*.attn.*:variant=normuon' --progress plain --resume " + save,
          2);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("--muon-group blocks.*.attn.*:variant=normuon (saved: " + saved_rules + ")"),
            std::string::npos)
      << resumed.output;

  const auto refused = [](const std::string& args, const std::string& want) {
    const test::CommandResult bad = run(kSmallRun + args);
    expect_one_clear_line(bad, want, "");
  };
  refused(" --muon-group 'blocks.*.attn.*:ns-stepz=6'",
          "--muon-group: Muon rule 'blocks.*.attn.*:ns-stepz=6' (pattern 'blocks.*.attn.*'): unknown option 'ns-stepz'");
  refused(" --muon-group 'attn.*:variant=normuon'", "Muon rule 'attn.*' matches no Muon matrix");
  refused(" --optim adamw --muon-group '*:variant=normuon'", "--muon-group sets options of Muon matrices");
  refused(" --muon-group 'blocks.*.attn.qkv.*:split-heads=5'",
          "Muon matrix 'blocks.0.attn.qkv.weight' (96x32) has 96 rows, not a multiple of split-heads=5");
  refused(" --muon-group 'blocks.*.attn.qkv.*:split-sizes=32+32'",
          "Muon matrix 'blocks.0.attn.qkv.weight' (96x32) has 96 rows, but split-sizes 32+32 sum to 64");
}

}  // namespace
}  // namespace dmuon
