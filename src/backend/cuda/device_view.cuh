// What the kernels see of a MatView (a plain struct passed by value), element access for float32 and bfloat16
// storage (loads widen exactly, stores round to nearest even), launch sizes, and the deterministic
// sum-of-squares reduction shared by the Frobenius norms and the update rules' Σ g².
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "backend/cuda/tile_grid.hpp"
#include "backend/cuda_support.hpp"
#include "dmuon/backend.hpp"

namespace dmuon::cuda {

struct DeviceView {
  void* data;
  DType dtype;
  int64_t rows, cols, ld, count, stride;

  __device__ int64_t at(int64_t b, int64_t r, int64_t c) const { return b * stride + r * ld + c; }
  __device__ float load(int64_t i) const {
    return dtype == DType::f32 ? static_cast<const float*>(data)[i]
                               : __bfloat162float(static_cast<const __nv_bfloat16*>(data)[i]);
  }
  __device__ void store(int64_t i, float v) const {
    if (dtype == DType::f32)
      static_cast<float*>(data)[i] = v;
    else
      static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16_rn(v);
  }
};

inline DeviceView device_view(const MatView& v) {
  return {v.data, v.dtype, v.rows, v.cols, v.ld, v.count, v.batch_stride};
}

// kThreads, grid_for and check_launch: backend/cuda_support.hpp.

// partials[b·P + p] = Σ of load(b, i)² over the i ≡ p·kThreads + t (mod P·kThreads) of matrix b, tree-summed in
// the block: a fixed order, so the result is the same every run. Block row y takes matrices y, y + gridDim.y, …
template <typename Load>
__global__ void partial_sums_of_squares(Load load, int64_t per_matrix, int64_t count, double* partials) {
  __shared__ double sums[kThreads];
  for (int64_t b = blockIdx.y; b < count; b += gridDim.y) {
    double s = 0;
    for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < per_matrix;
         i += int64_t{gridDim.x} * kThreads) {
      const double x = load(b, i);
      s = __dadd_rn(s, __dmul_rn(x, x));  // rounded twice, never one FMA, so the partial sums are defined
    }
    sums[threadIdx.x] = s;
    __syncthreads();
    for (int half = kThreads / 2; half > 0; half /= 2) {
      if (threadIdx.x < half) sums[threadIdx.x] += sums[threadIdx.x + half];
      __syncthreads();
    }
    if (threadIdx.x == 0) partials[b * gridDim.x + blockIdx.x] = sums[0];
    __syncthreads();  // sums is written again for the next matrix
  }
}

// out[b] = Σ_p partials[b·P + p] (root: its square root), p in order. Static: each .cu file has its own copy
// (kernels cannot be launched across files without relocatable device code).
static __global__ void finish_sums(const double* partials, int parts, int64_t count, bool root, double* out) {
  for (int64_t b = blockIdx.x * int64_t{kThreads} + threadIdx.x; b < count; b += int64_t{gridDim.x} * kThreads) {
    double s = 0;
    for (int p = 0; p < parts; ++p) s += partials[b * parts + p];
    out[b] = root ? sqrt(s) : s;
  }
}

// Σ load(b, i)² for i < per_matrix, for each b < count, into out[b] (device doubles); root: the square root.
template <typename Load>
void sums_of_squares(Load load, int64_t per_matrix, int64_t count, bool root, double* out, cudaStream_t stream) {
  const ReductionGrid grid = reduction_grid(per_matrix, count, kThreads);
  const int parts = static_cast<int>(grid.parts);
  double* partials = nullptr;
  DMUON_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&partials), sizeof(double) * parts * count, stream));
  partial_sums_of_squares<<<dim3(grid.parts, grid.y), kThreads, 0, stream>>>(load, per_matrix, count, partials);
  check_launch();
  finish_sums<<<grid_for(count), kThreads, 0, stream>>>(partials, parts, count, root, out);
  check_launch();
  DMUON_CUDA_CHECK(cudaFreeAsync(partials, stream));
}

}  // namespace dmuon::cuda
