// dmuon_gpu_check's CheckLog (bench/gpu_check/check_log.hpp), which the GPU-only check has no other test of here:
// an exception in one guarded check fails that check alone, and the checks after it still run and count; a verdict
// written is out of the process at once, even when the process dies before stdio flushes.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "dmuon/error.hpp"
#include "gpu_check/check_log.hpp"

namespace dmuon {
namespace {

TEST(CheckLog, AThrowingCheckFailsAloneAndTheNextStillRuns) {
  CheckLog log;
  bool later_ran = false;
  testing::internal::CaptureStdout();
  log.guard("first", [] { throw Error("cuBLAS: cublasGemmEx failed"); });
  log.guard("second", [&] {
    later_ran = true;
    log.report(true, "second", 1e-5, 1e-4);
  });
  log.guard("third", [&] { log.expect(false, "third"); });
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_TRUE(later_ran);
  EXPECT_EQ(log.failures(), 2);
  EXPECT_NE(out.find("FAIL first threw: cuBLAS: cublasGemmEx failed"), std::string::npos) << out;
  EXPECT_NE(out.find("ok   second"), std::string::npos) << out;
}

// A child whose standard output is a pipe, fully buffered as stdout into a file or pipe is, writes three verdicts and
// dies without flushing (as a kill, a crash or std::_Exit would): every line still reaches the reader.
TEST(CheckLog, EveryLineLeavesTheProcessBeforeItDies) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  std::fflush(stdout);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(fds[0]);
    dup2(fds[1], STDOUT_FILENO);
    std::setvbuf(stdout, nullptr, _IOFBF, 1 << 16);
    CheckLog log;
    log.report(false, "gemm bf16 A B", 1.0, 1e-3);
    log.expect(true, "graph replayed");
    log.note("then the process dies");
    std::_Exit(3);
  }
  close(fds[1]);
  std::string out;
  char buffer[256];
  for (ssize_t n; (n = read(fds[0], buffer, sizeof buffer)) > 0;) out.append(buffer, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3);
  EXPECT_NE(out.find("FAIL gemm bf16 A B"), std::string::npos) << out;
  EXPECT_NE(out.find("ok   graph replayed"), std::string::npos) << out;
  EXPECT_NE(out.find("note then the process dies"), std::string::npos) << out;
}

}  // namespace
}  // namespace dmuon
