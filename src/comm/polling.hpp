// Waiting by polling: Work::wait and Work::settle, and the MPI backend's wait for an operation
// whose handle is dropped before it completes. Comm progress is by polling (comm.hpp), so every
// wait is a loop over a non-blocking test.
#pragma once

#include <chrono>
#include <thread>

namespace dmuon::comm::detail {

// Calls done() until it returns true or `timeout_s` seconds pass: spinning at first, then
// yielding the core between calls, since ranks may outnumber cores. Returns whether done()
// returned true; `waited_s` receives the seconds spent. Exceptions from done() propagate.
template <typename Done>
bool poll_until(Done&& done, double timeout_s, double& waited_s) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto deadline = start + std::chrono::duration<double>(timeout_s);
  for (int polls = 0;; ++polls) {
    const bool finished = done();
    if (finished || ((polls & 255) == 0 && clock::now() > deadline)) {
      waited_s = std::chrono::duration<double>(clock::now() - start).count();
      return finished;
    }
    if (polls > 1000) std::this_thread::yield();
  }
}

}  // namespace dmuon::comm::detail
