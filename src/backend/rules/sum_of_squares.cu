// SumOfSquares on the CUDA backend: the double tree reduction of backend/cuda/device_view.cuh over the rounded
// terms of sum_of_squares.hpp, into *sum on the device (0 for no values).
#include <cuda_runtime_api.h>

#include "backend/cuda/device_view.cuh"
#include "backend/rules/launch.hpp"
#include "backend/rules/sum_of_squares.hpp"

namespace dmuon::rules {

namespace {

struct ScaledGradLoad {
  const float* grad;
  float grad_scale;
  __device__ double operator()(int64_t, int64_t i) const { return scaled_grad(grad, grad_scale, i); }
};

}  // namespace

template <>
void run_on_cuda(const SumOfSquares& rule, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(rule.grad.size());
  if (n == 0) {
    DMUON_CUDA_CHECK(cudaMemsetAsync(rule.sum, 0, sizeof(double), stream));
    return;
  }
  cuda::sums_of_squares(ScaledGradLoad{rule.grad.data(), rule.grad_scale}, n, 1, false, rule.sum, stream);
}

}  // namespace dmuon::rules
