// The trainer's per-step metrics (StepMetrics, trainer.hpp) as CSV, one row per optimizer step:
//   step,train_loss,val_loss,step_s,fwd_bwd_s,optim_s,comm_wait_s
// val_loss is empty on steps without evaluation.
#pragma once

#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "dmuon/statistics.hpp"  // median
#include "dmuon/trainer.hpp"

namespace dmuon {

// Writes the header on construction and flushes every row, so a run that dies keeps what it measured.
// A resumed run (`resume_after`: the checkpoint's step) appends to the file its earlier run wrote,
// after dropping rows past that step (a run that went on after its last checkpoint); without the file,
// it starts a new one. A file that is not a metrics file is never replaced or appended to.
// Throws dmuon::Error naming the path when the file is not ours or cannot be created or written.
class MetricsCsvWriter {
 public:
  explicit MetricsCsvWriter(const std::string& path, std::optional<int64_t> resume_after = std::nullopt);
  // Before any work: throws when the file is not ours or could not be written, with the folders above
  // it created (the caller creates them before constructing the writer); writes nothing.
  static void check(const std::string& path);
  void write(const StepMetrics& row);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ofstream out_;
};

// Reads a file written by MetricsCsvWriter; throws dmuon::Error naming the path and line when the header
// or a row is malformed.
std::vector<StepMetrics> read_metrics_csv(const std::string& path);

// A run's headline figures: its last validation loss and the medians of the per-step times.
struct RunSummary {
  int64_t steps = 0;                                               // rows
  std::optional<double> val_loss;                                  // the last evaluated validation loss
  int64_t val_step = 0;                                            // the step it was evaluated after
  double step_s = 0, fwd_bwd_s = 0, optim_s = 0, comm_wait_s = 0;  // medians over steps
};
RunSummary summarize_run(const std::vector<StepMetrics>& rows);

}  // namespace dmuon
