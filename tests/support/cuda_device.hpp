// The GPU tests' way to a CUDA backend: device 0's, or the reason this build or machine has none (the test then
// skips with it: GTEST_SKIP() << why), and the fixture that does so for every test of a suite.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "dmuon/backend.hpp"

namespace dmuon::test {

inline Backend* cuda_backend_or_null(std::string* why) {
#ifndef DMUON_HAVE_CUDA
  *why = "this build has no CUDA backend (DMUON_CUDA=OFF or no CUDA toolkit)";
  return nullptr;
#else
  if (device_count(DeviceKind::cuda) == 0) {
    *why = "no CUDA device on this machine (cudaGetDeviceCount)";
    return nullptr;
  }
  return &backend_for(DeviceKind::cuda, 0);
#endif
}

// A test on device 0's CUDA backend (`gpu`), compared with the CPU backend (`cpu`); skipped, with the reason, where
// this build or machine has no CUDA device.
class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    gpu = cuda_backend_or_null(&why);
    if (gpu == nullptr) GTEST_SKIP() << why;
  }
  Backend* gpu = nullptr;
  Backend& cpu = cpu_backend();
};

}  // namespace dmuon::test
