// NorMuonNormalize on the CUDA backend: the rows' Σ O² by backend/cuda/device_view.cuh's double reduction (one row a
// matrix), then one thread walks the rows in order (moments, norms, the ratio: the host loop's order, so v and the
// ratio follow the same arithmetic), then a grid-stride kernel scales every element. Scratch: rows + 1 doubles.
#include <cuda_runtime_api.h>

#include "backend/cuda/device_view.cuh"
#include "backend/rules/launch.hpp"
#include "backend/rules/normuon_normalize.hpp"

namespace dmuon::rules {

namespace {

struct RowLoad {
  const float* o;
  int64_t cols;
  __device__ double operator()(int64_t r, int64_t j) const { return o[r * cols + j]; }
};

// v ← the new moments; scratch[rows] ← the ratio (scratch[0..rows): the row sums).
__global__ void normuon_rows_kernel(double* scratch, float* v, int64_t rows, int64_t cols, float one_minus_beta2) {
  double o_sq = 0, y_sq = 0;
  for (int64_t r = 0; r < rows; ++r) {
    v[r] = normuon_moment(v[r], scratch[r], cols, one_minus_beta2);
    normuon_add_row(scratch[r], normuon_divisor(v[r]), o_sq, y_sq);
  }
  scratch[rows] = normuon_ratio(o_sq, y_sq);
}

__global__ void normuon_scale_kernel(float* o, const float* v, const double* ratio, int64_t n, int64_t cols) {
  const float k = static_cast<float>(*ratio);
  DMUON_FOR_EACH(i, n) normuon_scale_at(i, o, normuon_divisor(v[i / cols]), k);
}

}  // namespace

template <>
void run_on_cuda(const NorMuonNormalize& rule, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(rule.o.size());
  if (n == 0) return;
  double* scratch = nullptr;
  DMUON_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&scratch), sizeof(double) * (rule.rows + 1), stream));
  cuda::sums_of_squares(RowLoad{rule.o.data(), rule.cols}, rule.cols, rule.rows, false, scratch, stream);
  normuon_rows_kernel<<<1, 1, 0, stream>>>(scratch, rule.v.data(), rule.rows, rule.cols, rule.one_minus_beta2);
  cuda::check_launch();
  normuon_scale_kernel<<<cuda::grid_for(n), cuda::kThreads, 0, stream>>>(rule.o.data(), rule.v.data(),
                                                                          scratch + rule.rows, n, rule.cols);
  cuda::check_launch();
  DMUON_CUDA_CHECK(cudaFreeAsync(scratch, stream));
}

}  // namespace dmuon::rules
