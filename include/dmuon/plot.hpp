// PNG plots of training runs, drawn by gnuplot (Debian's gnuplot-nox, terminal pngcairo) run as a
// subprocess on a generated script. The data are read from metrics CSVs (metrics_csv.hpp) and passed to
// gnuplot inline, so file names never need quoting in gnuplot's syntax.
#pragma once

#include <string>
#include <vector>

namespace dmuon {

struct PlotRun {
  std::string label;     // legend entry, e.g. "AdamW np2"
  std::string csv_path;  // a metrics CSV
};

struct PlotOptions {
  std::string title;
  std::string gnuplot = "gnuplot";  // the executable, looked up on PATH
  int width = 900, height = 560;    // pixels
};

// (1) Training loss against step for every run (lines), with validation loss where evaluated (points).
void plot_loss_curves(const std::vector<PlotRun>& runs, const std::string& png_path, const PlotOptions& options = {});

// (2) Per run, the median seconds per step of forward+backward, optimizer and communication wait, as
// stacked bars.
void plot_step_time_breakdown(const std::vector<PlotRun>& runs, const std::string& png_path,
                              const PlotOptions& options = {});

// Runs gnuplot on `script` (which must `set output` itself). Throws dmuon::Error when gnuplot cannot be
// started (naming the executable and the Debian package) or exits with an error (with its stderr).
void run_gnuplot(const std::string& script, const std::string& gnuplot = "gnuplot");

}  // namespace dmuon
