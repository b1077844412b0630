// Accumulate's element (dmuon/update_rules.hpp), for the CPU loop, the CUDA kernel and dmuon_gpu_check's host
// reference.
#pragma once

#include <cstdint>

#include "backend/rules/arithmetic.hpp"

namespace dmuon::rules {

DMUON_HOST_DEVICE inline void accumulate_at(int64_t i, float* acc, const float* grad, bool first) {
  acc[i] = add(first ? 0.0f : acc[i], grad[i]);
}

inline void accumulate_loop(float* acc, const float* grad, int64_t n, bool first) {
  for (int64_t i = 0; i < n; ++i) accumulate_at(i, acc, grad, first);
}

}  // namespace dmuon::rules
