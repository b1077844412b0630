// Progress on the console, by one rule for every display (--progress auto|live|plain): live, one line
// redrawn in place with '\r'; plain, whole lines now and then, for log files and CI; auto, live when
// the stream is a terminal. Training shows step/total, a bar, loss, tokens/s and ETA (ProgressDisplay);
// other work a count of items done (CountProgress: tuning's shapes, simulated device counts).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace dmuon {

// The progress line for `step` of `total` after `elapsed_s` seconds: pure, so tests can pin it down.
// Example: "step  120/500 [#####...............] loss 2.3456 | 12.3k tok/s | ETA 1m23s".
std::string format_progress(int64_t step, int64_t total, double loss, double elapsed_s, int64_t tokens_per_step,
                            bool with_bar);

enum class ProgressMode { automatic, live, plain };  // automatic: live when the stream is a terminal
// "auto" | "live" | "plain"; throws dmuon::Error naming `flag` and the accepted values.
ProgressMode parse_progress_mode(const std::string& text, const std::string& flag = "--progress");

// Ends a live line that a display left open (with a newline on its stream), so that what follows, an
// error message above all, starts on its own line. Every display here registers its open line.
void end_open_progress_line();

class ProgressDisplay {
 public:
  using Mode = ProgressMode;
  // plain_every: steps between plain lines (0: about 20 lines per run); the last step always prints.
  ProgressDisplay(int64_t total_steps, int64_t tokens_per_step, std::FILE* out = stderr, Mode mode = Mode::automatic,
                  int64_t plain_every = 0);
  // Reports that `step` (1-based) finished with training loss `loss`.
  void update(int64_t step, double loss);
  // Prints a line that is not progress (e.g. a validation result) without breaking the live line.
  void note(const std::string& line);
  // Ends the live line with a newline; idempotent, also run by the destructor.
  void finish();
  ~ProgressDisplay();

  bool live() const { return live_; }

 private:
  int64_t total_, tokens_per_step_, plain_every_;
  std::FILE* out_;
  bool live_;
  bool line_open_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

// Items done out of a total, with what is being done: live, "[#####.....] 3/7 384x128 batch 1" redrawn
// in place (at most every 0.1 s, and on every item finished); plain, one line per item finished.
class CountProgress {
 public:
  // out: null shows nothing.
  CountProgress(std::FILE* out, ProgressMode mode);
  // `done` of `total` items finished; `what`: the current one.
  void update(size_t done, size_t total, const std::string& what);
  // Ends the live line with a newline; idempotent, also run by the destructor.
  void finish();
  ~CountProgress();
  CountProgress(const CountProgress&) = delete;
  CountProgress& operator=(const CountProgress&) = delete;

 private:
  std::FILE* out_;
  bool live_;
  bool line_open_ = false;
  size_t last_done_ = 0;
  std::chrono::steady_clock::time_point last_draw_;
};

}  // namespace dmuon
