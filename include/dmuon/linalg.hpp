// The CPU backend's kernels (src/backend/cpu): dense linear algebra on host memory, row-major, over
// BLAS (OpenBLAS), and its thread control. The Newton–Schulz engine and the optimizers reach them only
// through the Backend interface (backend.hpp); host-only code (the CPU GPT example, benchmarks of the
// kernels themselves) calls them directly. Nothing outside src/backend/cpu includes cblas.
#pragma once

#include <cstdint>
#include <string>

namespace dmuon::linalg {

// C(m×n) = alpha·op(A)·op(B) + beta·C, with op(A) m×k and op(B) k×n; lda/ldb/ldc are row strides.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// C(n×n) = alpha·A·Aᵀ + beta·C with A n×k (SYRK), the full symmetric C: BLAS fills the upper
// triangle, the lower is mirrored from it. C must not overlap A.
void syrk(int64_t n, int64_t k, float alpha, const float* a, int64_t lda, float beta, float* c, int64_t ldc);
// The same for A stored transposed: C(n×n) = alpha·Aᵀ·A + beta·C with A k×n.
void syrk_transposed(int64_t n, int64_t k, float alpha, const float* a, int64_t lda, float beta, float* c,
                     int64_t ldc);

// C(m×m) = alpha·A·B + beta·C with A m×k, B k×m, for factors whose product is known to be
// symmetric (e.g. commuting symmetric matrices, DESIGN 2.3): only the tiles on and above the
// diagonal of a tiles×tiles grid are computed (one gemm per block row), then the lower triangle is
// mirrored from the upper. beta·C must be symmetric too. Saves (tiles−1)/(2·tiles) of the flops.
// tiles ≥ 1; tiles = 1 is one full gemm (then mirror). C must not overlap A or B.
void symmetric_gemm(int64_t m, int64_t k, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
                    float beta, float* c, int64_t ldc, int tiles);

// Copies the upper triangle of the m×m matrix C onto its lower triangle.
void mirror_upper(int64_t m, float* c, int64_t ldc);

// Elementwise helpers on contiguous host arrays, kept here so a GPU backend replaces them with the
// BLAS calls above.
// out(cols×rows) = in(rows×cols)ᵀ; out must not overlap in.
void transpose(int64_t rows, int64_t cols, const float* in, float* out);
// ‖x‖₂ of n values, accumulated in double; NaN or Inf when any value is not finite.
double norm2(int64_t n, const float* x);
// x ← alpha·x.
void scale(int64_t n, float alpha, float* x);
// C(m×m) ← C + alpha·I.
void add_identity(int64_t m, float alpha, float* c, int64_t ldc);

// Number of threads each BLAS call may use (openblas_set_num_threads). n ≥ 1.
void set_threads(int n);
int threads();

// Sets the BLAS thread count for a scope and restores the previous count on exit. The setting is
// process-wide (OpenBLAS keeps one count), so concurrent callers must agree on it.
class ThreadsScope {
 public:
  explicit ThreadsScope(int n);  // n ≤ 0: keep the current count
  ~ThreadsScope();
  ThreadsScope(const ThreadsScope&) = delete;
  ThreadsScope& operator=(const ThreadsScope&) = delete;

 private:
  int previous_;
};

// "OpenBLAS 0.3.21 ..." as the library reports its build, for logs and tuning-cache keys.
std::string blas_description();
// "" where OpenBLAS runs kernels of the CPU's instruction set; else what to do about it: OpenBLAS's
// DYNAMIC_ARCH falls back to its generic (SSE3 "Prescott") kernels on a model it does not know (OpenBLAS 0.3.21 on
// an Emerald Rapids Xeon: sgemm 27 GFLOP/s a core against 102 with OPENBLAS_CORETYPE=SkylakeX), and the core is
// chosen when OpenBLAS loads, before any of our code runs.
std::string blas_kernel_advice();
// Whether the CPU has AVX-512 F, BW, DQ and VL (the instructions of OpenBLAS's SkylakeX kernels).
bool cpu_has_avx512();
// The CPU model name (from /proc/cpuinfo), for logs and tuning-cache keys.
std::string cpu_model();

}  // namespace dmuon::linalg
