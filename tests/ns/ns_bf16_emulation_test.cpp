// The emulated GPU bfloat16 Newton–Schulz (tests/support/ns_reference.hpp, Bf16Emulation) that dmuon_gpu_check
// compares the GPU's bf16 results with, and the error analysis behind dmuon_gpu_check's limits, on its very inputs:
//  - without rounding the emulation is the float64 recurrences;
//  - bf16 iterates are chaotic after a few steps: two correct implementations that differ only in their float32
//    accumulation order drift apart. Float against double accumulators (the extremes around cuBLAS's blocked
//    float32 order) agree within 2.5e-4 after 1 and 2 steps, where the rounding itself (what float32 iterates, a
//    missing rounding, would differ by) is above 2e-3 from float64: so after 1–2 steps a correct GPU is within
//    kSharpLimit = 1e-3 of the float-accumulating emulation, and a wrong kernel is not;
//  - after 5 steps the emulation is 1e-2 … 2.5e-2 from float64 (the old 1e-2 limit against float64 failed correct
//    code) and accumulation order alone moves it by up to 2.5e-2: a correct GPU is within kFiveStepLimit = 5e-2 of
//    float64 (a gross-error check; the sharp one is the 1–2 step comparison).
// The CPU backend's bf16 path (oneDNN, src/backend/cpu_bf16.hpp) has the same rounding points and is held to
// the same limits here, on the same inputs (skipped in a build without oneDNN).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "dmuon/backend.hpp"
#include "dmuon/ns.hpp"
#include "ns_reference.hpp"

namespace dmuon {
namespace {

using test::MatD;

// dmuon_gpu_check's bf16 cases (bench/gpu_check/gpu_check.cpp): shapes, inputs, DESIGN 2.2's half-precision restarts.
const std::vector<std::pair<int64_t, int64_t>> kShapes = {{96, 512}, {512, 96}, {256, 256}};
const std::vector<int> kRestarts = {1, 3};
constexpr double kSharpLimit = 1e-3;     // GPU against the emulation, 1 and 2 steps
constexpr double kFiveStepLimit = 5e-2;  // GPU against float64, 5 steps

template <typename Acc>
MatD emulate(const MatD& u, bool gram, int steps, bool round = true) {
  test::Bf16Emulation<Acc> e;
  e.round = round;
  const auto schedule = ns_schedule(NsCoeffs::keller, steps);
  return gram ? e.gram(u, schedule, 1.0, kRestarts) : e.standard(u, schedule, 1.0);
}

MatD float64(const MatD& u, bool gram, int steps) {
  const auto schedule = ns_schedule(NsCoeffs::keller, steps);
  return gram ? test::gram_ns_reference(u, schedule, 1.0, kRestarts) : test::standard_ns_reference(u, schedule, 1.0);
}

TEST(Bf16Emulation, WithoutRoundingIsTheFloat64Recurrence) {
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{24, 80}, {80, 24}, {40, 40}}) {
    const MatD u = test::gaussian(rows, cols, 5 + rows);
    for (const bool gram : {false, true})
      EXPECT_LT(test::relative_distance(emulate<double>(u, gram, 5, false), float64(u, gram, 5)), 1e-12)
          << rows << "x" << cols << (gram ? " gram" : " standard");
  }
}

TEST(Bf16Emulation, SupportsTheGpuChecksLimits) {
  for (const auto& [rows, cols] : kShapes) {
    const MatD u = test::gaussian(rows, cols, 50 + rows);  // dmuon_gpu_check's input
    for (const bool gram : {false, true}) {
      for (const int steps : {1, 2, 5}) {
        const MatD gpu_like = emulate<float>(u, gram, steps);
        const double rounding = test::relative_distance(gpu_like, float64(u, gram, steps));
        const double order = test::relative_distance(gpu_like, emulate<double>(u, gram, steps));
        std::printf("%lldx%lld %s, %d step(s): emulated bf16 vs float64 %.3e, float vs double accumulation %.3e\n",
                    static_cast<long long>(rows), static_cast<long long>(cols), gram ? "gram" : "standard", steps,
                    rounding, order);
        const std::string what = std::to_string(rows) + "x" + std::to_string(cols) + (gram ? " gram " : " standard ") +
                                 std::to_string(steps) + " steps";
        if (steps <= 2) {
          EXPECT_LT(order, kSharpLimit / 4) << what;
          EXPECT_GT(rounding, 2 * kSharpLimit) << what;
        } else {
          EXPECT_GT(rounding, 1e-2) << what;
          EXPECT_LT(rounding + order, kFiveStepLimit) << what;
        }
      }
    }
  }
}

// newton_schulz_batched on the CPU backend with bf16 iterates (NsOptions::dtype = bf16), U given in float32.
MatD cpu_ns(const MatD& u, bool gram, int steps, DType dtype) {
  NsOptions options;
  options.algo = gram ? NsAlgo::gram : NsAlgo::standard;
  options.steps = steps;
  options.restarts = kRestarts;
  options.dtype = dtype;
  std::vector<float> in = test::to_floats(u), out(in.size());
  Backend& cpu = cpu_backend();
  const MatView iv = f32_view(DeviceKind::cpu, in.data(), u.rows, u.cols), ov = f32_view(DeviceKind::cpu, out.data(), u.rows, u.cols);
  newton_schulz_batched(cpu, std::span(&iv, 1), std::span(&ov, 1), options);
  return test::from_floats(out.data(), u.rows, u.cols);
}

TEST(Bf16Emulation, CpuBackendInBf16IsHeldToTheGpuChecksLimits) {
  if (!cpu_backend().supports(DType::bf16)) GTEST_SKIP() << "this build's CPU backend computes in float32 only (no oneDNN)";
  for (const auto& [rows, cols] : kShapes) {
    const MatD u = test::gaussian(rows, cols, 50 + rows);
    for (const bool gram : {false, true}) {
      for (const int steps : {1, 2, 5}) {
        const std::string what = std::to_string(rows) + "x" + std::to_string(cols) + (gram ? " gram " : " standard ") +
                                 std::to_string(steps) + " steps";
        const MatD bf16 = cpu_ns(u, gram, steps, DType::bf16);
        if (steps <= 2) {
          EXPECT_LT(test::relative_distance(bf16, emulate<float>(u, gram, steps)), kSharpLimit) << what;
          // Not float32 iterates: those are as far from the emulation as float64 is (over 2e-3, above).
          EXPECT_GT(test::relative_distance(cpu_ns(u, gram, steps, DType::f32), bf16), 2 * kSharpLimit) << what;
        } else {
          EXPECT_LT(test::relative_distance(bf16, float64(u, gram, steps)), kFiveStepLimit) << what;
        }
      }
    }
  }
}

}  // namespace
}  // namespace dmuon
