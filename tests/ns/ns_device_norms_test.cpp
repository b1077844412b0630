// Newton–Schulz with its norms left in device memory (newton_schulz_batched's `norms`), the path `bench ns`, `bench
// muon` and dmuon.torch take, on the fenced test device: the whole chunk, norms included, is one recording, so a
// second call over the same addresses with new inputs replays it and must recompute the norms inside the replay (a
// recording that kept the first inputs' norms would scale the new ones wrongly). Each call equals the CPU's bit for
// bit, and the norms left are the inputs' Frobenius norms as the CPU backend computes them. dmuon_gpu_check test
// runs the same on a GPU (its graph memory nodes: the reduction's cudaMallocAsync inside the capture).
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <random>
#include <vector>

#include "dmuon/backend.hpp"
#include "dmuon/ns.hpp"
#include "fenced_device.hpp"

namespace dmuon {
namespace {

std::vector<float> gaussian(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = normal(rng);
  return v;
}

std::vector<MatView> stack_views(void* data, DeviceKind device, int64_t k, int64_t rows, int64_t cols) {
  std::vector<MatView> views;
  for (int64_t i = 0; i < k; ++i)
    views.push_back({static_cast<float*>(data) + i * rows * cols, device, DType::f32, rows, cols, cols, 1, rows * cols});
  return views;
}

TEST(NsDeviceNorms, ReplayedOverNewInputsRecomputesTheNormsAndEqualsTheCpu) {
  test::FencedBackend fenced;
  const int64_t k = 3, rows = 24, cols = 40, size = rows * cols;
  for (NsAlgo algo : {NsAlgo::standard, NsAlgo::gram}) {
    NsOptions options;
    options.algo = algo;
    Buffer stack(fenced, DType::f32, k * size), norms(fenced, DType::f32, 2 * k);  // k doubles
    const std::vector<MatView> views = stack_views(stack.data(), fenced.device(), k, rows, cols);
    int64_t recorded = 0, replayed = 0;
    for (int call = 0; call < 2; ++call) {
      const std::vector<float> input = gaussian(k * size, 40 + call);
      stack.upload(input);
      newton_schulz_batched(fenced, views, views, options, {}, reinterpret_cast<double*>(norms.data()));
      if (call == 0) {
        recorded = fenced.graphs_recorded();
        replayed = fenced.graphs_replayed();
        EXPECT_GT(recorded, 0);
      } else {
        EXPECT_EQ(fenced.graphs_recorded(), recorded) << "the second call recorded again: nothing was replayed";
        EXPECT_GT(fenced.graphs_replayed(), replayed);
      }
      std::vector<float> cpu = input, got(input.size()), norm_slots(2 * k);
      const std::vector<MatView> cpu_views = stack_views(cpu.data(), DeviceKind::cpu, k, rows, cols);
      newton_schulz_batched(cpu_backend(), cpu_views, cpu_views, options);
      stack.download(got);
      EXPECT_EQ(std::memcmp(got.data(), cpu.data(), got.size() * sizeof(float)), 0)
          << to_string(algo) << " call " << call;
      norms.download(norm_slots);
      for (int64_t i = 0; i < k; ++i) {
        std::vector<float> matrix(input.begin() + i * size, input.begin() + (i + 1) * size);
        double want = 0, got_norm = 0;
        cpu_backend().frobenius_norms(stack_views(matrix.data(), DeviceKind::cpu, 1, rows, cols)[0], &want);
        std::memcpy(&got_norm, norm_slots.data() + 2 * i, sizeof got_norm);
        EXPECT_EQ(std::bit_cast<uint64_t>(got_norm), std::bit_cast<uint64_t>(want))
            << to_string(algo) << " call " << call << " matrix " << i;
      }
    }
  }
}

}  // namespace
}  // namespace dmuon
