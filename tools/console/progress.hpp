// Training progress on the console: on a terminal, one live line redrawn in place with '\r' (step/total,
// a bar, loss, tokens/s, ETA); otherwise (a log file, CI) plain lines every few steps.
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

class ProgressDisplay {
 public:
  enum class Mode { automatic, live, plain };  // automatic: live when `out` is a terminal
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

}  // namespace dmuon
