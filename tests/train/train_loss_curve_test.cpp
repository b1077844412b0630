// The training dynamics of `dmuon train` cannot change silently (torchtitan keeps a loss curve per
// configuration): a 50-step run of the GPT example on the fortunes corpus, seed fixed, is rerun with DMuon
// and with AdamW at 1 rank and at 2 (mpirun -np 2), and every step's training loss must equal the committed
// curve of tests/data/train_loss_curve.csv within kRelTol. The model is tiny (L2 C32 NH2 T32, batch 8:
// about 2 s a run on 2 cores) so the test stays cheap; the learning rates, momentum, weight decay, warmup
// and Newton–Schulz settings are the CLI's defaults, so a changed default fails here too. --no-tune: a
// tuned run picks its NS kernels and DMuon's owners from this machine's timings.
//
// To regenerate the file after a change meant to move the losses (review its diff and say why in the commit):
//   DMUON_WRITE_LOSS_CURVE=1 build/tests/train/train_loss_curve_test
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "dmuon/metrics_csv.hpp"
#include "test_data.hpp"

namespace dmuon {
namespace {

// The run every curve shares; each curve adds --optim and --csv (and mpirun -np for 2 ranks). One BLAS thread
// per rank at every world size, so np 1 and np 2 run the same kernels.
const std::string kArgs =
    "train --steps 50 --seed 1 --layers 2 --width 32 --heads 2 --context 32 --batch 8 --val-every 0 "
    "--val-batches 1 --no-tune --threads 1 --progress plain";

// |loss − committed| ≤ kRelTol·|committed| at every step. Measured on this configuration (2026-12-02, AMD
// EPYC, OpenBLAS 0.3.21): the same run twice is bit-identical (DMuon, AdamW; np 1, np 2); np 2 and np 4
// against np 1 differ by at most 3.5e-7 absolute, 7.5e-8 relative (the mean of two half-batch losses is not
// rounded as one whole-batch loss); OpenBLAS's kernels of other CPUs (OPENBLAS_CORETYPE=Haswell, SkylakeX,
// Zen, Sandybridge, Nehalem, Prescott) by at most 4.8e-7 absolute, 1.2e-7 relative: about one float32
// rounding of the loss, which did not grow over the 50 steps. kRelTol is 80 times that spread, and a change
// of the dynamics is outside it (worst step, relative; steps outside kRelTol):
//   DMuon --lr 0.0201 (+0.5%)                      6.4e-5, 25 of 50    --lr 0.0202 (+1%)  1.3e-4, 38 of 50
//   DMuon --weight-decay 0.01 (default 0)          2.1e-4, 40 of 50    --warmup 19 (20)   1.2e-2, 48 of 50
//   DMuon --adamw-lr 0.00303 (+1%)                 2.9e-3, 49 of 50    AdamW --lr 0.00303 2.9e-3, 49 of 50
//   DMuon, Muon momentum 0.94 (0.95; in code)      3.0e-3, 42 of 50
//   DMuon, Keller's NS a = 3.4435 (3.4445)         2.3e-5,  8 of 50    a = 3.4440         1.2e-5, 2 of 50
// so Keller's a changed by less than about 5e-4 (1.5e-4 relative) would pass unseen.
constexpr double kRelTol = 1e-5;

struct Curve {
  std::string optim;
  int ranks;
  std::string column() const { return optim + "_np" + std::to_string(ranks); }
};
const std::vector<Curve> kCurves = {{"dmuon", 1}, {"dmuon", 2}, {"adamw", 1}, {"adamw", 2}};

const std::string kCurveFile = "train_loss_curve.csv";
// The file's first line: the run its columns come from.
std::string file_header() { return "# dmuon " + kArgs + " --optim <optim> (np 2: mpirun -np 2)"; }

// The training losses of one run, step 1 first.
std::vector<double> train_losses(const Curve& c, const test::TempDir& dir) {
  const std::string csv = dir.file(c.column() + ".csv");
  std::string command = std::string(DMUON_CLI_PATH) + " " + kArgs + " --optim " + c.optim + " --csv " + csv;
  if (c.ranks > 1) command = std::string(DMUON_MPIRUN) + " -np " + std::to_string(c.ranks) + " " + command;
  // timeout: a hung run fails the test with exit code 124 instead of waiting for ctest's limit.
  const test::CommandResult r =
      test::run_command("OPENBLAS_NUM_THREADS=1 DMUON_COMM_TIMEOUT_S=60 timeout 120 " + command);
  if (r.exit_code != 0) {
    ADD_FAILURE() << c.column() << ": `" << command << "` exited with " << r.exit_code << ":\n" << r.output;
    return {};
  }
  std::vector<double> losses;
  for (const StepMetrics& row : read_metrics_csv(csv)) losses.push_back(row.train_loss);
  return losses;
}

// A loss with the digits the metrics file has.
std::string digits(double loss) {
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", loss);
  return text;
}

// The committed curves by column name; fails the test when the file is not the one kArgs describes.
std::map<std::string, std::vector<double>> read_curves(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!std::getline(in, line) || line != file_header()) {
    ADD_FAILURE() << path << " does not start with the run this test makes (\"" << file_header()
                  << "\"): regenerate it (DMUON_WRITE_LOSS_CURVE=1, tests/data/README.md)";
    return {};
  }
  std::vector<std::string> columns;
  std::getline(in, line);
  std::istringstream header(line);
  for (std::string name; std::getline(header, name, ',');) columns.push_back(name);
  std::map<std::string, std::vector<double>> curves;
  for (int row = 1; std::getline(in, line); ++row) {
    std::istringstream cells(line);
    std::string cell;
    for (size_t k = 0; k < columns.size() && std::getline(cells, cell, ','); ++k)
      if (k > 0) curves[columns[k]].push_back(std::stod(cell));
  }
  return curves;
}

void write_curves(const std::string& path, const std::map<std::string, std::vector<double>>& curves) {
  std::ofstream out(path);
  out << file_header() << "\nstep";
  for (const Curve& c : kCurves) out << ',' << c.column();
  out << '\n';
  for (size_t s = 0; s < curves.at(kCurves[0].column()).size(); ++s) {
    out << s + 1;
    for (const Curve& c : kCurves) out << ',' << digits(curves.at(c.column()).at(s));
    out << '\n';
  }
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

TEST(TrainLossCurve, EveryStepMatchesTheCommittedCurve) {
  test::TempDir dir;
  const std::string path = test::data_path(kCurveFile);
  if (std::getenv("DMUON_WRITE_LOSS_CURVE")) {
    std::map<std::string, std::vector<double>> runs;
    for (const Curve& c : kCurves) {
      runs[c.column()] = train_losses(c, dir);
      ASSERT_EQ(runs[c.column()].size(), 50u) << c.column();
    }
    write_curves(path, runs);
    GTEST_SKIP() << "wrote " << path << " (DMUON_WRITE_LOSS_CURVE is set): nothing compared";
  }
  const std::map<std::string, std::vector<double>> committed = read_curves(path);
  for (const Curve& c : kCurves) {
    SCOPED_TRACE(c.column());
    const auto it = committed.find(c.column());
    ASSERT_NE(it, committed.end()) << path << " has no column " << c.column();
    const std::vector<double>& want = it->second;
    const std::vector<double> got = train_losses(c, dir);
    ASSERT_EQ(got.size(), want.size());
    // One message per curve: how many steps are off, the first and the worst.
    int off = 0, first = 0, worst = 0;
    double worst_rel = 0;
    for (size_t s = 0; s < want.size(); ++s) {
      const double rel = std::abs(got[s] - want[s]) / std::abs(want[s]);
      if (rel <= kRelTol) continue;
      if (off++ == 0) first = static_cast<int>(s);
      if (rel > worst_rel) worst_rel = rel, worst = static_cast<int>(s);
    }
    EXPECT_EQ(off, 0) << off << " of " << want.size() << " steps differ from " << path << " by more than "
                      << digits(kRelTol) << " relative: first step " << first + 1 << " (loss " << digits(got[first])
                      << ", committed " << digits(want[first]) << "), worst step " << worst + 1 << " (loss "
                      << digits(got[worst]) << ", committed " << digits(want[worst]) << ", " << digits(worst_rel)
                      << " relative)";
  }
}

}  // namespace
}  // namespace dmuon
