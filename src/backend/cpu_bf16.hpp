// The CPU backend's bfloat16 products (cpu_backend.cpp calls them for bf16 views): bf16 operands and results,
// float32 accumulation, each result rounded to bf16 once (nearest even) from alpha·Σ + beta·C computed in float32:
// the rounding points of the CUDA backend's bf16 path (cuBLAS GemmEx with float32 compute), so one bf16-emulated
// reference (tests/support/ns_reference.hpp, Bf16Emulation) checks both. The general product is oneDNN's matmul
// (onednn_matmul.cpp; no_onednn.cpp when the build has no oneDNN: bf16 unsupported); the symmetric products are
// block rows over the upper triangle of it, then mirrored, as the CUDA backend's tiled SYRK (bf16_symmetric.cpp).
// Values are bf16 bit patterns (uint16_t, backend/bf16.hpp); strides in elements, row-major. At the top of src/backend
// because dmuon bench ns measures oneDNN's peaks with these products beside OpenBLAS's.
#pragma once

#include <cstdint>
#include <string>

namespace dmuon::cpu_bf16 {

// Whether this build has oneDNN, so the CPU backend computes in bf16 at all.
bool available();
// Whether this CPU has bf16 instructions that oneDNN uses (AVX-512 BF16 or AMX): then bf16 products run on them.
// Without them (an AVX2 CPU) a bf16 product is computed by oneDNN's
// float32 matmul on the widened operands (exact), then rounded: the same result, slower than float32.
bool native();
// Whether this CPU has AMX, bf16 matrix units that oneDNN uses: where bf16 Newton–Schulz beats float32 (with AVX-512 BF16
// alone, OpenBLAS's float32 ran it 2× faster than oneDNN's bf16: docs/ns.md, "Compute dtype"), so the CPU's default.
bool matrix_units();
// "oneDNN 2.6.3, bf16 on brg:avx512_core_amx_bf16"; "oneDNN 2.6.3, bf16 through float32 (no bf16 units)";
// "no oneDNN" without it.
std::string description();

// C(m×n) = alpha·op(A)·op(B) + beta·C; op(A) m×k, op(B) k×n; beta = 0 does not read C. C must not overlap A or B.
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda,
          const uint16_t* b, int64_t ldb, float beta, uint16_t* c, int64_t ldc);
// The same in float32 through oneDNN's matmul (dmuon bench ns's float32 peak of oneDNN beside OpenBLAS).
void gemm_f32(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
              const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

// C(n×n) = alpha·op(A)·op(A)ᵀ + beta·C, op(A) = A (n×k) or, with trans, Aᵀ (A k×n): block rows over the upper
// triangle (tiles: n/128 clamped to 1…8, bf16_symmetric.cpp says why), then mirrored.
void syrk(bool trans, int64_t n, int64_t k, float alpha, const uint16_t* a, int64_t lda, float beta, uint16_t* c,
          int64_t ldc);
// C(m×m) = alpha·A·B + beta·C for A m×k, B k×m with a symmetric product: the tiles on and above the diagonal of a
// tiles×tiles grid, then mirrored (linalg::symmetric_gemm in bf16).
void symmetric_gemm(int64_t m, int64_t k, float alpha, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                    float beta, uint16_t* c, int64_t ldc, int tiles);
// Lower triangle ← upper, m×m.
void mirror_upper(int64_t m, uint16_t* c, int64_t ldc);

}  // namespace dmuon::cpu_bf16
