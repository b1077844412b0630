#include "console/plot.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "dmuon/atomic_file.hpp"
#include "dmuon/error.hpp"
#include "dmuon/metrics_csv.hpp"

extern char** environ;

namespace dmuon {

namespace {

// A mkstemp file, removed when the object dies.
class TempFile {
 public:
  explicit TempFile(const char* suffix) {
    std::string pattern = (std::filesystem::temp_directory_path() / "dmuon-plot-XXXXXX").string() + suffix;
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    const int fd = mkstemps(buf.data(), static_cast<int>(std::strlen(suffix)));
    DMUON_CHECK(fd >= 0, "cannot create a temporary file ", pattern, ": ", std::strerror(errno));
    close(fd);
    path_ = buf.data();
  }
  ~TempFile() { std::remove(path_.c_str()); }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string script_head(const PlotOptions& o, const std::string& output) {
  std::ostringstream s;
  // noenhanced: labels such as "dmuon_np2" print literally instead of as subscripts.
  s << "set terminal pngcairo noenhanced size " << o.width << "," << o.height << "\n"
    << "set output " << gnuplot_quoted(output) << "\n"
    << "set grid\n";
  if (!o.title.empty()) s << "set title " << gnuplot_quoted(o.title) << "\n";
  return s.str();
}

std::vector<std::vector<StepMetrics>> read_runs(const std::vector<PlotRun>& runs) {
  DMUON_CHECK(!runs.empty(), "nothing to plot: no runs given");
  std::vector<std::vector<StepMetrics>> data;
  for (const PlotRun& r : runs) {
    data.push_back(read_metrics_csv(r.csv_path));
    DMUON_CHECK(!data.back().empty(), "metrics file ", r.csv_path, " has no rows to plot");
  }
  return data;
}

}  // namespace

void render_plot(const std::string& script_body, const std::string& png_path, const PlotOptions& o) {
  const std::string partial = png_path + ".partial";
  std::string png;
  try {
    run_gnuplot(script_head(o, partial) + script_body, o.gnuplot);
    png = read_file(partial);
  } catch (const Error&) {
    std::remove(partial.c_str());  // gnuplot may have left part of a plot
    throw;
  }
  std::remove(partial.c_str());
  DMUON_CHECK(png.size() > 8 && png.compare(0, 8, "\x89PNG\r\n\x1a\n") == 0, "gnuplot output for ", png_path,
              " is not a PNG");
  write_file_atomically(png_path, png);
}

std::string gnuplot_quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

void run_gnuplot(const std::string& script, const std::string& gnuplot) {
  TempFile script_file(".gp"), errors(".err");
  {
    std::ofstream out(script_file.path());
    out << script;
    DMUON_CHECK(out.good(), "cannot write the gnuplot script ", script_file.path());
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, errors.path().c_str(), O_WRONLY | O_TRUNC, 0);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  std::vector<std::string> args = {gnuplot, script_file.path()};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, gnuplot.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  DMUON_CHECK(rc == 0, "cannot run gnuplot '", gnuplot, "': ", std::strerror(rc),
              " (install Debian's gnuplot-nox, or see scripts/install-deps.sh)");
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    DMUON_CHECK(errno == EINTR, "waiting for gnuplot failed: ", std::strerror(errno));
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return;
  std::string message = read_file(errors.path());
  if (WIFEXITED(status) && WEXITSTATUS(status) == 127) {
    DMUON_FAIL("cannot run gnuplot '", gnuplot, "': not found (install Debian's gnuplot-nox)");
  }
  DMUON_FAIL("gnuplot failed (", WIFEXITED(status) ? "exit " + std::to_string(WEXITSTATUS(status)) : "killed",
             "): ", message);
}

void plot_loss_curves(const std::vector<PlotRun>& runs, const std::string& png_path, const PlotOptions& o) {
  const auto data = read_runs(runs);
  std::ostringstream s;
  s << "set xlabel 'step'\nset ylabel 'loss (nats/byte)'\nset key top right\n";
  std::vector<std::string> plots;
  for (size_t r = 0; r < data.size(); r++) {
    const std::string block = "$run" + std::to_string(r);
    s << block << " << EOD\n";
    bool any_val = false;
    for (const StepMetrics& m : data[r]) {
      char line[96];
      std::snprintf(line, sizeof line, "%lld %.9g %.9g\n", static_cast<long long>(m.step), m.train_loss,
                    m.val_loss.value_or(NAN));  // gnuplot skips NaN points
      s << line;
      any_val = any_val || m.val_loss.has_value();
    }
    s << "EOD\n";
    const std::string color = " lc " + std::to_string(r + 1);
    plots.push_back(block + " using 1:2 with lines lw 2" + color + " title " + gnuplot_quoted(runs[r].label + " train"));
    if (any_val) {
      plots.push_back(block + " using 1:3 with points pt 7" + color + " title " + gnuplot_quoted(runs[r].label + " val"));
    }
  }
  s << "plot ";
  for (size_t i = 0; i < plots.size(); i++) s << (i ? ", \\\n     " : "") << plots[i];
  s << "\n";
  render_plot(s.str(), png_path, o);
}

void plot_step_time_breakdown(const std::vector<PlotRun>& runs, const std::string& png_path, const PlotOptions& o) {
  const auto data = read_runs(runs);
  std::ostringstream s;
  s << "set style data histograms\nset style histogram rowstacked\nset style fill solid 0.85 border -1\n"
    << "set boxwidth 0.6\nset yrange [0:*]\nset ylabel 'seconds per step (median)'\nset key outside below horizontal\n"
    << "$times << EOD\n";
  for (size_t r = 0; r < data.size(); r++) {
    std::vector<double> fwd, opt, comm;
    for (const StepMetrics& m : data[r]) {
      fwd.push_back(m.fwd_bwd_s);
      opt.push_back(m.optim_s);
      comm.push_back(m.comm_wait_s);
    }
    std::string label = runs[r].label;
    std::replace(label.begin(), label.end(), '"', '\'');  // a data-file string cannot hold a double quote
    char line[64];
    std::snprintf(line, sizeof line, " %.9g %.9g %.9g\n", median(fwd), median(opt), median(comm));
    s << '"' << label << '"' << line;
  }
  s << "EOD\n"
    << "plot $times using 2:xtic(1) title 'forward+backward', '' using 3 title 'optimizer', "
    << "'' using 4 title 'communication wait'\n";
  render_plot(s.str(), png_path, o);
}

}  // namespace dmuon
