// `dmuon compare`: reads the metrics CSVs of several training runs (dmuon train --csv), prints a table
// of their final validation loss and median step times with each run's step-time overhead over the
// first (the baseline), and draws the loss curves and the step-time breakdown as PNGs.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "cli_kit/cli.hpp"
#include "dmuon/atomic_file.hpp"
#include "dmuon/error.hpp"
#include "dmuon/metrics_csv.hpp"
#include "console/plot.hpp"

namespace compare {

struct CompareArgs {
  std::vector<std::string> runs;  // LABEL=CSV
  std::string out = "runs";
  std::string title;
  bool no_plots = false;
};

dmuon::PlotRun parse_run(const std::string& text) {
  const size_t eq = text.find('=');
  DMUON_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < text.size(), "--run expects LABEL=CSV, got '", text, "'");
  return {text.substr(0, eq), text.substr(eq + 1)};
}

void run_compare(const CompareArgs& args) {
  DMUON_CHECK(!args.runs.empty(), "dmuon compare needs at least one --run LABEL=CSV");
  if (!args.no_plots) {  // checked before any work: the plots' folder must take new files
    const std::string why = dmuon::why_cannot_write(args.out, true);
    DMUON_CHECK(why.empty(), "--out ", args.out, ": cannot write the plots there: ", why);
  }
  std::vector<dmuon::PlotRun> runs;
  std::vector<dmuon::RunSummary> sums;
  for (const std::string& r : args.runs) {
    runs.push_back(parse_run(r));
    sums.push_back(dmuon::summarize_run(dmuon::read_metrics_csv(runs.back().csv_path)));
    DMUON_CHECK(sums.back().steps > 0, "metrics file ", runs.back().csv_path, " has no steps");
  }
  std::printf("%-14s %6s %10s %14s %12s %12s %12s %14s\n", "run", "steps", "val loss", "step ms (med)", "fwd+bwd ms",
              "optim ms", "comm wait ms", "step vs first");
  for (size_t i = 0; i < runs.size(); ++i) {
    const dmuon::RunSummary& s = sums[i];
    char val[32] = "n/a";
    if (s.val_loss) std::snprintf(val, sizeof val, "%.4f", *s.val_loss);
    char rel[32] = "baseline";
    if (i > 0) std::snprintf(rel, sizeof rel, "%+.1f%%", 100.0 * (s.step_s / sums[0].step_s - 1.0));
    std::printf("%-14s %6lld %10s %14.1f %12.1f %12.1f %12.1f %14s\n", runs[i].label.c_str(),
                static_cast<long long>(s.steps), val, 1e3 * s.step_s, 1e3 * s.fwd_bwd_s, 1e3 * s.optim_s,
                1e3 * s.comm_wait_s, rel);
  }
  std::printf(
      "times: medians over steps of the max over ranks; val loss: the last evaluation (mean over the same "
      "validation batches)\n");
  if (args.no_plots) return;
  std::filesystem::create_directories(args.out);
  const std::string loss_png = args.out + "/loss.png", time_png = args.out + "/step_time.png";
  dmuon::PlotOptions o;
  o.title = args.title.empty() ? "training loss (lines) and validation loss (points)" : args.title;
  dmuon::plot_loss_curves(runs, loss_png, o);
  o.title = args.title.empty() ? "median step time: forward+backward, optimizer, exposed communication" : args.title;
  dmuon::plot_step_time_breakdown(runs, time_png, o);
  std::printf("plots: %s %s\n", loss_png.c_str(), time_png.c_str());
}

dmuon::cli::Registration reg("", [](CLI::App& app) {
  auto args = std::make_shared<CompareArgs>();
  auto* c = app.add_subcommand("compare", "Compare training runs: a table from their metrics CSVs, and PNG plots");
  c->add_option("--run", args->runs, "LABEL=CSV of a run (repeat; the first is the baseline)")->required();
  c->add_option("--out", args->out, "folder for loss.png and step_time.png")->capture_default_str();
  c->add_option("--title", args->title, "plot title (default: what each plot shows)");
  c->add_flag("--no-plots", args->no_plots, "print the table only");
  c->callback([args] { run_compare(*args); });
});

}  // namespace compare
