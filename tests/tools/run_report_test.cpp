// Run reporting: the progress line, the metrics CSV, and gnuplot PNGs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <optional>
#include <fstream>
#include <string>

#include "dmuon/atomic_file.hpp"
#include "dmuon/error.hpp"
#include "dmuon/metrics_csv.hpp"
#include "console/plot.hpp"
#include "console/progress.hpp"
#include "test_data.hpp"

namespace dmuon {
namespace {

TEST(Progress, FormatsStepLossRateAndEta) {
  // 120 of 500 steps in 60 s at 1024 tokens per step: 2048 tok/s, 380 steps left at 0.5 s each.
  EXPECT_EQ(format_progress(120, 500, 2.34567, 60.0, 1024, true),
            "step 120/500 [####................] loss 2.3457 | 2.0k tok/s | ETA 3m10s");
  EXPECT_EQ(format_progress(7, 500, 5.5, 1.0, 10, false), "step   7/500 loss 5.5000 | 70 tok/s | ETA 1m10s");
  EXPECT_EQ(format_progress(500, 500, 1.0, 7300.0, 4'000'000, true),
            "step 500/500 [####################] loss 1.0000 | 274.0k tok/s | ETA 0s");
  EXPECT_EQ(format_progress(0, 10, 0.0, 0.0, 1, false), "step  0/10 loss 0.0000 | ? tok/s | ETA ?");
}

std::string captured(std::FILE* f) {
  std::rewind(f);
  std::string s;
  for (int c; (c = std::fgetc(f)) != EOF;) s += static_cast<char>(c);
  return s;
}

TEST(Progress, PlainModePrintsEveryFewStepsAndTheLast) {
  std::FILE* f = std::tmpfile();
  {
    ProgressDisplay p(10, 100, f, ProgressDisplay::Mode::automatic, 4);  // a file is no terminal: plain
    EXPECT_FALSE(p.live());
    for (int64_t s = 1; s <= 10; s++) p.update(s, 1.0);
    p.note("val loss 0.9");
  }
  const std::string out = captured(f);
  std::fclose(f);
  EXPECT_EQ(out.find('\r'), std::string::npos);
  EXPECT_NE(out.find("step  4/10"), std::string::npos) << out;
  EXPECT_NE(out.find("step  8/10"), std::string::npos) << out;
  EXPECT_NE(out.find("step 10/10"), std::string::npos) << out;
  EXPECT_EQ(out.find("step  5/10"), std::string::npos) << out;
  EXPECT_NE(out.find("val loss 0.9\n"), std::string::npos) << out;
}

TEST(Progress, LiveModeRedrawsOneLine) {
  std::FILE* f = std::tmpfile();
  {
    ProgressDisplay p(3, 100, f, ProgressDisplay::Mode::live);
    for (int64_t s = 1; s <= 3; s++) p.update(s, 1.0);
  }
  const std::string out = captured(f);
  std::fclose(f);
  EXPECT_EQ(out.rfind("\rstep 1/3", 0), 0u) << out;                             // first draw
  EXPECT_NE(out.find("\rstep 3/3 [####################]"), std::string::npos);  // the last always drawn
  EXPECT_EQ(out.back(), '\n');                                                  // finished with one newline
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1);
}

// The tuning bar: live, one line redrawn and ended by finish(); plain, a line per item finished. A line
// left open is ended by end_open_progress_line(), so that an error message starts on its own line.
TEST(Progress, CountProgressFollowsTheModeAndAnOpenLineCanBeEnded) {
  std::FILE* f = std::tmpfile();
  {
    CountProgress p(f, ProgressMode::automatic);  // a file: plain
    p.update(0, 2, "64x64 batch 1: 3 timings");
    p.update(1, 2, "64x64 batch 1");
    p.update(1, 2, "64x128 batch 1: 1 timings");
    p.update(2, 2, "64x128 batch 1 (cached)");
  }
  std::string out = captured(f);
  std::fclose(f);
  EXPECT_EQ(out, "1/2 64x64 batch 1\n2/2 64x128 batch 1 (cached)\n");

  f = std::tmpfile();
  CountProgress live(f, ProgressMode::live);
  live.update(1, 4, "64x64 batch 1");
  end_open_progress_line();
  std::fprintf(f, "dmuon: error: something\n");
  live.finish();  // the line was ended already: no second newline
  out = captured(f);
  std::fclose(f);
  EXPECT_EQ(out, "\r[#######.......................] 1/4 64x64 batch 1\033[K\ndmuon: error: something\n");
}

TEST(MetricsCsv, WritesHeaderRowsAndEmptyValidation) {
  test::TempDir dir;
  const std::string path = dir.file("run.csv");
  {
    MetricsCsvWriter w(path);
    w.write({1, 5.5, std::nullopt, 0.25, 0.2, 0.03, 0.01});
    w.write({2, 5.25, 5.375, 0.5, 0.25, 0.125, 0.0625});
  }
  EXPECT_EQ(read_file(path),
            "step,train_loss,val_loss,step_s,fwd_bwd_s,optim_s,comm_wait_s\n"
            "1,5.5,,0.25,0.2,0.03,0.01\n"
            "2,5.25,5.375,0.5,0.25,0.125,0.0625\n");
  const auto rows = read_metrics_csv(path);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_FALSE(rows[0].val_loss.has_value());
  EXPECT_EQ(rows[1].val_loss, 5.375);
  EXPECT_EQ(rows[1].comm_wait_s, 0.0625);
  // A float32 loss survives the round trip exactly.
  const float loss = 2.7182817f;
  {
    MetricsCsvWriter w(path);
    w.write({1, loss, loss, 0, 0, 0, 0});
  }
  EXPECT_EQ(static_cast<float>(read_metrics_csv(path)[0].train_loss), loss);
}

TEST(MetricsCsv, BadFilesAreErrorsNamingThePath) {
  test::TempDir dir;
  EXPECT_THROW(MetricsCsvWriter(dir.file("no/such/folder.csv")), Error);
  const std::string path = dir.file("bad.csv");
  std::ofstream(path) << "step,train_loss,val_loss,step_s,fwd_bwd_s,optim_s,comm_wait_s\n1,abc,,0,0,0,0\n";
  try {
    read_metrics_csv(path);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path + " line 2: column train_loss"), std::string::npos) << e.what();
  }
  std::ofstream(path) << "a,b\n";
  EXPECT_THROW(read_metrics_csv(path), Error);
}

