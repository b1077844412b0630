// `dmuon train` never loses work to an output it cannot write: the --save folder (of step-N
// checkpoints), the --csv file and the --resume checkpoint are checked before tuning and step 1 (a
// refused run leaves no tuning cache, no metrics and no step behind it); a resumed run appends to its
// metrics; a checkpoint already at --steps is one line that touches no file; an unusable tuning cache
// is a warning, not the end.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "dmuon/atomic_file.hpp"
#include "dmuon/metrics_csv.hpp"
#include "test_data.hpp"

namespace dmuon {
namespace {

// The CLI (under mpirun with ranks > 0) under `timeout`: a hang fails as exit code 124.
test::CommandResult run(const std::string& args, int ranks = 0) {
  const std::string mpirun = ranks > 0 ? std::string(DMUON_MPIRUN) + " -np " + std::to_string(ranks) + " " : "";
  return test::run_command("timeout 120 " + mpirun + DMUON_CLI_PATH + " " + args);
}

const std::string kTiny = "train --layers 1 --width 32 --heads 2 --context 16 --batch 4 --progress plain ";

bool exists(const std::string& path) { return std::filesystem::exists(path); }

void expect_one_error_line(const test::CommandResult& r, const std::string& what) {
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(r.output.rfind("dmuon: error: ", 0), 0u) << r.output;
  EXPECT_NE(r.output.find(what), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find('\n'), r.output.size() - 1) << "more than one line: " << r.output;
  EXPECT_EQ(r.output.find("step 1"), std::string::npos) << "trained before failing: " << r.output;
}

// --save names a folder with someone's files: refused before tuning (no cache written) and before
// step 1 (no metrics written), at one and two ranks; so is a step-N folder holding someone's files
// (rotation removes step-N folders whole).
TEST(TrainOutputs, SaveFolderHoldingOtherFilesIsRefusedBeforeWork) {
  for (int ranks : {0, 2}) {
    test::TempDir dir;
    std::filesystem::create_directories(dir.file("mine"));
    std::ofstream(dir.file("mine/notes.txt")) << "keep me\n";
    const auto r = run(kTiny + "--steps 2 --csv " + dir.file("m.csv") + " --tune-cache " + dir.file("tune.json") +
                           " --save " + dir.file("mine"),
                       ranks);
    const std::string what = "holds 'notes.txt', which is not a step-N checkpoint";
    if (ranks == 0) {
      expect_one_error_line(r, what);
    } else {  // every rank stops; rank 0 names the problem
      EXPECT_NE(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find("dmuon: error: " + dir.file("mine") + ": " + what), std::string::npos) << r.output;
      EXPECT_EQ(r.output.find("step 1"), std::string::npos) << r.output;
    }
    EXPECT_FALSE(exists(dir.file("tune.json"))) << "tuned before refusing";
    EXPECT_FALSE(exists(dir.file("m.csv")));
    EXPECT_EQ(read_file(dir.file("mine/notes.txt")), "keep me\n");
  }
  test::TempDir dir;
  std::filesystem::create_directories(dir.file("ck/step-00000001"));
  std::ofstream(dir.file("ck/step-00000001/notes.txt")) << "keep me\n";
  expect_one_error_line(run(kTiny + "--steps 2 --csv " + dir.file("m.csv") + " --tune-cache " + dir.file("tune.json") +
                            " --save " + dir.file("ck")),
                        dir.file("ck/step-00000001") + ": holds 'notes.txt', which is not part of a checkpoint");
  EXPECT_FALSE(exists(dir.file("tune.json")));
  EXPECT_EQ(read_file(dir.file("ck/step-00000001/notes.txt")), "keep me\n");
}

// --csv under a file (no folder can be made there), and --csv naming a file that is not a metrics file.
TEST(TrainOutputs, MetricsPathIsCheckedBeforeTuningAndNeverReplacesOtherFiles) {
  test::TempDir dir;
  const std::string notes = dir.file("notes.txt");
  std::ofstream(notes) << "keep me\n";
  auto r = run(kTiny + "--steps 2 --tune-cache " + dir.file("tune.json") + " --csv " + notes + "/run.csv");
  expect_one_error_line(r, "cannot write metrics file " + notes + "/run.csv: " + notes + " is not a folder");
  EXPECT_FALSE(exists(dir.file("tune.json")));
  r = run(kTiny + "--steps 2 --tune-cache " + dir.file("tune.json") + " --csv " + notes, 2);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(notes + " exists and is not a metrics file"), std::string::npos) << r.output;
  EXPECT_FALSE(exists(dir.file("tune.json")));
  EXPECT_EQ(read_file(notes), "keep me\n");
}

// 2 steps, then resumed to 4 from the --save folder: the metrics file holds steps 1-4. Resumed again at
// --steps 4 (or fewer): one line naming the newest checkpoint, exit 0, and neither the metrics nor the
// checkpoints change.
TEST(TrainOutputs, ResumeAppendsAndNothingToDoTouchesNoFile) {
  test::TempDir dir;
  const std::string csv = dir.file("m.csv"), ck = dir.file("ck");
  const std::string common = kTiny + "--optim adamw --val-every 0 --csv " + csv + " --save " + ck + " ";
  ASSERT_EQ(run(common + "--steps 2", 2).exit_code, 0);
  ASSERT_EQ(read_metrics_csv(csv).size(), 2u);
  const auto resumed = run(common + "--steps 4 --resume " + ck, 2);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto rows = read_metrics_csv(csv);
  ASSERT_EQ(rows.size(), 4u) << read_file(csv);
  for (int64_t i = 0; i < 4; i++) EXPECT_EQ(rows[i].step, i + 1);

  const std::string newest = ck + "/step-00000004", index = newest + "/index.json";
  const std::string csv_before = read_file(csv), index_before = read_file(index);
  const auto mtime = std::filesystem::last_write_time(index);
  for (int steps : {4, 3}) {
    const auto nothing = run(common + "--steps " + std::to_string(steps) + " --resume " + ck, 2);
    EXPECT_EQ(nothing.exit_code, 0) << nothing.output;
    EXPECT_EQ(nothing.output, "dmuon train: nothing to do: checkpoint " + newest + " is at step 4, --steps " +
                                  std::to_string(steps) + "\n");
  }
  EXPECT_EQ(read_file(csv), csv_before);
  EXPECT_EQ(read_file(index), index_before);
  EXPECT_EQ(std::filesystem::last_write_time(index), mtime);
  EXPECT_TRUE(exists(ck + "/step-00000002")) << "a run with nothing to do removed a checkpoint";
}

// A checkpoint of another model or optimizer is refused before tuning (the cache stays unwritten).
TEST(TrainOutputs, ResumeCheckpointIsCheckedAgainstModelAndOptimizerBeforeTuning) {
  test::TempDir dir;
  const std::string ck = dir.file("ck"), cache = dir.file("tune.json");
  ASSERT_EQ(run(kTiny + "--optim adamw --steps 1 --csv /dev/null --save " + ck).exit_code, 0);
  const std::string resume = " --steps 3 --csv /dev/null --tune-cache " + cache + " --resume " + ck;
  expect_one_error_line(run(kTiny + "--optim dmuon" + resume),
                        "has no muon.momentum for parameter 'blocks.0.attn.qkv.weight'");
  EXPECT_FALSE(exists(cache));
  expect_one_error_line(
      run("train --layers 1 --width 64 --heads 2 --context 16 --batch 4 --progress plain --optim dmuon" + resume),
      "holds parameter 'wte' with shape");
  EXPECT_FALSE(exists(cache));
  expect_one_error_line(
      run("train --layers 2 --width 32 --heads 2 --context 16 --batch 4 --progress plain --optim adamw" + resume),
      "lacks parameter 'blocks.1.");
}

// A cache location that cannot be written: one warning line, then the run trains with the tuned
// entries in memory.
TEST(TrainOutputs, UnwritableTuningCacheWarnsAndTrains) {
  const auto r = run(kTiny + "--steps 1 --csv /dev/null --tune-cache /dev/null/dmuon/tune.json", 2);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("dmuon: warning: tuning cache /dev/null/dmuon/tune.json cannot be written (/dev/null is "
                          "not a folder); the entries tuned now serve this run only\n"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("done: 1 steps"), std::string::npos) << r.output;
  // Tuning progress in a log: whole lines, never a redrawn bar.
  EXPECT_EQ(r.output.find('\r'), std::string::npos) << r.output;
}

}  // namespace
}  // namespace dmuon
