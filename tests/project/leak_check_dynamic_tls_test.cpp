// The sanitized suite's leak check survives a dynamic TLS block wherever the heap puts it (issue 47).
//
// GCC 12's sanitizer runtime (as LLVM's before 17) records each dynamic TLS block it sees through
// __tls_get_addr, and takes a block that starts 16 bytes past a 4096-byte boundary for one of glibc 2.19 to
// 2.24, which had a header there: it reads the block's start and size from the 16 bytes before it. Since glibc
// 2.25 those bytes are the allocator's chunk header, so at exit LeakSanitizer's tracer scans a range such as
// [0x3f29, 0x3f29 + 0x400001102) and crashes: "Tracer caught signal 11: addr=0x3f30", "LeakSanitizer has
// encountered a fatal error", exit status 1 after every test has passed. Whether a block lands there depends on
// everything the process allocated before it (ranks, thread timing, the machine), so CI met it at random, in
// comm_mpi_test.np2 (OpenMPI's threads make such blocks in every MPI program). `make test-sanitize` runs with
// ASAN_OPTIONS=intercept_tls_get_addr=0 (Makefile): no block is recorded, and the blocks are still scanned as
// the heap chunks they are, reached from the thread's TLS vector.
//
// The test makes the block land at every offset in turn: child k allocates k small chunks (the size class the
// block is in: 32-byte chunks, so 128 steps cover 4096 bytes), loads a module with TLS, touches it, and runs the
// leak check. Without the option one child in 128 ends with the tracer's fatal error.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#if defined(__SANITIZE_ADDRESS__)
#include <dlfcn.h>
#include <sanitizer/lsan_interface.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr int kOffsets = 2 * 4096 / 32;  // every 32-byte step of a page, twice
void* kept[kOffsets];                     // reachable: never reported as leaks

// Exit status of a child: 0 a clean check, 2 leaks found, 3 the module failed to load; the sanitizer's fatal
// error exits with 1 (ASan's exitcode).
[[noreturn]] void child_with_tls_block_after(int chunks) {
  for (int i = 0; i < chunks; ++i) kept[i] = std::malloc(8);
  void* module = dlopen(DMUON_DYNAMIC_TLS_MODULE, RTLD_NOW);
  auto touch = module ? reinterpret_cast<int (*)()>(dlsym(module, "touch_dynamic_tls")) : nullptr;
  if (touch == nullptr) _exit(3);
  touch();
  _exit(__lsan_do_recoverable_leak_check() ? 2 : 0);
}

// Leaks 100 blocks: each one's only pointer is overwritten by the next's, so all but the last (which a register or
// the stack may still hold) are unreachable, and the leak check must report them.
void* volatile last_allocation = nullptr;
[[gnu::noinline]] void drop_allocations() {
  for (int i = 0; i < 100; ++i) last_allocation = std::malloc(1000);
  last_allocation = nullptr;
}

int status_of_child(void (*body)(int), int arg) {
  const pid_t pid = fork();
  if (pid == 0) body(arg);
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
#endif

TEST(SanitizedLeakCheck, SurvivesADynamicTlsBlockAtEveryHeapOffset) {
#if !defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "checks the sanitized build's leak check (make test-sanitize)";
#else
  // The check must be on, or the children below prove nothing.
  const int leaky = status_of_child([](int) {
    drop_allocations();
    _exit(__lsan_do_recoverable_leak_check() ? 0 : 4);
  }, 0);
  ASSERT_EQ(leaky, 0) << "LeakSanitizer found no leak where one was made (status " << leaky
                      << "): is detect_leaks off?";
  std::string failed;
  for (int k = 0; k < kOffsets; ++k) {
    const int status = status_of_child(child_with_tls_block_after, k);
    if (status != 0) failed += " " + std::to_string(k) + " (status " + std::to_string(status) + ")";
  }
  EXPECT_TRUE(failed.empty()) << "the leak check failed after these numbers of chunks:" << failed
                              << "; status 1 with \"Tracer caught signal 11\" above is the sanitizer's fault "
                                 "that ASAN_OPTIONS=intercept_tls_get_addr=0 avoids (Makefile: SANITIZE_ENV)";
#endif
}

}  // namespace
