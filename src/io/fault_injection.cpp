// Fault-injection hooks (fault_injection.hpp).
#include "io/fault_injection.hpp"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

namespace dmuon::fault {

namespace {

// The environment variable's value as a count ≥ 1, or 0 (never) when unset or not a number.
long long armed_at(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return 0;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  return end != v && *end == '\0' && n >= 1 ? n : 0;
}

}  // namespace

void point(const char* what) {
  static const long long kill_at = armed_at("DMUON_FAULT_KILL_AT");
  static std::atomic<long long> reached{0};
  if (++reached != kill_at) return;
  std::fprintf(stderr, "dmuon fault injection: SIGKILL at fault point %lld (%s)\n", kill_at, what);
  std::fflush(stderr);
  ::kill(::getpid(), SIGKILL);
}

bool fail_write() {
  static const long long fail_at = armed_at("DMUON_FAULT_WRITE_ERROR_AT");
  static std::atomic<long long> writes{0};
  return ++writes == fail_at;
}

}  // namespace dmuon::fault
