// Strided batches of float32 matrices in one host array with NaN everywhere outside the matrices, and the
// float32 error bound of a product, for the tests of the CUDA backend's products (cublas_calls_test runs their
// cuBLAS descriptors through CBLAS; cuda_backend_test runs them on a GPU).
#pragma once

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "dmuon/backend.hpp"

namespace dmuon::test {

// `count` rows×cols matrices with row stride ld and batch stride `stride` in one host array; everything outside
// the matrices is NaN.
struct Batch {
  int64_t rows, cols, ld, count, stride;
  std::vector<float> data;

  Batch(int64_t r, int64_t c, int64_t pad, int64_t n, uint32_t seed) : rows(r), cols(c), ld(c + pad), count(n) {
    stride = rows * ld + 5;
    data.assign(stride * count + 3, std::nanf(""));
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1, 1);
    for (int64_t b = 0; b < count; ++b)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) at(b, i, j) = u(rng);
  }
  float& at(int64_t b, int64_t i, int64_t j) { return data[b * stride + i * ld + j]; }
  float at(int64_t b, int64_t i, int64_t j) const { return data[b * stride + i * ld + j]; }
  float* matrix(int64_t b) { return data.data() + b * stride; }
  MatView view() { return MatView{data.data(), DeviceKind::cpu, DType::f32, rows, cols, ld, count, stride}; }
  // Makes every matrix symmetric (square batches only): the lower triangle copied from the upper.
  void symmetrise() {
    for (int64_t b = 0; b < count; ++b)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < i; ++j) at(b, i, j) = at(b, j, i);
  }
};

// Every element of `got` within (k + 2)·u·(|alpha|·Σ|a||b| + |beta|·|c0|) of `want` on both sides, i.e. twice
// the float32 bound of a length-k dot product (each result is within one bound of the exact value); `bound`
// holds the bracket per element; a result stored in a narrower type adds store_u·|want| (its unit roundoff).
// Outside the matrices both must still be NaN.
inline void expect_close(const Batch& got, const Batch& want, const std::vector<double>& bound, int64_t k,
                         double store_u = 0) {
  const double u = FLT_EPSILON / 2;
  for (size_t i = 0; i < got.data.size(); ++i) {
    if (std::isnan(want.data[i])) {
      ASSERT_TRUE(std::isnan(got.data[i])) << "element " << i << " outside the matrices was written";
      continue;
    }
    const double tol = 2 * (k + 2) * u * bound[i] + store_u * std::abs(want.data[i]) + 1e-30;
    ASSERT_LE(std::abs(got.data[i] - want.data[i]), tol) << "at flat index " << i << ": " << got.data[i] << " vs "
                                                         << want.data[i];
  }
}

// The bracket of the error bound of C = alpha·op(A)·op(B) + beta·C0, per element of C's array.
inline std::vector<double> product_bound(const Batch& a, bool ta, const Batch& b, bool tb, float alpha, float beta,
                                         const Batch& c0) {
  std::vector<double> bound(c0.data.size(), 0.0);
  const int64_t k = ta ? a.rows : a.cols;
  for (int64_t s = 0; s < c0.count; ++s)
    for (int64_t i = 0; i < c0.rows; ++i)
      for (int64_t j = 0; j < c0.cols; ++j) {
        double sum = 0;
        for (int64_t l = 0; l < k; ++l) {
          const double x = ta ? a.at(s, l, i) : a.at(s, i, l);
          const double y = tb ? b.at(s, j, l) : b.at(s, l, j);
          sum += std::abs(x * y);
        }
        bound[s * c0.stride + i * c0.ld + j] = std::abs(alpha) * sum + std::abs(beta) * std::abs(c0.at(s, i, j));
      }
  return bound;
}

}  // namespace dmuon::test