// A resumed run appends after the checkpoint's step, dropping rows of the earlier run past it; a file
// that is not a metrics file is neither replaced nor appended to.
TEST(MetricsCsv, ResumeAppendsAfterTheCheckpointStep) {
  test::TempDir dir;
  const std::string path = dir.file("run.csv");
  {
    MetricsCsvWriter w(path);
    for (int64_t s = 1; s <= 4; s++) w.write({s, 5.0 - s, std::nullopt, 0.25, 0.2, 0.03, 0.01});
  }
  {
    MetricsCsvWriter w(path, 3);  // resumed from a checkpoint of step 3: the earlier run's step 4 goes
    w.write({4, 0.5, 0.75, 0.25, 0.2, 0.03, 0.01});
    w.write({5, 0.25, std::nullopt, 0.25, 0.2, 0.03, 0.01});
  }
  const auto rows = read_metrics_csv(path);
  ASSERT_EQ(rows.size(), 5u);
  for (int64_t i = 0; i < 5; i++) EXPECT_EQ(rows[i].step, i + 1);
  EXPECT_EQ(rows[2].train_loss, 2.0);  // the earlier run's
  EXPECT_EQ(rows[3].train_loss, 0.5);  // the resumed run's
  // Resuming without the file starts a new one.
  {
    MetricsCsvWriter w(dir.file("new.csv"), 3);
    w.write({4, 1.0, std::nullopt, 0, 0, 0, 0});
  }
  EXPECT_EQ(read_metrics_csv(dir.file("new.csv")).size(), 1u);

  const std::string notes = dir.file("notes.txt");
  std::ofstream(notes) << "my notes\n";
  for (std::optional<int64_t> resume : {std::optional<int64_t>(), std::optional<int64_t>(3)}) {
    try {
      MetricsCsvWriter w(notes, resume);
      ADD_FAILURE() << "wrote into " << notes;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(notes + " exists and is not a metrics file"), std::string::npos)
          << e.what();
    }
    EXPECT_THROW(MetricsCsvWriter::check(notes), Error);
  }
  EXPECT_EQ(read_file(notes), "my notes\n");
  // Where no file can be created, the check says so before any work.
  try {
    MetricsCsvWriter::check(notes + "/run.csv");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(notes + " is not a folder"), std::string::npos) << e.what();
  }
  MetricsCsvWriter::check("/dev/null");  // written in place
}

