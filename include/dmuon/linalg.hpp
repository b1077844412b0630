// Dense linear algebra on host memory, row-major, over BLAS (OpenBLAS). Everything above
// src/linalg calls these wrappers, never cblas directly, so a GPU backend can replace them.
#pragma once

#include <cstdint>
#include <string>

namespace dmuon::linalg {

// C(m×n) = alpha·op(A)·op(B) + beta·C, with op(A) m×k and op(B) k×n; lda/ldb/ldc are row strides.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// Number of threads each BLAS call may use (openblas_set_num_threads). n ≥ 1.
void set_threads(int n);
int threads();

// "OpenBLAS 0.3.21 ..." as the library reports its build, for logs and tuning-cache keys.
std::string blas_description();
// The CPU model name (from /proc/cpuinfo), for logs and tuning-cache keys.
std::string cpu_model();

}  // namespace dmuon::linalg
