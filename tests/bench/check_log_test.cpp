// dmuon_gpu_check's CheckLog (bench/gpu_check/check_log.hpp), which the GPU-only check has no other test of here:
// an exception in one guarded check fails that check alone, and the checks after it still run and count.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace dmuon
