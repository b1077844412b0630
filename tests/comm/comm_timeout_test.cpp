// A rank that never arrives at a collective makes the others fail with the timeout error, and the
// job ends non-zero in bounded time. Spawns a child `mpirun -np 3` of the hidden test
// CommTimeoutChild.DISABLED_PeerNeverArrives in comm_mpi_test (built beside this executable):
// rank 1 sleeps instead of calling the all-reduce, ranks 0 and 2 wait with
// DMUON_COMM_TIMEOUT_S=3. Without the timeout they would block forever (OpenMPI's mpirun only
// tears a job down when a rank exits with an error, which the sleeping rank does not), so the
// test fails by hitting its own 90 s guard instead. The job must end after the 3 s timeout and long
// before the guard: the bound below is 10 timeouts, far above mpirun's start-up and tear-down on a
// loaded machine, and far below what a timeout read in the wrong unit or never armed would take.
// mpirun is the one CMake found (DMUON_MPIRUN, as every other test that starts a job).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>

namespace {

std::string self_dir() { return std::filesystem::read_symlink("/proc/self/exe").parent_path().string(); }

TEST(CommTimeout, PeerThatNeverArrivesFailsTheOthersWithinTheTimeout) {
  const std::string child = self_dir() + "/comm_mpi_test";
  ASSERT_TRUE(std::filesystem::exists(child)) << child << " is not built";
  const std::string cmd =
      "DMUON_COMM_TIMEOUT_S=3 timeout 90 " + std::string(DMUON_MPIRUN) + " -np 3 " + child +
      " --gtest_also_run_disabled_tests --gtest_filter=CommTimeoutChild.* 2>&1";
  const auto start = std::chrono::steady_clock::now();
  FILE* pipe = popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  std::array<char, 4096> buf;
  while (std::fgets(buf.data(), buf.size(), pipe) != nullptr) output += buf.data();
  const int status = pclose(pipe);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  ASSERT_TRUE(WIFEXITED(status)) << output;
  const int code = WEXITSTATUS(status);
  EXPECT_NE(code, 0) << output;
  EXPECT_NE(code, 124) << "the job hung until the 90 s guard: " << output;
  EXPECT_NE(output.find("rank 0: dmuon comm: timed out after 3 s waiting for all_reduce on rank 0 of 3"),
            std::string::npos)
      << output;
  EXPECT_GE(seconds, 3.0) << "the job ended before the 3 s timeout could fire: " << output;
  EXPECT_LT(seconds, 30.0) << "the job took " << seconds << " s to end after a 3 s timeout: " << output;
}

}  // namespace
