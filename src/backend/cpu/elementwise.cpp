// Elementwise helpers over contiguous host arrays (see linalg.hpp).
#include <algorithm>
#include <cmath>

#include "dmuon/linalg.hpp"

namespace dmuon::linalg {

void transpose(int64_t rows, int64_t cols, const float* in, float* out) {
  constexpr int64_t kBlock = 32;
  for (int64_t i0 = 0; i0 < rows; i0 += kBlock) {
    for (int64_t j0 = 0; j0 < cols; j0 += kBlock) {
      const int64_t i1 = std::min(i0 + kBlock, rows), j1 = std::min(j0 + kBlock, cols);
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = j0; j < j1; ++j) out[j * rows + i] = in[i * cols + j];
      }
    }
  }
}

double norm2(int64_t n, const float* x) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  return std::sqrt(sum);
}

void scale(int64_t n, float alpha, float* x) {
  for (int64_t i = 0; i < n; ++i) x[i] *= alpha;
}

void add_identity(int64_t m, float alpha, float* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) c[i * ldc + i] += alpha;
}

}  // namespace dmuon::linalg
