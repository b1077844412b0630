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

// Renders a plot to png_path: the terminal (pngcairo, options' size, no enhanced text), output, grid
// and title come from here; `script_body` holds the rest (plot commands, inline data). Atomic:
// png_path is replaced only by a complete PNG.
void render_plot(const std::string& script_body, const std::string& png_path, const PlotOptions& options = {});

// `s` as a gnuplot single-quoted string (a quote inside is doubled).
std::string gnuplot_quoted(const std::string& s);

// Runs gnuplot on `script` (which must `set output` itself). Throws dmuon::Error when gnuplot cannot be
// started (naming the executable and the Debian package) or exits with an error (with its stderr).
void run_gnuplot(const std::string& script, const std::string& gnuplot = "gnuplot");

}  // namespace dmuon
