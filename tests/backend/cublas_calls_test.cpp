// The row-major → column-major mapping of the CUDA backend (src/backend/cuda/cublas_calls.hpp), checked without
// a GPU: the very descriptors the CUDA backend hands to cuBLAS run here through CBLAS in column-major order and
// must reproduce the CPU's row-major results, on odd shapes, row strides larger than the width, strided batches,
// both transposes, SYRK both ways (native and tiled) and tiled symmetric products whose tile count does not
// divide the size. The reference is the CPU backend on the same strided views. Padding and the gaps between
// batch matrices hold NaN: a descriptor that reads them poisons its result, one that writes them is caught.
#include <cblas.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "backend/cuda/cublas_calls.hpp"
#include "dmuon/error.hpp"
#include "strided_batch.hpp"

namespace dmuon::cuda {
namespace {

using test::Batch;
using test::expect_close;
using test::product_bound;

// Executes descriptors the way CudaBackend::run hands them to cuBLAS, with CBLAS in column-major order.
void run_column_major(const std::vector<BlasCall>& calls, const float* a, const float* b, float* c) {
  for (const BlasCall& call : calls) {
    ASSERT_EQ(call.ab_type, DType::f32);
    ASSERT_EQ(call.c_type, DType::f32);
    const float* a_base = call.a_source == Source::a ? a : b;
    const float* b_base = call.b_source == Source::a ? a : b;
    for (int64_t i = 0; i < call.batch; ++i) {
      const float* pa = a_base + call.a_offset + i * call.stride_a;
      const float* pb = b_base + call.b_offset + i * call.stride_b;
      float* pc = c + call.c_offset + i * call.stride_c;
      if (call.kind == BlasCall::Kind::syrk) {
        cblas_ssyrk(CblasColMajor, call.lower ? CblasLower : CblasUpper, call.trans_a ? CblasTrans : CblasNoTrans,
                    call.n, call.k, call.alpha, pa, call.lda, call.beta, pc, call.ldc);
      } else {
        cblas_sgemm(CblasColMajor, call.trans_a ? CblasTrans : CblasNoTrans, call.trans_b ? CblasTrans : CblasNoTrans,
                    call.m, call.n, call.k, call.alpha, pa, call.lda, pb, call.ldb, call.beta, pc, call.ldc);
      }
    }
  }
}

void mirror_all(Batch& c) { cpu_backend().mirror_upper(c.view()); }

struct GemmCase {
  bool ta, tb;
  int64_t m, n, k, count;
};

class GemmCalls : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GemmCalls, ReproduceRowMajorGemm) {
  const GemmCase p = GetParam();
  Batch a(p.ta ? p.k : p.m, p.ta ? p.m : p.k, 3, p.count, 1);
  Batch b(p.tb ? p.n : p.k, p.tb ? p.k : p.n, 1, p.count, 2);
  Batch c0(p.m, p.n, 2, p.count, 3);
  const float alpha = 0.75f, beta = -0.5f;
  Batch want = c0, got = c0;
  cpu_backend().gemm(p.ta, p.tb, alpha, a.view(), b.view(), beta, want.view());
  const auto calls = gemm_calls(p.ta, p.tb, alpha, a.view(), b.view(), beta, got.view());
  ASSERT_EQ(calls.size(), 1u);  // one strided-batched call per product
  EXPECT_EQ(calls[0].batch, p.count);
  run_column_major(calls, a.data.data(), b.data.data(), got.data.data());
  expect_close(got, want, product_bound(a, p.ta, b, p.tb, alpha, beta, c0), p.k);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmCalls,
                         ::testing::Values(GemmCase{false, false, 7, 5, 3, 1}, GemmCase{true, false, 7, 5, 3, 1},
                                           GemmCase{false, true, 7, 5, 3, 1}, GemmCase{true, true, 7, 5, 3, 1},
                                           GemmCase{false, false, 33, 17, 65, 3}, GemmCase{true, false, 17, 33, 9, 3},
                                           GemmCase{false, true, 1, 29, 40, 2}, GemmCase{true, true, 31, 1, 12, 4}));

struct SyrkCase {
  bool trans;
  int64_t n, k, count;
  bool native;
  int tiles;
};

class SyrkCalls : public ::testing::TestWithParam<SyrkCase> {};

TEST_P(SyrkCalls, ReproduceRowMajorSyrk) {
  const SyrkCase p = GetParam();
  Batch a(p.trans ? p.k : p.n, p.trans ? p.n : p.k, 2, p.count, 4);
  Batch c0(p.n, p.n, 3, p.count, 5);
  c0.symmetrise();
  const float alpha = 1.25f, beta = 0.5f;
  Batch want = c0, got = c0;
  cpu_backend().syrk(p.trans, alpha, a.view(), beta, want.view());
  const auto calls = syrk_calls(p.trans, alpha, a.view(), beta, got.view(), SyrkMethod{p.native, p.tiles});
  if (p.native) {
    ASSERT_EQ(calls.size(), 1u);
    EXPECT_EQ(calls[0].kind, BlasCall::Kind::syrk);
  }
  run_column_major(calls, a.data.data(), a.data.data(), got.data.data());
  mirror_all(got);  // as CudaBackend::syrk does after the calls
  expect_close(got, want, product_bound(a, p.trans, a, !p.trans, alpha, beta, c0), p.k);
}

INSTANTIATE_TEST_SUITE_P(Shapes, SyrkCalls,
                         ::testing::Values(SyrkCase{false, 9, 14, 1, true, 1}, SyrkCase{true, 9, 14, 1, true, 1},
                                           SyrkCase{false, 23, 5, 1, false, 1}, SyrkCase{false, 23, 5, 1, false, 4},
                                           SyrkCase{true, 23, 31, 1, false, 3}, SyrkCase{false, 17, 8, 3, false, 2},
                                           SyrkCase{true, 17, 8, 3, false, 5}, SyrkCase{false, 3, 4, 2, false, 8}));

struct TiledCase {
  int64_t m, k, count;
  int tiles;
};

class SymmetricGemmCalls : public ::testing::TestWithParam<TiledCase> {};

TEST_P(SymmetricGemmCalls, ReproduceRowMajorTiledProduct) {
  const TiledCase p = GetParam();
  Batch a(p.m, p.k, 1, p.count, 6);
  Batch b(p.k, p.m, 4, p.count, 7);
  Batch c0(p.m, p.m, 2, p.count, 8);
  c0.symmetrise();
  const float alpha = -0.5f, beta = 2.0f;
  Batch want = c0, got = c0;
  cpu_backend().symmetric_gemm(alpha, a.view(), b.view(), beta, want.view(), p.tiles);
  const auto calls = symmetric_gemm_calls(alpha, a.view(), b.view(), beta, got.view(), p.tiles);
  const int64_t t = std::min<int64_t>(p.tiles, p.m);
  const size_t leftover = p.m % t != 0 ? 1 : 0;
  EXPECT_EQ(calls.size(), (p.count == 1 ? t : t * (t + 1) / 2) + leftover);
  run_column_major(calls, a.data.data(), b.data.data(), got.data.data());
  mirror_all(got);
  // Only the upper triangle is computed and mirrored: compare it (and the mirror) with the CPU's, whose own lower
  // triangle is mirrored from its upper one too.
  expect_close(got, want, product_bound(a, false, b, false, alpha, beta, c0), p.k);
}

INSTANTIATE_TEST_SUITE_P(Shapes, SymmetricGemmCalls,
                         ::testing::Values(TiledCase{13, 9, 1, 1}, TiledCase{13, 9, 1, 2}, TiledCase{13, 9, 1, 3},
                                           TiledCase{13, 9, 1, 5}, TiledCase{16, 7, 1, 4}, TiledCase{13, 9, 3, 3},
                                           TiledCase{16, 20, 2, 4}, TiledCase{5, 3, 2, 8}));

TEST(CublasCalls, RejectBadRequests) {
  Batch a(4, 3, 0, 1, 1), b(3, 5, 0, 1, 2), c(4, 5, 0, 1, 3), c_wrong(5, 4, 0, 1, 4), batch2(4, 5, 0, 2, 5);
  EXPECT_THROW(gemm_calls(false, false, 1, a.view(), b.view(), 0, c_wrong.view()), Error);
  EXPECT_THROW(gemm_calls(false, false, 1, a.view(), b.view(), 0, batch2.view()), Error);
  MatView bad_ld = c.view();
  bad_ld.ld = 4;
  EXPECT_THROW(gemm_calls(false, false, 1, a.view(), b.view(), 0, bad_ld), Error);
  Batch a2(4, 3, 0, 2, 6), sq2(4, 4, 0, 2, 7);
  EXPECT_NO_THROW(syrk_calls(false, 1, a2.view(), 0, sq2.view(), SyrkMethod{false, 2}));
  EXPECT_THROW(syrk_calls(false, 1, a2.view(), 0, sq2.view(), SyrkMethod{true, 1}), Error);  // native: one matrix
  EXPECT_THROW(symmetric_gemm_calls(1, a.view(), b.view(), 0, c.view(), 0), Error);
}

}  // namespace
}  // namespace dmuon::cuda
