#include "console/progress.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "dmuon/error.hpp"

namespace dmuon {

namespace {

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const auto total = static_cast<int64_t>(std::llround(s));
  char buf[32];
  if (total >= 3600) {
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(total / 3600),
                  static_cast<long long>(total / 60 % 60));
  } else if (total >= 60) {
    std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(total / 60),
                  static_cast<long long>(total % 60));
  } else {
    std::snprintf(buf, sizeof buf, "%llds", static_cast<long long>(total));
  }
  return buf;
}

std::string format_rate(double per_s) {
  char buf[32];
  if (per_s >= 1e6) {
    std::snprintf(buf, sizeof buf, "%.2fM", per_s / 1e6);
  } else if (per_s >= 1e3) {
    std::snprintf(buf, sizeof buf, "%.1fk", per_s / 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.0f", per_s);
  }
  return buf;
}

constexpr int kBarWidth = 20;
constexpr double kRedrawInterval_s = 0.1;  // a live line redrawn faster only costs terminal time

// The stream with a live line open (one at a time: a display ends its line before another draws).
std::FILE* g_open_line = nullptr;

void mark_line(std::FILE* out, bool open) {
  if (open) g_open_line = out;
  else if (g_open_line == out) g_open_line = nullptr;
}

// Whether a display's line is still open: end_open_progress_line may have ended it.
bool still_open(bool line_open, std::FILE* out) { return line_open && g_open_line == out; }

bool is_live(ProgressMode mode, std::FILE* out) {
  return mode == ProgressMode::live || (mode == ProgressMode::automatic && isatty(fileno(out)));
}

}  // namespace

ProgressMode parse_progress_mode(const std::string& text, const std::string& flag) {
  if (text == "auto") return ProgressMode::automatic;
  if (text == "live") return ProgressMode::live;
  if (text == "plain") return ProgressMode::plain;
  DMUON_FAIL(flag, " must be auto, live or plain, got '", text, "'");
}

void end_open_progress_line() {
  if (!g_open_line) return;
  std::fprintf(g_open_line, "\n");
  std::fflush(g_open_line);
  g_open_line = nullptr;
}

std::string format_progress(int64_t step, int64_t total, double loss, double elapsed_s, int64_t tokens_per_step,
                            bool with_bar) {
  std::ostringstream os;
  const int digits = static_cast<int>(std::to_string(total).size());
  char head[64];
  std::snprintf(head, sizeof head, "step %*lld/%lld", digits, static_cast<long long>(step),
                static_cast<long long>(total));
  os << head;
  if (with_bar) {
    const int filled = total > 0 ? static_cast<int>(kBarWidth * std::min(step, total) / total) : 0;
    os << " [" << std::string(filled, '#') << std::string(kBarWidth - filled, '.') << "]";
  }
  char lossbuf[32];
  std::snprintf(lossbuf, sizeof lossbuf, "%.4f", loss);
  os << " loss " << lossbuf;
  const double rate = elapsed_s > 0 ? static_cast<double>(step * tokens_per_step) / elapsed_s : 0.0;
  os << " | " << (elapsed_s > 0 ? format_rate(rate) : "?") << " tok/s";
  const double eta = step > 0 ? elapsed_s / static_cast<double>(step) * static_cast<double>(total - step) : NAN;
  os << " | ETA " << format_duration(eta);
  return os.str();
}

ProgressDisplay::ProgressDisplay(int64_t total_steps, int64_t tokens_per_step, std::FILE* out, Mode mode,
                                 int64_t plain_every)
    : total_(total_steps),
      tokens_per_step_(tokens_per_step),
      plain_every_(plain_every > 0 ? plain_every : std::max<int64_t>(1, total_steps / 20)),
      out_(out),
      live_(is_live(mode, out)),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

void ProgressDisplay::update(int64_t step, double loss) {
  const auto now = std::chrono::steady_clock::now();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const bool last = step >= total_;
  if (live_) {
    if (!last && line_open_ && std::chrono::duration<double>(now - last_draw_).count() < kRedrawInterval_s) return;
    // "\033[K" clears what a longer previous line left to the right of the cursor.
    std::fprintf(out_, "\r%s\033[K", format_progress(step, total_, loss, elapsed, tokens_per_step_, true).c_str());
    line_open_ = true;
    mark_line(out_, true);
    last_draw_ = now;
  } else if (last || step % plain_every_ == 0) {
    std::fprintf(out_, "%s\n", format_progress(step, total_, loss, elapsed, tokens_per_step_, false).c_str());
  }
  std::fflush(out_);
}

void ProgressDisplay::note(const std::string& line) {
  if (still_open(line_open_, out_)) std::fprintf(out_, "\r\033[K");
  std::fprintf(out_, "%s\n", line.c_str());
  line_open_ = false;
  mark_line(out_, false);
  std::fflush(out_);
}

void ProgressDisplay::finish() {
  if (still_open(line_open_, out_)) {
    std::fprintf(out_, "\n");
    std::fflush(out_);
    line_open_ = false;
    mark_line(out_, false);
  }
}

ProgressDisplay::~ProgressDisplay() { finish(); }

CountProgress::CountProgress(std::FILE* out, ProgressMode mode)
    : out_(out), live_(out && is_live(mode, out)), last_draw_(std::chrono::steady_clock::now()) {}

void CountProgress::update(size_t done, size_t total, const std::string& what) {
  if (!out_) return;
  const bool finished_one = done > last_done_;
  last_done_ = std::max(last_done_, done);
  if (!live_) {
    if (finished_one) std::fprintf(out_, "%zu/%zu %s\n", done, total, what.c_str());
    std::fflush(out_);
    return;
  }
  const auto now = std::chrono::steady_clock::now();
  if (!finished_one && line_open_ && std::chrono::duration<double>(now - last_draw_).count() < kRedrawInterval_s) return;
  constexpr int kWidth = 30;
  const int filled = total ? static_cast<int>(kWidth * std::min(done, total) / total) : kWidth;
  std::fprintf(out_, "\r[%s%s] %zu/%zu %s\033[K", std::string(filled, '#').c_str(),
               std::string(kWidth - filled, '.').c_str(), done, total, what.c_str());
  std::fflush(out_);
  line_open_ = true;
  mark_line(out_, true);
  last_draw_ = now;
}

void CountProgress::finish() {
  if (!still_open(line_open_, out_)) {
    line_open_ = false;
    return;
  }
  std::fprintf(out_, "\n");
  std::fflush(out_);
  line_open_ = false;
  mark_line(out_, false);
}

CountProgress::~CountProgress() { finish(); }

}  // namespace dmuon
