// SumOfSquares's arithmetic (dmuon/update_rules.hpp): the term g_i·scale, rounded to float and widened to double,
// shared by the CPU's sum (four partial sums, below; also dmuon_gpu_check's host reference) and the CUDA backend's
// fixed-order tree reduction (sum_of_squares.cu, backend/cuda/device_view.cuh's sums_of_squares).
#pragma once

#include <cstdint>

#include "backend/rules/arithmetic.hpp"

namespace dmuon::rules {

DMUON_HOST_DEVICE inline double scaled_grad(const float* grad, float grad_scale, int64_t i) {
  return static_cast<double>(mul(grad[i], grad_scale));
}

// Σ (g_i·scale)² in double; four partial sums break the add latency chain (the order differs from a plain loop by
// rounding in the last bits of a double, far below what float32 clipping can see).
inline double sum_of_squares_loop(const float* grad, int64_t n, float grad_scale) {
  double acc[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int k = 0; k < 4; ++k) {
      const double x = scaled_grad(grad, grad_scale, i + k);
      acc[k] += x * x;
    }
  }
  for (; i < n; ++i) {
    const double x = scaled_grad(grad, grad_scale, i);
    acc[0] += x * x;
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

}  // namespace dmuon::rules
