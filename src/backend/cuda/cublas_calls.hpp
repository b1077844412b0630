// Row-major requests as column-major cuBLAS calls (DESIGN 6), derived here and nowhere else.
//
// A row-major r×c matrix with row stride ld is, to a column-major BLAS, its c×r transpose with leading
// dimension ld. So row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: the operands swap, each keeps
// its transpose flag, and m and n swap. Row-major upper triangle = column-major lower triangle, so row-major
// X·Xᵀ (X n×k, ld k) is syrk(uplo = lower, trans = T, n, k, X, ld). Each backend operation becomes a list of
// BlasCall descriptors; the CUDA backend hands each to cuBLAS, and tests/backend/cublas_calls_test runs the very same
// descriptors through CBLAS in column-major order on the CPU against the CPU backend's row-major results.
//
// The upper-triangle tiling of DESIGN 2.3 as strided-batched products: with T tiles of b = ⌊m/T⌋ rows, the tiles
// (i, i+d) of one diagonal d are equally spaced in A, B and C, so one strided-batched gemm computes a whole
// diagonal (T calls for one matrix). For a batch of matrices each tile is one call batched over the matrices
// (T(T+1)/2 calls). The m − T·b leftover columns are one more product of all rows (the part below the diagonal
// is overwritten by the mirror). Callers mirror the upper triangle afterwards (syrk and tiled products).
#pragma once

#include <cstdint>
#include <vector>

#include "dmuon/backend.hpp"

namespace dmuon::cuda {

// Which view of the backend request a column-major operand reads.
enum class Source { a, b };

struct BlasCall {
  enum class Kind { gemm, syrk };
  Kind kind = Kind::gemm;
  // gemm: C(m×n) = alpha·op(A)·op(B) + beta·C, op(A) m×k, op(B) k×n, all column-major.
  // syrk: C(n×n) = alpha·op(A)·op(A)ᵀ + beta·C on the `lower` (else upper) triangle; trans_a: op(A) = Aᵀ (A k×n).
  bool trans_a = false, trans_b = false;
  bool lower = true;
  int64_t m = 0, n = 0, k = 0;
  float alpha = 1, beta = 0;
  Source a_source = Source::a, b_source = Source::b;
  // Offsets (elements) from the start of the source view's data; C is the request's output view.
  int64_t a_offset = 0, b_offset = 0, c_offset = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  // Strided batch: `batch` products, operand i at offset + i·stride.
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  DType ab_type = DType::f32, c_type = DType::f32;
};

// How syrk is computed: a native SYRK (cuBLAS has it for float32 only, one matrix per call) or the tiled
// upper-triangle product with `tiles` tiles per side.
struct SyrkMethod {
  bool native = true;
  int tiles = 1;
};

// C = alpha·op(A)·op(B) + beta·C (Backend::gemm). Shapes and dtypes checked; one strided-batched call.
std::vector<BlasCall> gemm_calls(bool trans_a, bool trans_b, float alpha, const MatView& a, const MatView& b,
                                 float beta, const MatView& c);
// The upper triangle (and, for the leftover strip, more) of C = alpha·op(A)·op(A)ᵀ + beta·C (Backend::syrk).
std::vector<BlasCall> syrk_calls(bool trans, float alpha, const MatView& a, float beta, const MatView& c,
                                 SyrkMethod method);
// The upper tiles of C(m×m) = alpha·A·B + beta·C (Backend::symmetric_gemm), tiles ≥ 1.
std::vector<BlasCall> symmetric_gemm_calls(float alpha, const MatView& a, const MatView& b, float beta,
                                           const MatView& c, int tiles);

// The tile count of a tiled SYRK (bf16, or a batch) on an n×n result: tiles of about 512 rows, at most 8.
int syrk_tiles(int64_t n);

}  // namespace dmuon::cuda
