// The built CLI (path from DMUON_CLI_PATH) run as a user would: `dmuon train --data <bad>` exits
// non-zero with one clear line naming the data source and does not hang (alone and under mpirun);
// a short run's metrics go through `dmuon compare`.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "dmuon/metrics_csv.hpp"
#include "test_data.hpp"

namespace dmuon {
namespace {

struct Result {
  int status = -1;  // exit code, or -1 when killed
  std::string output;
};

// Runs `command` through the shell with stderr merged into stdout, killed after 120 s.
Result run(const std::string& command) {
  const std::string full = "timeout 120 " + command + " 2>&1";
  Result r;
  FILE* p = popen(full.c_str(), "r");
  EXPECT_NE(p, nullptr);
  std::array<char, 4096> buf;
  for (size_t n; (n = fread(buf.data(), 1, buf.size(), p)) > 0;) r.output.append(buf.data(), n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

std::string train_cmd(const std::string& data) {
  return std::string(DMUON_CLI_PATH) + " train --steps 2 --layers 1 --width 32 --heads 2 --context 16 --batch 4 " +
         "--csv /dev/null --data '" + data + "'";
}

void expect_one_clear_line(const Result& r, const std::string& path, const std::string& what) {
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.status, 124) << "timed out: " << r.output;  // timeout's code: the run hung
  EXPECT_EQ(r.output.rfind("dmuon: error: ", 0), 0u) << r.output;
  EXPECT_NE(r.output.find(path), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(what), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << "more than one line: " << r.output;
}

TEST(TrainCli, MissingEmptyAndBinaryDataAreOneLineErrors) {
  test::TempDir dir;
  const std::string missing = dir.file("no-such-corpus");
  expect_one_clear_line(run(train_cmd(missing)), missing, "does not exist");

  const std::string empty = dir.file("empty.txt");
  std::ofstream(empty).close();
  expect_one_clear_line(run(train_cmd(empty)), empty, "empty");

  const std::string binary = dir.file("binary.bin");
  {
    std::ofstream f(binary, std::ios::binary);
    for (int i = 0; i < 4096; ++i) f.put(static_cast<char>(i % 7 == 0 ? 0 : i % 256));
  }
  expect_one_clear_line(run(train_cmd(binary)), binary, "binary");
}

TEST(TrainCli, BadDataUnderMpirunStopsEveryRank) {
  test::TempDir dir;
  const std::string missing = dir.file("no-such-corpus");
  const Result r = run("mpirun --allow-run-as-root --oversubscribe -np 2 " + train_cmd(missing));
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.status, 124) << "timed out: " << r.output;
  EXPECT_NE(r.output.find("dmuon: error: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(missing), std::string::npos) << r.output;
}

// A short run end to end: `dmuon train` writes one CSV row per step (validation on the last), and
// `dmuon compare` reads it back, prints the table and draws both plots.
TEST(TrainCli, TrainWritesTheMetricsThatCompareTabulatesAndPlots) {
  test::TempDir dir;
  const std::string csv = dir.file("run.csv");
  const Result train = run(std::string(DMUON_CLI_PATH) +
                           " train --optim adamw --steps 3 --layers 1 --width 32 --heads 2 --context 16 --batch 4 "
                           "--progress plain --csv " +
                           csv);
  ASSERT_EQ(train.status, 0) << train.output;
  EXPECT_NE(train.output.find("done: 3 steps"), std::string::npos) << train.output;
  const std::vector<StepMetrics> rows = read_metrics_csv(csv);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_FALSE(rows[1].val_loss.has_value());
  EXPECT_TRUE(rows[2].val_loss.has_value());

  const Result cmp =
      run(std::string(DMUON_CLI_PATH) + " compare --run A=" + csv + " --run B=" + csv + " --out " + dir.path());
  ASSERT_EQ(cmp.status, 0) << cmp.output;
  EXPECT_NE(cmp.output.find("baseline"), std::string::npos) << cmp.output;
  EXPECT_NE(cmp.output.find("+0.0%"), std::string::npos) << cmp.output;  // a run against itself
  EXPECT_TRUE(std::ifstream(dir.file("loss.png")).good());
  EXPECT_TRUE(std::ifstream(dir.file("step_time.png")).good());
}

}  // namespace
}  // namespace dmuon
