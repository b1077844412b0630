// dmuon_gpu_check's verdicts: one line per check ("ok" or "FAIL", what, the measured value, its limit), an exception
// as a failed check, and the failure count that decides the exit status. Each line is flushed as it is written:
// a crash, a kill or the GPU check's timeout (scripts/gpu-check.sh) loses no verdict already reached.
#pragma once

#include <cstdio>
#include <exception>
#include <functional>
#include <string>

namespace dmuon {

class CheckLog {
 public:
  // ok: value ≤ limit was required and held (or the caller's own test passed).
  void report(bool ok, const std::string& what, double value, double limit) {
    line("%-4s %-64s %.3g (limit %.3g)\n", ok ? "ok" : "FAIL", what.c_str(), value, limit);
    if (!ok) ++failures_;
  }
  // A check with no figure: it held or it did not.
  void expect(bool ok, const std::string& what) {
    line("%-4s %s\n", ok ? "ok" : "FAIL", what.c_str());
    if (!ok) ++failures_;
  }
  void note(const std::string& what) { line("note %s\n", what.c_str()); }
  // Runs one check (or one group of checks), so that an exception fails that check alone: reported as FAIL with its
  // message and counted, and the checks after it still run (a sticky CUDA error fails them on their own).
  void guard(const std::string& what, const std::function<void()>& check) {
    try {
      check();
    } catch (const std::exception& e) {
      expect(false, what + " threw: " + e.what());
    }
  }
  int failures() const { return failures_; }

 private:
  template <typename... Args>
  static void line(const char* format, Args... args) {
    std::printf(format, args...);
    std::fflush(stdout);  // stdout into a file or pipe is fully buffered
  }
  int failures_ = 0;
};

}  // namespace dmuon
