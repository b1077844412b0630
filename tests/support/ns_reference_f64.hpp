// A slow, obvious float64 Newton–Schulz (DESIGN 2.1, Keller coefficients) for tests of the optimizers:
// plain loops, no BLAS, no tricks. Header-only so any test can include it.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dmuon/optim.hpp"

namespace dmuon::test {

// o = orth(u) for a rows×cols row-major matrix, computed in double and rounded to float at the end.
inline void newton_schulz_f64(const float* u, float* o, int64_t rows, int64_t cols, int steps = 5) {
  const bool transpose = rows > cols;
  const int64_t m = transpose ? cols : rows, n = transpose ? rows : cols;  // X is m×n, m ≤ n
  std::vector<double> x(m * n);
  double norm = 0;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      const double v = u[i * cols + j];
      (transpose ? x[j * n + i] : x[i * n + j]) = v;
      norm += v * v;
    }
  }
  const double denom = std::sqrt(norm) + 1e-7;
  for (double& v : x) v /= denom;
  const double a = 3.4445, b = -4.7750, c = 2.0315;
  std::vector<double> A(m * m), B(m * m), next(m * n);
  for (int t = 0; t < steps; ++t) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j) {
        double s = 0;
        for (int64_t k = 0; k < n; ++k) s += x[i * n + k] * x[j * n + k];
        A[i * m + j] = s;
      }
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j) {
        double s = 0;
        for (int64_t k = 0; k < m; ++k) s += A[i * m + k] * A[k * m + j];
        B[i * m + j] = b * A[i * m + j] + c * s;
      }
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (int64_t k = 0; k < m; ++k) s += B[i * m + k] * x[k * n + j];
        next[i * n + j] = a * x[i * n + j] + s;
      }
    x.swap(next);
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) o[i * cols + j] = static_cast<float>(transpose ? x[j * n + i] : x[i * n + j]);
}

// The reference as an Orthogonalizer, for optimizers under test.
inline Orthogonalizer reference_orthogonalizer() {
  return [](std::span<const float* const> u, std::span<float* const> o, int64_t rows, int64_t cols,
            std::span<const std::string>) {
    for (size_t i = 0; i < u.size(); ++i) newton_schulz_f64(u[i], o[i], rows, cols);
  };
}

}  // namespace dmuon::test
