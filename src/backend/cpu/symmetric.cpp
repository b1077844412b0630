// Symmetric products (DESIGN 2.3): SYRK for A·Aᵀ and upper-block-triangle gemm for products of commuting
// symmetric factors, each followed by a mirror so callers always see the full matrix.
#include <cblas.h>

#include <algorithm>

#include "backend/cpu/upper_block_rows.hpp"
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
  cpu_detail::upper_block_rows(m, k, alpha, a, lda, b, ldb, beta, c, ldc, tiles, gemm, mirror_upper);
}

}  // namespace dmuon::linalg
