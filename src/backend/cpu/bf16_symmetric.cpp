// cpu_bf16.hpp's symmetric products: block rows over the upper triangle of the general bf16 product, then a
// mirror, so the result is exactly symmetric (as the CUDA backend's tiled SYRK and symmetric products in bf16).
#include <algorithm>

#include "backend/cpu/upper_block_rows.hpp"
#include "backend/cpu_bf16.hpp"

namespace dmuon::cpu_bf16 {

namespace {
// The tiles of the upper triangle of a bf16 SYRK: block rows of at least 128 rows, at most 8. Fewer compute more of
// the lower triangle that the mirror overwrites (1 tile: the whole product, twice a triangle's flops), more are
// smaller products that run further below oneDNN's peak. CPU time of n×n = A·Aᵀ on oneDNN 2.6.3's AVX-512 BF16
// kernels, one thread of an AMD EPYC (issue 61), for 1 / 2 / 4 / 7 / 8 tiles: n = 896, k = 4864: 19.9 / 14.4 / 12.6 /
// 12.3 / 12.7 ms; n = k = 896: 3.35 / 3.02 / 2.31 / 2.20 / 2.10 ms; n = 128, k = 896: 1 or 2 tiles fastest. (The CUDA
// backend's rule, n/512, gave the 896-row products 1 tile.)
int syrk_tiles(int64_t n) { return static_cast<int>(std::clamp<int64_t>(n / 128, 1, 8)); }
}  // namespace

void mirror_upper(int64_t m, uint16_t* c, int64_t ldc) {
  constexpr int64_t kBlock = 64;  // rows read and columns written stay in cache
  for (int64_t i0 = 0; i0 < m; i0 += kBlock) {
    for (int64_t j0 = i0; j0 < m; j0 += kBlock) {
      const int64_t i1 = std::min(i0 + kBlock, m), j1 = std::min(j0 + kBlock, m);
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = std::max(j0, i + 1); j < j1; ++j) c[j * ldc + i] = c[i * ldc + j];
      }
    }
  }
}

void syrk(bool trans, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda, float beta, uint16_t* c,
          int64_t ldc) {
  if (n == 0) return;
  const int64_t t = std::min<int64_t>(syrk_tiles(n), n);
  // Block row [lo, hi) of C, columns [lo, n): op(A)'s rows lo… times op(A)'s rows lo… transposed. Row r of op(A)
  // is row r of A (n×k), or column r of A (k×n) with trans.
  for (int64_t i = 0; i < t; ++i) {
    const int64_t lo = n * i / t, hi = n * (i + 1) / t;
    const uint16_t* rows_lo = trans ? a + lo : a + lo * lda;
    gemm(trans, !trans, hi - lo, n - lo, k, alpha, rows_lo, lda, rows_lo, lda, beta, c + lo * ldc + lo, ldc);
  }
  mirror_upper(n, c, ldc);
}

void symmetric_gemm(int64_t m, int64_t k, float alpha, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                    float beta, uint16_t* c, int64_t ldc, int tiles) {
  cpu_detail::upper_block_rows(m, k, alpha, a, lda, b, ldb, beta, c, ldc, tiles, gemm, mirror_upper);
}

}  // namespace dmuon::cpu_bf16