// Two small runs: one with validation every other step, one without.
std::vector<PlotRun> sample_runs(const test::TempDir& dir) {
  std::vector<PlotRun> runs = {{"adamw_np2", dir.file("a.csv")}, {"dmuon's np2", dir.file("b.csv")}};
  MetricsCsvWriter a(runs[0].csv_path), b(runs[1].csv_path);
  for (int s = 1; s <= 12; s++) {
    const double loss = 5.5 * std::exp(-0.05 * s);
    a.write({s, loss, s % 2 ? std::nullopt : std::optional<double>(loss + 0.1), 0.3, 0.2, 0.06, 0.04});
    b.write({s, loss * 0.95, std::nullopt, 0.25, 0.2, 0.03, 0.02});
  }
  return runs;
}

void expect_png(const std::string& path) {
  const std::string png = read_file(path);
  ASSERT_GT(png.size(), 1000u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
}

TEST(Plot, LossCurvesAndStepTimeBreakdownArePngs) {
  test::TempDir dir;
  const auto runs = sample_runs(dir);
  plot_loss_curves(runs, dir.file("loss.png"), {.title = "loss vs step, 'quoted' and it's fine"});
  expect_png(dir.file("loss.png"));
  plot_step_time_breakdown(runs, dir.file("time.png"));
  expect_png(dir.file("time.png"));
  EXPECT_FALSE(std::ifstream(dir.file("loss.png.partial")).good());
}

TEST(Plot, MissingGnuplotOrBadInputAreErrors) {
  test::TempDir dir;
  const auto runs = sample_runs(dir);
  try {
    plot_loss_curves(runs, dir.file("x.png"), {.title = "", .gnuplot = "/nonexistent/gnuplot"});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gnuplot-nox"), std::string::npos) << e.what();
  }
  EXPECT_THROW(plot_loss_curves({}, dir.file("x.png")), Error);
  EXPECT_THROW(plot_loss_curves({{"missing", dir.file("missing.csv")}}, dir.file("x.png")), Error);
  // A gnuplot that fails leaves neither the plot nor its partial file behind.
  EXPECT_THROW(plot_loss_curves(runs, dir.file("y.png"), {.title = "", .gnuplot = "false"}), Error);
  EXPECT_FALSE(std::ifstream(dir.file("y.png")).good());
  EXPECT_FALSE(std::ifstream(dir.file("y.png.partial")).good());
  try {
    run_gnuplot("this is not gnuplot\n");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gnuplot failed"), std::string::npos) << e.what();
  }
}

TEST(RunSummary, TakesTheLastValidationLossAndMedianTimes) {
  std::vector<StepMetrics> rows(4);
  for (int i = 0; i < 4; ++i) {
    rows[i].step = i + 1;
    rows[i].step_s = 1.0 + i;  // 1 2 3 4: median 2.5
    rows[i].optim_s = 0.1 * (4 - i);
  }
  rows[1].val_loss = 3.0;
  rows[3].val_loss = 2.5;
  const RunSummary s = summarize_run(rows);
  EXPECT_EQ(s.steps, 4);
  EXPECT_EQ(s.val_step, 4);
  EXPECT_DOUBLE_EQ(*s.val_loss, 2.5);
  EXPECT_DOUBLE_EQ(s.step_s, 2.5);
  EXPECT_DOUBLE_EQ(s.optim_s, 0.25);
  EXPECT_EQ(median({}), 0);
  EXPECT_EQ(median({3, 1, 2}), 2);
  EXPECT_EQ(median({4, 1, 3, 2}), 2.5);  // even count: the mean of the two middle values (statistics.hpp)
}

}  // namespace
}  // namespace dmuon
