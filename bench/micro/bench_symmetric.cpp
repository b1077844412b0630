// Symmetric products against a full gemm of the same m×m result (DESIGN 2.3): SYRK + mirror for
// A·Aᵀ, and the upper-block-triangle product for several tile counts. Every case reports
// "full_gflops": the full product's flops (2·m²·k) over the time, so a value above the gemm row is a
// speed-up. The tile count where the triangle product stops paying is what the autotuner looks for.
//   ./build/bench/bench_symmetric --benchmark_filter=896
#include <benchmark/benchmark.h>

#include <vector>

#include "dmuon/linalg.hpp"

namespace {

void set_full_gflops(benchmark::State& state, int64_t m, int64_t k) {
  state.counters["full_gflops"] =
      benchmark::Counter(2.0 * m * m * k * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}

// C(m×m) = A·Aᵀ with A m×k, as a plain gemm.
void BM_GemmAAt(benchmark::State& state) {
  const int64_t m = state.range(0), k = state.range(1);
  std::vector<float> a(m * k, 0.01f), c(m * m);
  for (auto _ : state) dmuon::linalg::gemm(false, true, m, m, k, 1.0f, a.data(), k, a.data(), k, 0.0f, c.data(), m);
  set_full_gflops(state, m, k);
}

void BM_SyrkAAt(benchmark::State& state) {
  const int64_t m = state.range(0), k = state.range(1);
  std::vector<float> a(m * k, 0.01f), c(m * m);
  for (auto _ : state) dmuon::linalg::syrk(m, k, 1.0f, a.data(), k, 0.0f, c.data(), m);
  set_full_gflops(state, m, k);
}

// C(m×m) = A·B of two m×m factors; tiles 0 means a plain gemm.
void BM_TriangleProduct(benchmark::State& state) {
  const int64_t m = state.range(0);
  const int tiles = static_cast<int>(state.range(1));
  std::vector<float> a(m * m, 0.01f), b(m * m, 0.02f), c(m * m);
  for (auto _ : state) {
    if (tiles == 0) {
      dmuon::linalg::gemm(false, false, m, m, m, 1.0f, a.data(), m, b.data(), m, 0.0f, c.data(), m);
    } else {
      dmuon::linalg::symmetric_gemm(m, m, 1.0f, a.data(), m, b.data(), m, 0.0f, c.data(), m, tiles);
    }
  }
  set_full_gflops(state, m, m);
}

void gram_shapes(benchmark::internal::Benchmark* b) {
  for (int64_t m : {128, 256, 512, 896, 2048}) {
    b->Args({m, m});
    b->Args({m, 4 * m});
  }
}

void tile_counts(benchmark::internal::Benchmark* b) {
  for (int64_t m : {128, 256, 512, 896, 2048}) {
    for (int64_t tiles : {0, 2, 4, 8, 12, 16}) b->Args({m, tiles});
  }
}

BENCHMARK(BM_GemmAAt)->Apply(gram_shapes)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_SyrkAAt)->Apply(gram_shapes)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_TriangleProduct)->Apply(tile_counts)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
