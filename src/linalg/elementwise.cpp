// Elementwise helpers over contiguous host arrays (see linalg.hpp).
#include <cmath>

#include "dmuon/linalg.hpp"

namespace dmuon::linalg {

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
