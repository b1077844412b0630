// The upper-block-triangle product of the CPU's symmetric products (DESIGN 2.3), in float32 (symmetric.cpp, on
// OpenBLAS) and in bf16 (bf16_symmetric.cpp, on oneDNN): one template, the element type's gemm and mirror given.
#pragma once

#include <algorithm>
#include <cstdint>

#include "dmuon/error.hpp"

namespace dmuon::cpu_detail {

// C(m×m) = alpha·A·B + beta·C for A m×k, B k×m with a symmetric product: block row i of a tiles×tiles grid covers
// rows [lo, hi) and computes columns [lo, m) (the diagonal tile and every tile right of it), then the lower triangle
// is mirrored. Tile boundaries spread the remainder so no tile is more than one row bigger. tiles ≥ 1.
template <typename T, typename Gemm, typename Mirror>
void upper_block_rows(int64_t m, int64_t k, float alpha, const T* a, int64_t lda, const T* b, int64_t ldb, float beta,
                      T* c, int64_t ldc, int tiles, Gemm gemm, Mirror mirror) {
  DMUON_CHECK(tiles >= 1, "symmetric_gemm: tile count must be at least 1, got ", tiles);
  if (m == 0) return;
  const int64_t t = std::min<int64_t>(tiles, m);
  for (int64_t i = 0; i < t; ++i) {
    const int64_t lo = m * i / t, hi = m * (i + 1) / t;
    gemm(false, false, hi - lo, m - lo, k, alpha, a + lo * lda, lda, b + lo, ldb, beta, c + lo * ldc + lo, ldc);
  }
  mirror(m, c, ldc);
}

}  // namespace dmuon::cpu_detail
