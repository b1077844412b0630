// Symmetric products (DESIGN 2.3): SYRK for A·Aᵀ and upper-block-triangle gemm for products of commuting
// symmetric factors, each followed by a mirror so callers always see the full matrix.
#include <cblas.h>

#include <algorithm>

#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"

namespace dmuon::linalg {

void mirror_upper(int64_t m, float* c, int64_t ldc) {
  // Blocked so that both the rows read and the columns written stay in cache.
  constexpr int64_t kBlock = 32;
  for (int64_t i0 = 0; i0 < m; i0 += kBlock) {
    for (int64_t j0 = i0; j0 < m; j0 += kBlock) {
      const int64_t i1 = std::min(i0 + kBlock, m), j1 = std::min(j0 + kBlock, m);
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = std::max(j0, i + 1); j < j1; ++j) c[j * ldc + i] = c[i * ldc + j];
      }
    }
  }
}

namespace {
void syrk_upper(CBLAS_TRANSPOSE trans, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, float beta,
                float* c, int64_t ldc) {
  if (n == 0) return;
  cblas_ssyrk(CblasRowMajor, CblasUpper, trans, static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), beta, c, static_cast<blasint>(ldc));
  mirror_upper(n, c, ldc);
}
}  // namespace

void syrk(int64_t n, int64_t k, float alpha, const float* a, int64_t lda, float beta, float* c, int64_t ldc) {
  syrk_upper(CblasNoTrans, n, k, alpha, a, lda, beta, c, ldc);
}

void syrk_transposed(int64_t n, int64_t k, float alpha, const float* a, int64_t lda, float beta, float* c,
                     int64_t ldc) {
  syrk_upper(CblasTrans, n, k, alpha, a, lda, beta, c, ldc);
}

void symmetric_gemm(int64_t m, int64_t k, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                    float beta, float* c, int64_t ldc, int tiles) {
  DMUON_CHECK(tiles >= 1, "symmetric_gemm: tile count must be at least 1, got ", tiles);
  if (m == 0) return;
  const int64_t t = std::min<int64_t>(tiles, m);
  // Block row i covers rows [lo, hi) and computes columns [lo, m): the diagonal tile and every tile right of
  // it. Tile boundaries spread the remainder so no tile is more than one row bigger.
  for (int64_t i = 0; i < t; ++i) {
    const int64_t lo = m * i / t, hi = m * (i + 1) / t;
    gemm(false, false, hi - lo, m - lo, k, alpha, a + lo * lda, lda, b + lo, ldb, beta, c + lo * ldc + lo, ldc);
  }
  mirror_upper(m, c, ldc);
}

}  // namespace dmuon::linalg
