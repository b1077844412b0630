// SYRK + mirror and the upper-block-triangle products equal a full float64 product within the float32 error
// bound of a length-k dot product, for several tile counts and sizes that the tile count does not divide; the
// mirrored result is exactly symmetric.
#include <gtest/gtest.h>

#include <cfloat>

#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"
#include "ns_reference.hpp"

namespace dmuon {
namespace {

using test::MatD;

// Expects |C − (alpha·A·B + beta·C0)| ≤ γ_{k+2}·(|alpha|·|A|·|B| + |beta|·|C0|) elementwise, γ_j ≈ j·u: the
// float32 error bound of a length-k dot product in any summation order (Higham, ASNA 3.1), plus two roundings
// for the alpha and beta terms. Operands are exact float32 values.
void expect_product_close(const std::vector<float>& c, const MatD& a, const MatD& b, double alpha, double beta,
                          const MatD& c0) {
  const double u = FLT_EPSILON / 2;
  MatD abs_a = a, abs_b = b, abs_c0 = c0;
  for (double& x : abs_a.v) x = std::abs(x);
  for (double& x : abs_b.v) x = std::abs(x);
  for (double& x : abs_c0.v) x = std::abs(x);
  const MatD exact = test::matmul(a, b, alpha, beta, &c0);
  const MatD bound = test::matmul(abs_a, abs_b, std::abs(alpha), std::abs(beta), &abs_c0);
  for (int64_t i = 0; i < exact.rows; ++i) {
    for (int64_t j = 0; j < exact.cols; ++j) {
      const double tol = (a.cols + 2) * u * bound(i, j) + 1e-30;
      ASSERT_LE(std::abs(c[i * exact.cols + j] - exact(i, j)), tol) << "at (" << i << ", " << j << ")";
    }
  }
}

void expect_exactly_symmetric(const std::vector<float>& c, int64_t m) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < i; ++j) ASSERT_EQ(c[i * m + j], c[j * m + i]) << "at (" << i << ", " << j << ")";
  }
}

MatD symmetrised(const MatD& a) { return test::matmul(a, test::transposed(a)); }

// Rounds a float64 matrix to float32 and back, so the float32 kernel and the float64 check see the same
// operands.
MatD rounded(const MatD& a) {
  MatD r = a;
  for (double& x : r.v) x = static_cast<float>(x);
  return r;
}

class Syrk : public ::testing::TestWithParam<std::pair<int64_t, int64_t>> {};

TEST_P(Syrk, EqualsFullProductAndIsSymmetric) {
  const auto [n, k] = GetParam();
  const MatD a = rounded(test::gaussian(n, k, 1));
  const MatD c0 = rounded(symmetrised(test::gaussian(n, 3, 2)));
  std::vector<float> c = test::to_floats(c0);
  const std::vector<float> af = test::to_floats(a);
  linalg::syrk(n, k, 0.75f, af.data(), k, -0.5f, c.data(), n);
  expect_product_close(c, a, test::transposed(a), 0.75, -0.5, c0);
  expect_exactly_symmetric(c, n);

  // The same product from A stored transposed (k×n): C = Aᵀ·A of that layout.
  const std::vector<float> at = test::to_floats(test::transposed(a));
  std::vector<float> ct = test::to_floats(c0);
  linalg::syrk_transposed(n, k, 0.75f, at.data(), n, -0.5f, ct.data(), n);
  expect_product_close(ct, a, test::transposed(a), 0.75, -0.5, c0);
  expect_exactly_symmetric(ct, n);
}

INSTANTIATE_TEST_SUITE_P(Shapes, Syrk,
                         ::testing::Values(std::pair<int64_t, int64_t>{1, 1}, std::pair<int64_t, int64_t>{1, 40},
                                           std::pair<int64_t, int64_t>{7, 3}, std::pair<int64_t, int64_t>{37, 50},
                                           std::pair<int64_t, int64_t>{100, 33}));

class SymmetricGemm : public ::testing::TestWithParam<std::pair<int64_t, int>> {};

TEST_P(SymmetricGemm, UpperTilesEqualFullProduct) {
  const auto [m, tiles] = GetParam();
  // Commuting symmetric factors: S and S² + 2S (polynomials in one symmetric S).
  const MatD s = rounded(symmetrised(test::gaussian(m, m, 3)));
  const MatD s2 = rounded(test::matmul(s, s, 1.0, 2.0, &s));
  const MatD c0 = rounded(symmetrised(test::gaussian(m, 2, 4)));
  std::vector<float> c = test::to_floats(c0);
  const std::vector<float> sf = test::to_floats(s), s2f = test::to_floats(s2);
  linalg::symmetric_gemm(m, m, 1.5f, sf.data(), m, s2f.data(), m, 0.25f, c.data(), m, tiles);
  expect_product_close(c, s, s2, 1.5, 0.25, c0);
  expect_exactly_symmetric(c, m);
}

INSTANTIATE_TEST_SUITE_P(TilesAndSizes, SymmetricGemm,
                         ::testing::Values(std::pair<int64_t, int>{1, 1}, std::pair<int64_t, int>{1, 4},
                                           std::pair<int64_t, int>{3, 8}, std::pair<int64_t, int>{37, 1},
                                           std::pair<int64_t, int>{37, 2}, std::pair<int64_t, int>{37, 3},
                                           std::pair<int64_t, int>{37, 4}, std::pair<int64_t, int>{64, 4},
                                           std::pair<int64_t, int>{101, 7}, std::pair<int64_t, int>{101, 8}));

TEST(SymmetricGemmTest, RejectsZeroTiles) {
  std::vector<float> a(4, 1.0f), c(4, 0.0f);
  EXPECT_THROW(linalg::symmetric_gemm(2, 2, 1.0f, a.data(), 2, a.data(), 2, 0.0f, c.data(), 2, 0), Error);
}

TEST(Elementwise, TransposeNormScaleIdentity) {
  const MatD a = rounded(test::gaussian(37, 70, 5));
  const std::vector<float> af = test::to_floats(a);
  std::vector<float> t(af.size());
  linalg::transpose(37, 70, af.data(), t.data());
  const MatD expected = test::transposed(a);
  for (size_t i = 0; i < t.size(); ++i) ASSERT_EQ(t[i], expected.v[i]);
  EXPECT_NEAR(linalg::norm2(af.size(), af.data()), test::frobenius(a), 1e-12 * test::frobenius(a));
  std::vector<float> x = {1.0f, -2.0f, 4.0f, 0.5f};
  linalg::scale(4, 0.5f, x.data());
  EXPECT_EQ(x, (std::vector<float>{0.5f, -1.0f, 2.0f, 0.25f}));
  linalg::add_identity(2, 3.0f, x.data(), 2);
  EXPECT_EQ(x, (std::vector<float>{3.5f, -1.0f, 2.0f, 3.25f}));
}

}  // namespace
}  // namespace dmuon
