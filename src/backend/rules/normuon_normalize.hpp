// NorMuonNormalize's arithmetic (dmuon/update_rules.hpp): each row's new second moment, its divisor √v + 1e-8, the
// two squared norms ‖O‖² and ‖Ô‖² (Σ_j Ô_rj² = Σ_j O_rj² / d_r², so Ô is never stored), the ratio that restores O's
// norm, and the element O_rj / d_r · ratio. Row sums and norms are doubles, summed in row order. For the CPU loop,
// the CUDA kernels and dmuon_gpu_check's host reference.
#pragma once

#include <cstdint>

#include "backend/rules/arithmetic.hpp"

namespace dmuon::rules {

constexpr float kNorMuonEps = 1e-8f;  // microsoft/dion's normuon.py and dmuon.torch's

// v_r ← lerp(v_r, mean_j O_rj², 1−β2) for a row whose Σ_j O_rj² is row_sum.
DMUON_HOST_DEVICE inline float normuon_moment(float v, double row_sum, int64_t cols, float one_minus_beta2) {
  const float mean = static_cast<float>(row_sum / static_cast<double>(cols));
  return lerp(v, mean, one_minus_beta2);
}

DMUON_HOST_DEVICE inline float normuon_divisor(float v) { return add(sqrt_rn(v), kNorMuonEps); }

// Adds a row (its Σ_j O_rj² and divisor d) to ‖O‖² and ‖Ô‖²; each operation rounded on its own, never an FMA.
DMUON_HOST_DEVICE inline void normuon_add_row(double row_sum, float divisor, double& o_sq, double& y_sq) {
  const double d = divisor;
  const double d_sq = d * d;
  const double y_row = row_sum / d_sq;
  o_sq = o_sq + row_sum;
  y_sq = y_sq + y_row;
}

// ‖O‖_F / max(‖Ô‖_F, 1e-8), rounded to float.
DMUON_HOST_DEVICE inline float normuon_ratio(double o_sq, double y_sq) {
  const double y = sqrt_rn(y_sq);
  return static_cast<float>(sqrt_rn(o_sq) / (y > 1e-8 ? y : 1e-8));
}

DMUON_HOST_DEVICE inline void normuon_scale_at(int64_t i, float* o, float divisor, float ratio) {
  o[i] = mul(div(o[i], divisor), ratio);
}

// The whole rule on host memory: the rows in order (sums, moments, norms), then every element.
inline void normuon_normalize_loop(float* o, float* v, int64_t rows, int64_t cols, float one_minus_beta2) {
  double o_sq = 0, y_sq = 0;
  for (int64_t r = 0; r < rows; ++r) {
    double row_sum = 0;
    for (int64_t j = 0; j < cols; ++j) {
      const double x = o[r * cols + j];
      row_sum = row_sum + x * x;  // the host build never contracts (-ffp-contract=off)
    }
    v[r] = normuon_moment(v[r], row_sum, cols, one_minus_beta2);
    normuon_add_row(row_sum, normuon_divisor(v[r]), o_sq, y_sq);
  }
  const float ratio = normuon_ratio(o_sq, y_sq);
  for (int64_t r = 0; r < rows; ++r) {
    const float d = normuon_divisor(v[r]);
    for (int64_t j = 0; j < cols; ++j) normuon_scale_at(r * cols + j, o, d, ratio);
  }
}

}  // namespace dmuon::rules
