// Backend conformance (as ggml's test-backend-ops): every operation of the Backend interface against a float64
// reference computed here on the host, on odd shapes, row strides larger than the width, strided batches and
// zero sizes. Data moves only through the interface (copy_from_host / copy_to_host), so any backend can run it:
// the CPU backend always, the fenced test device (tests/support/fenced_device.hpp: the CPU backend behind memory the
// host cannot touch) always, the CUDA backend where this build has it and a device is present (else skipped).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/bf16.hpp"
#include "backend/cpu_bf16.hpp"
#include "dmuon/backend.hpp"
#include "dmuon/error.hpp"
#include "dmuon/update_rules.hpp"
#include "fenced_device.hpp"

namespace dmuon {
namespace {

// Tolerance of a float32 result accumulated over k terms of size ~1: |x − ref| ≤ k·ε·scale (Higham's bound
// for a dot product, with the inputs' magnitudes bounded by 1).
double tol(int64_t k, double scale = 1.0) { return 4.0 * static_cast<double>(std::max<int64_t>(k, 1)) * 6e-8 * scale; }

// A host image of a strided batch: count matrices of rows×cols with row stride ld, batch stride stride.
struct Host {
  int64_t rows, cols, ld, count, stride;
  std::vector<float> v;
  Host(int64_t r, int64_t c, int64_t l, int64_t n, uint32_t seed) : rows(r), cols(c), ld(l), count(n) {
    stride = rows * ld + 3;  // a gap between matrices, never touched
    v.assign(static_cast<size_t>(std::max<int64_t>(stride * count, 1)), 0.0f);
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> d(-1.0f, 1.0f);
    for (float& x : v) x = d(rng);
  }
  float& at(int64_t b, int64_t i, int64_t j) { return v[b * stride + i * ld + j]; }
  double get(int64_t b, int64_t i, int64_t j) const { return v[b * stride + i * ld + j]; }
};

// The backends under test: cpu, cuda, and "fenced" (the fenced device over the CPU backend).
class BackendTest : public ::testing::Test {
 protected:
  // Opens the backend `device`; false (and the test skipped) when this build or machine lacks it.
  bool open(const std::string& device) {
    if (device == "fenced") {
      fenced_ = std::make_unique<test::FencedBackend>();
      be_ = fenced_.get();
      return true;
    }
    try {
      be_ = &backend_for(parse_device_kind(device));
      return true;
    } catch (const Error& e) {
      return false;
    }
  }
  // Device copy of a host image; the view matches its layout.
  MatView upload(const Host& h) {
    buffers_.emplace_back(*be_, DType::f32, static_cast<int64_t>(h.v.size()));
    be_->copy_from_host(buffers_.back().data(), h.v.data(), h.v.size() * sizeof(float));
    return {buffers_.back().data(), be_->device(), DType::f32, h.rows, h.cols, h.ld, h.count, h.stride};
  }
  void download(const MatView& v, Host& h) {
    be_->copy_to_host(h.v.data(), v.data, h.v.size() * sizeof(float));
  }
  float* upload(const std::vector<float>& x) {
    buffers_.emplace_back(*be_, DType::f32, static_cast<int64_t>(x.size()));
    be_->copy_from_host(buffers_.back().data(), x.data(), x.size() * sizeof(float));
    return buffers_.back().f32();
  }
  std::vector<float> download(const float* p, size_t n) {
    std::vector<float> out(n);
    be_->copy_to_host(out.data(), p, n * sizeof(float));
    return out;
  }
  double* device_doubles(size_t n) {
    buffers_.emplace_back(*be_, DType::f32, static_cast<int64_t>(2 * n));
    return reinterpret_cast<double*>(buffers_.back().data());
  }
  std::vector<double> download_doubles(const double* p, size_t n) {
    std::vector<double> out(n);
    be_->copy_to_host(out.data(), p, n * sizeof(double));
    return out;
  }

  template <typename T>
  DeviceSpan<T> span(T* p, int64_t n) {
    return {*be_, p, static_cast<size_t>(n)};
  }

  std::unique_ptr<test::FencedBackend> fenced_;  // declared before buffers_, which it outlives
  Backend* be_ = nullptr;
  std::vector<Buffer> buffers_;
};

class Conformance : public BackendTest, public ::testing::WithParamInterface<std::string> {
 protected:
  void SetUp() override {
    if (!open(GetParam())) GTEST_SKIP() << "no " << GetParam() << " backend here";
  }
};

TEST_P(Conformance, GemmAllTransposesStridesAndBatches) {
  for (const bool ta : {false, true}) {
    for (const bool tb : {false, true}) {
      const int64_t m = 7, n = 5, k = 9, count = 3;
      Host a(ta ? k : m, ta ? m : k, (ta ? m : k) + 2, count, 1);
      Host b(tb ? n : k, tb ? k : n, (tb ? k : n) + 1, count, 2);
      Host c(m, n, n + 3, count, 3);
      const Host c0 = c;
      const MatView cv = upload(c);
      be_->gemm(ta, tb, 0.75f, upload(a), upload(b), -0.5f, cv);
      download(cv, c);
      for (int64_t bi = 0; bi < count; ++bi) {
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            double ref = -0.5 * c0.get(bi, i, j);
            for (int64_t p = 0; p < k; ++p) {
              ref += 0.75 * (ta ? a.get(bi, p, i) : a.get(bi, i, p)) * (tb ? b.get(bi, j, p) : b.get(bi, p, j));
            }
            ASSERT_NEAR(c.get(bi, i, j), ref, tol(k)) << "ta " << ta << " tb " << tb << " at " << bi << "," << i
                                                      << "," << j;
          }
        }
        // The gap between matrices and the padding of each row are untouched.
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = n; j < c.ld; ++j) ASSERT_EQ(c.get(bi, i, j), c0.get(bi, i, j));
        }
      }
    }
  }
}

TEST_P(Conformance, GemmZeroSizes) {
  Host a(0, 4, 4, 1, 1), b(4, 3, 3, 1, 2), c(0, 3, 3, 1, 3);
  be_->gemm(false, false, 1.0f, upload(a), upload(b), 0.0f, upload(c));  // m = 0: nothing to do
  Host a2(2, 0, 1, 1, 4), b2(0, 3, 3, 1, 5), c2(2, 3, 3, 1, 6);
  const MatView cv = upload(c2);
  be_->gemm(false, false, 1.0f, upload(a2), upload(b2), 0.5f, cv);  // k = 0: C = beta·C
  Host out = c2;
  download(cv, out);
  for (int64_t i = 0; i < 2; ++i) {
    for (int64_t j = 0; j < 3; ++j) EXPECT_FLOAT_EQ(out.get(0, i, j), 0.5f * c2.get(0, i, j));
  }
}

// k = 0 in every product: C = beta·C, and beta = 0 writes zeros without reading C (BLAS's rule), so NaN in C
// does not survive. The CUDA backend does this itself rather than trust cuBLAS with k = 0.
TEST_P(Conformance, ProductsWithNoInnerDimensionScaleC) {
  const int64_t n = 5;
  for (const float beta : {0.0f, 0.5f}) {
    Host c(n, n, n, 1, 8);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = i; j < n; ++j) c.at(0, j, i) = c.at(0, i, j);  // symmetric, as syrk's beta·C must be
    if (beta == 0.0f) c.at(0, 1, 2) = c.at(0, 2, 1) = std::nanf("");
    const Host empty_a(n, 0, 1, 1, 9), empty_b(0, n, n, 1, 10);
    const auto check = [&](const MatView& v, const char* op) {
      Host out = c;
      download(v, out);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j)
          EXPECT_EQ(out.get(0, i, j), beta == 0.0f ? 0.0 : double(beta * c.at(0, i, j))) << op << " beta " << beta;
    };
    const MatView g = upload(c);
    be_->gemm(false, false, 1.0f, upload(empty_a), upload(empty_b), beta, g);
    check(g, "gemm");
    const MatView s = upload(c);
    be_->syrk(false, 1.0f, upload(empty_a), beta, s);
    check(s, "syrk");
    const MatView t = upload(c);
    be_->symmetric_gemm(1.0f, upload(empty_a), upload(empty_b), beta, t, 2);
    check(t, "symmetric_gemm");
  }
}

// f32 → bf16 → f32 rounds to nearest, ties to even, keeps ±0 and ±Inf, overflows to Inf and makes every NaN the
// canonical quiet NaN (CUDA's __float2bfloat16_rn), on strided batches.
TEST_P(Conformance, ConvertRoundsToBfloat16NearestEven) {
  const auto f = [](uint32_t bits) { return std::bit_cast<float>(bits); };
  const std::vector<std::pair<float, uint32_t>> cases = {
      {1.0f, 0x3f800000u},        {f(0x3f808000u), 0x3f800000u},  // tie, even below
      {f(0x3f818000u), 0x3f820000u},  // tie, even above
      {f(0x3f808001u), 0x3f810000u},  // above the tie
      {-0.0f, 0x80000000u},       {INFINITY, 0x7f800000u},        {-INFINITY, 0xff800000u},
      {f(0x7f7fffffu), 0x7f800000u},  // FLT_MAX rounds up to Inf
      {f(0x7f800001u), 0x7fff0000u},  // a signalling NaN that truncation would turn into Inf
      {f(0xffc00000u), 0x7fff0000u},  // a negative quiet NaN
      {f(0x00000001u), 0x00000000u},  // the least subnormal rounds to 0
  };
  const int64_t cols = static_cast<int64_t>(cases.size()), ld = cols + 2, count = 2;
  Host in(1, cols, ld, count, 11);
  for (int64_t b = 0; b < count; ++b)
    for (int64_t j = 0; j < cols; ++j) in.at(b, 0, j) = cases[j].first;
  const MatView from = upload(in);
  buffers_.emplace_back(*be_, DType::bf16, in.stride * count);
  const MatView narrow{buffers_.back().data(), be_->device(), DType::bf16, 1, cols, ld, count, in.stride};
  Host back = in;
  for (float& x : back.v) x = 7.0f;  // poisoned: the gaps between rows must stay
  const MatView to = upload(back);
  be_->convert(from, narrow);
  be_->convert(narrow, to);
  download(to, back);
  for (int64_t b = 0; b < count; ++b) {
    for (int64_t j = 0; j < cols; ++j)
      EXPECT_EQ(std::bit_cast<uint32_t>(back.at(b, 0, j)), cases[j].second) << "case " << j << ", matrix " << b;
    for (int64_t j = cols; j < ld; ++j) EXPECT_EQ(back.at(b, 0, j), 7.0f);
  }
}

TEST_P(Conformance, SyrkBothWaysIsTheFullSymmetricProduct) {
  for (const bool trans : {false, true}) {
    const int64_t n = 11, k = 6, count = 2;
    Host a(trans ? k : n, trans ? n : k, (trans ? n : k) + 1, count, 7);
    Host c(n, n, n + 2, count, 8);
    for (int64_t b = 0; b < count; ++b) {  // beta·C must be symmetric
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < i; ++j) c.at(b, i, j) = c.at(b, j, i);
      }
    }
    const Host c0 = c;
    const MatView cv = upload(c);
    be_->syrk(trans, 0.75f, upload(a), -0.5f, cv);
    download(cv, c);
    for (int64_t b = 0; b < count; ++b) {
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          double ref = -0.5 * c0.get(b, i, j);
          for (int64_t p = 0; p < k; ++p) {
            ref += 0.75 * (trans ? a.get(b, p, i) * a.get(b, p, j) : a.get(b, i, p) * a.get(b, j, p));
          }
          ASSERT_NEAR(c.get(b, i, j), ref, tol(k)) << "trans " << trans << " at " << b << "," << i << "," << j;
        }
      }
    }
  }
}

TEST_P(Conformance, SymmetricGemmOfCommutingFactorsAnyTileCount) {
  // S and S² commute, so S·S² is symmetric; tile counts that do not divide m, and more tiles than rows.
  const int64_t m = 13;
  Host s(m, m, m, 1, 9);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < i; ++j) s.at(0, i, j) = s.at(0, j, i);
  }
  Host s2(m, m, m + 1, 1, 10);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < m; ++j) {
      double x = 0;
      for (int64_t p = 0; p < m; ++p) x += s.get(0, i, p) * s.get(0, p, j);
      s2.at(0, i, j) = static_cast<float>(x);
    }
  }
  for (const int tiles : {1, 3, 4, 20}) {
    Host c(m, m, m, 1, 11);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < i; ++j) c.at(0, i, j) = c.at(0, j, i);
    }
    const Host c0 = c;
    const MatView cv = upload(c);
    be_->symmetric_gemm(1.5f, upload(s), upload(s2), 0.25f, cv, tiles);
    download(cv, c);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < m; ++j) {
        double ref = 0.25 * c0.get(0, i, j);
        for (int64_t p = 0; p < m; ++p) ref += 1.5 * s.get(0, i, p) * s2.get(0, p, j);
        ASSERT_NEAR(c.get(0, i, j), ref, tol(m, 4.0 * m)) << "tiles " << tiles << " at " << i << "," << j;
      }
    }
  }
}

TEST_P(Conformance, ElementwiseOnStridedBatches) {
  const int64_t r = 5, c = 5, count = 2;
  Host x(r, c, c + 2, count, 12);
  const Host x0 = x;
  MatView v = upload(x);
  be_->scale(v, -2.0f);
  be_->add_identity(v, 0.5f);
  download(v, x);
  for (int64_t b = 0; b < count; ++b) {
    for (int64_t i = 0; i < r; ++i) {
      for (int64_t j = 0; j < c; ++j) {
        EXPECT_FLOAT_EQ(x.get(b, i, j), -2.0f * x0.get(b, i, j) + (i == j ? 0.5f : 0.0f));
      }
      for (int64_t j = c; j < x.ld; ++j) EXPECT_EQ(x.get(b, i, j), x0.get(b, i, j));  // padding untouched
    }
  }
  be_->mirror_upper(v);
  download(v, x);
  for (int64_t b = 0; b < count; ++b) {
    for (int64_t i = 0; i < r; ++i) {
      for (int64_t j = 0; j < i; ++j) EXPECT_EQ(x.get(b, i, j), x.get(b, j, i));
    }
  }
  be_->fill(v, 3.0f);
  download(v, x);
  EXPECT_EQ(x.get(1, 4, 4), 3.0f);
  EXPECT_EQ(x.get(0, 0, 0), 3.0f);
}

TEST_P(Conformance, TransposeOddShape) {
  Host in(7, 37, 40, 2, 13), out(37, 7, 9, 2, 14);
  const MatView ov = upload(out);
  be_->transpose(upload(in), ov);
  download(ov, out);
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t i = 0; i < 7; ++i) {
      for (int64_t j = 0; j < 37; ++j) ASSERT_EQ(out.get(b, j, i), in.get(b, i, j));
    }
  }
}

TEST_P(Conformance, NormsStayOnTheDeviceAndFlagNonFinite) {
  Host x(6, 9, 11, 3, 15);
  x.at(2, 3, 4) = NAN;
  const MatView v = upload(x);
  double* norms = device_doubles(3);
  be_->frobenius_norms(v, norms);
  const std::vector<double> got = download_doubles(norms, 3);
  for (int64_t b = 0; b < 2; ++b) {
    double sum = 0;
    for (int64_t i = 0; i < 6; ++i) {
      for (int64_t j = 0; j < 9; ++j) sum += x.get(b, i, j) * x.get(b, i, j);
    }
    EXPECT_NEAR(got[b], std::sqrt(sum), 1e-12 * std::sqrt(sum));
  }
  EXPECT_FALSE(std::isfinite(got[2]));
  // x_i ← x_i / (‖x_i‖·safety + eps), rounded as DESIGN 2.1's normalisation: the factor in double, then float.
  be_->scale_by_inverse_norm(v.first(2), norms, 1.5, 1e-7);
  Host y = x;
  download(v, y);
  for (int64_t b = 0; b < 2; ++b) {
    const float f = static_cast<float>(1.0 / (got[b] * 1.5 + 1e-7));
    EXPECT_EQ(y.get(b, 2, 3), static_cast<float>(x.get(b, 2, 3)) * f);
  }
}

// n values uniform in [−1, 1), the stream `rng` continues.
std::vector<float> uniform_values(int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& e : x) e = d(rng);
  return x;
}

TEST_P(Conformance, UpdateRulesAgainstDoubleReferences) {
  const int64_t n = 37;
  std::mt19937 rng(16);
  const auto random = [&] { return uniform_values(n, rng); };
  const std::vector<float> g = random(), p0 = random(), m0 = random(), mom0 = random();
  std::vector<float> v0 = random();
  for (float& e : v0) e = std::abs(e);
  const float gs = 0.5f;

  double* sum = device_doubles(1);
  be_->run({rules::SumOfSquares{.grad = span<const float>(upload(g), n), .grad_scale = gs, .sum = sum}});
  double ref_sum = 0;
  for (float e : g) ref_sum += double(e * gs) * double(e * gs);
  EXPECT_NEAR(download_doubles(sum, 1)[0], ref_sum, 1e-12 * ref_sum);

  float* acc = upload(m0);
  be_->run({rules::Accumulate{.acc = span(acc, n), .grad = span<const float>(upload(g), n), .first = true}});
  be_->run({rules::Accumulate{.acc = span(acc, n), .grad = span<const float>(upload(g), n), .first = false}});
  const std::vector<float> accumulated = download(acc, n);
  for (int64_t i = 0; i < n; ++i) EXPECT_FLOAT_EQ(accumulated[i], 2 * g[i]);

  const AdamWStepConstants k{0.99f, 0.1f, 0.95f, 0.05f, 0.01f, 0.3f, 1e-8f};
  float *p = upload(p0), *m = upload(m0), *v = upload(v0);
  be_->run({rules::AdamWStep{.p = span(p, n),
                              .grad = span<const float>(upload(g), n),
                              .m = span(m, n),
                              .v = span(v, n),
                              .k = k,
                              .grad_scale = gs}});
  const std::vector<float> p1 = download(p, n), m1 = download(m, n), v1 = download(v, n);
  for (int64_t i = 0; i < n; ++i) {
    const double gi = double(g[i]) * gs;
    const double mi = m0[i] + 0.1 * (gi - m0[i]), vi = 0.95 * v0[i] + 0.05 * gi * gi;
    const double pi = p0[i] * 0.99 - 0.01 * mi / (std::sqrt(vi) / 0.3 + 1e-8);
    EXPECT_NEAR(m1[i], mi, 1e-6);
    EXPECT_NEAR(v1[i], vi, 1e-6);
    EXPECT_NEAR(p1[i], pi, 1e-5 * (1 + std::abs(pi)));
  }

  for (const bool nesterov : {false, true}) {
    float* mom = upload(mom0);
    float* u = upload(std::vector<float>(n, 0.0f));
    be_->run({rules::MuonMomentum{.grad = span<const float>(upload(g), n),
                                  .momentum = span(mom, n),
                                  .u = span(u, n),
                                  .one_minus_beta = 0.05f,
                                  .beta = 0.95f,
                                  .nesterov = nesterov,
                                  .grad_scale = gs}});
    const std::vector<float> mom1 = download(mom, n), u1 = download(u, n);
    for (int64_t i = 0; i < n; ++i) {
      const double gi = double(g[i]) * gs, mi = 0.95 * mom0[i] + 0.05 * gi;
      EXPECT_NEAR(mom1[i], mi, 1e-6);
      EXPECT_NEAR(u1[i], nesterov ? 0.05 * gi + 0.95 * mi : mi, 1e-6);
    }
  }

  float* w = upload(p0);
  be_->run({rules::MuonApply{
      .w = span(w, n), .o = span<const float>(upload(g), n), .decay = 0.98f, .neg_lr = -0.02f, .scale = 1.5f}});
  const std::vector<float> w1 = download(w, n);
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(w1[i], 0.98 * p0[i] - 0.02 * 1.5 * g[i], 1e-6);
}

// torch.lerp in float32, as a plain loop states it (the build never contracts a·b + c into an FMA).
float lerp(float a, float b, float w) { return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w); }

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i])) return false;
  }
  return true;
}

// MuonMomentum's device scalars and empty gradient, and MuonApply's keep and cautious weight decay, bit for bit against
// plain loops: a device grad scale is the host one; keep = 1 is no keep; keep = 0 leaves M (U = M) and W as they
// were, bit for bit; an empty gradient is zeros times the scale; cautious weight decay decays where W·O ≥ 0 only.
TEST_P(Conformance, UpdateRulesKeepDeviceScaleAndEmptyGradientBitForBit) {
  const int64_t n = 41;
  std::mt19937 rng(17);
  const auto random = [&] { return uniform_values(n, rng); };
  const std::vector<float> g = random(), w0 = random(), o = random();
  std::vector<float> mom0 = random();
  mom0[0] = -0.0f;  // keep = 0 leaves even a −0 as it is (a lerp of M with itself would give +0)
  const float gs = 0.37f, omb = 0.05f, beta = 0.95f;
  const float* scalars = upload({gs, 1.0f, 0.0f});
  const float *device_scale = scalars, *kept = scalars + 1, *dropped = scalars + 2;

  struct Case {
    const char* what;
    bool nesterov, device_scale, empty_grad;
    const float* keep;
  };
  for (const Case& c : {Case{"host scale", true, false, false, nullptr},
                        Case{"device scale", true, true, false, nullptr},
                        Case{"device scale, plain", false, true, false, nullptr},
                        Case{"keep 1", true, false, false, kept},
                        Case{"keep 0", true, true, false, dropped},
                        Case{"keep 0, plain", false, false, false, dropped},
                        Case{"empty gradient", true, false, true, nullptr},
                        Case{"empty gradient, device scale", false, true, true, kept}}) {
    float* mom = upload(mom0);
    float* u = upload(std::vector<float>(n, 7.0f));
    be_->run({rules::MuonMomentum{.grad = c.empty_grad ? DeviceSpan<const float>() : span<const float>(upload(g), n),
                                  .momentum = span(mom, n),
                                  .u = span(u, n),
                                  .one_minus_beta = omb,
                                  .beta = beta,
                                  .nesterov = c.nesterov,
                                  .grad_scale = c.device_scale ? 3.0f : gs,  // the device's replaces it
                                  .device_grad_scale = c.device_scale ? device_scale : nullptr,
                                  .keep = c.keep}});
    std::vector<float> want_m = mom0, want_u(n);
    for (int64_t i = 0; i < n && c.keep != dropped; ++i) {
      const float gi = (c.empty_grad ? 0.0f : g[i]) * gs;
      want_m[i] = lerp(mom0[i], gi, omb);
      want_u[i] = c.nesterov ? lerp(gi, want_m[i], beta) : want_m[i];
    }
    if (c.keep == dropped) want_u = mom0;
    const std::vector<float> got_m = download(mom, n), got_u = download(u, n);
    EXPECT_TRUE(same_bits(got_m, want_m)) << c.what << ": momentum";
    EXPECT_TRUE(same_bits(got_u, want_u)) << c.what << ": update";
    if (c.keep == dropped) {
      EXPECT_TRUE(same_bits(got_m, mom0)) << c.what << ": momentum changed";
      EXPECT_TRUE(same_bits(got_u, mom0)) << c.what << ": U is not M";
    }
  }

  // Cautious weight decay: W·decay where W·O ≥ 0 (a zero product included), W elsewhere.
  std::vector<float> w_signs = w0;
  w_signs[1] = 0.0f;
  w_signs[2] = -0.0f;
  int64_t agree = 0;
  for (int64_t i = 0; i < n; ++i) agree += w_signs[i] * o[i] >= 0.0f;
  ASSERT_TRUE(agree > 2 && agree < n - 2) << "the values must have both signs of W·O";
  for (const bool cautious_wd : {false, true}) {
    for (const float* keep : {static_cast<const float*>(nullptr), kept, dropped}) {
      float* w = upload(w_signs);
      be_->run({rules::MuonApply{.w = span(w, n),
                                 .o = span<const float>(upload(o), n),
                                 .decay = 0.98f,
                                 .neg_lr = -0.02f,
                                 .scale = 1.5f,
                                 .keep = keep,
                                 .cautious_wd = cautious_wd}});
      std::vector<float> want = w_signs;
      for (int64_t i = 0; i < n && keep != dropped; ++i) {
        const bool decays = !cautious_wd || w_signs[i] * o[i] >= 0.0f;
        want[i] = (decays ? w_signs[i] * 0.98f : w_signs[i]) + -0.02f * (o[i] * 1.5f);
      }
      EXPECT_TRUE(same_bits(download(w, n), want))
          << "muon_apply, keep " << (keep == dropped ? 0 : 1) << (cautious_wd ? ", cautious" : "");
    }
  }
}

// NorMuonNormalize against its float64 definition (tests/python/muon_reference.py normuon_ref), two steps so that
// the moment carries over: per row v ← β2·v + (1−β2)·mean_j O², Ô = O/(√v + 1e-8), O ← Ô·‖O‖/max(‖Ô‖, 1e-8). A row
// of zeros, a 1×n and an n×1 matrix; an all-zero O stays zero. Bounds: v is a float32 lerp of a rounded mean (a few
// ulps of v); each element of O rounds O, the divisor (√ of v, + 1e-8), the quotient, the ratio (from double norms)
// and the product: 8 ulps of |Ô| in all, ×2 across the second step's inputs.
TEST_P(Conformance, NorMuonNormalizeAgainstDoubleReference) {
  std::mt19937 rng(18);
  struct Shape {
    int64_t rows, cols;
  };
  for (const Shape shape : {Shape{7, 9}, Shape{1, 12}, Shape{12, 1}}) {
    const int64_t rows = shape.rows, cols = shape.cols, n = rows * cols;
    const std::string what = std::to_string(rows) + "x" + std::to_string(cols);
    std::vector<double> v_ref(rows, 0.0);
    float* v = upload(std::vector<float>(rows, 0.0f));
    for (int step = 0; step < 2; ++step) {
      std::vector<float> o0 = uniform_values(n, rng);
      if (rows > 1) std::fill(o0.begin() + cols, o0.begin() + 2 * cols, 0.0f);  // row 1: zeros
      float* o = upload(o0);
      be_->run({rules::NorMuonNormalize{
          .o = span(o, n), .v = span(v, rows), .rows = rows, .cols = cols, .one_minus_beta2 = 0.1f}});
      std::vector<double> y(n);
      double o_sq = 0, y_sq = 0;
      for (int64_t r = 0; r < rows; ++r) {
        double sum = 0;
        for (int64_t j = 0; j < cols; ++j) sum += double(o0[r * cols + j]) * o0[r * cols + j];
        v_ref[r] = 0.9 * v_ref[r] + 0.1 * sum / double(cols);
        for (int64_t j = 0; j < cols; ++j) y[r * cols + j] = o0[r * cols + j] / (std::sqrt(v_ref[r]) + 1e-8);
        o_sq += sum;
      }
      for (double e : y) y_sq += e * e;
      const double ratio = std::sqrt(o_sq) / std::max(std::sqrt(y_sq), 1e-8);
      const std::vector<float> got_o = download(o, n), got_v = download(v, rows);
      double largest = 0;
      for (double e : y) largest = std::max(largest, std::abs(e * ratio));
      for (int64_t i = 0; i < n; ++i)
        EXPECT_NEAR(got_o[i], y[i] * ratio, 16 * 6e-8 * largest) << what << " step " << step << " element " << i;
      for (int64_t r = 0; r < rows; ++r) EXPECT_NEAR(got_v[r], v_ref[r], 8 * 6e-8 * v_ref[r]) << what << " row " << r;
    }
  }
  float* zero = upload(std::vector<float>(6, 0.0f));
  float* v = upload({0.5f, 0.25f});
  be_->run({rules::NorMuonNormalize{.o = span(zero, 6), .v = span(v, 2), .rows = 2, .cols = 3, .one_minus_beta2 = 0.5f}});
  EXPECT_EQ(download(zero, 6), std::vector<float>(6, 0.0f));
  EXPECT_EQ(download(v, 2), (std::vector<float>{0.25f, 0.125f}));
  try {
    be_->run({rules::NorMuonNormalize{.o = span(zero, 6), .v = span(v, 2), .rows = 3, .cols = 2}});
    FAIL() << "normuon_normalize of a 3x2 matrix with 2 row moments ran";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("normuon_normalize"), std::string::npos) << e.what();
  }
}

// Sizes that differ are refused, naming the rule; an empty gradient is MuonMomentum's only.
TEST_P(Conformance, UpdateRulesRefuseViewsOfDifferentSizes) {
  float* a = upload(std::vector<float>(5, 1.0f));
  float* b = upload(std::vector<float>(5, 1.0f));
  try {
    be_->run({rules::Accumulate{.acc = span(a, 5), .grad = span<const float>(b, 4)}});
    FAIL() << "accumulate of 5 and 4 values ran";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("accumulate"), std::string::npos) << e.what();
  }
  EXPECT_THROW(be_->run({rules::MuonApply{.w = span(a, 5), .o = DeviceSpan<const float>()}}), Error);
}

TEST_P(Conformance, CopiesAndEvents) {
  const std::vector<float> x = {1, 2, 3, 4, 5};
  float* a = upload(x);
  float* b = upload(std::vector<float>(5, 0.0f));
  be_->copy(b, a, 5 * sizeof(float));
  be_->record_event()->wait();
  EXPECT_EQ(download(b, 5), x);
  be_->synchronize();
}

TEST_P(Conformance, RunConcurrentlyRunsEveryWorkerOnce) {
  std::vector<int> seen(3, 0);
  be_->run_concurrently(3, [&](Backend&, int w) { seen[w] += 1; });
  EXPECT_EQ(seen, std::vector<int>({1, 1, 1}));
}

INSTANTIATE_TEST_SUITE_P(Backends, Conformance, ::testing::Values("cpu", "cuda", "fenced"),
                         [](const auto& info) { return info.param; });

// ---- the products and the elementwise passes of Newton–Schulz's iterates, per device × compute dtype ----
// float32: the float64 product within tol(k). bf16 (CUDA; the CPU with oneDNN): operands and C are bf16 values, the
// product accumulates in float32 and alpha·Σ + beta·C is rounded to bf16 once (the rounding points of
// tests/support/ns_reference.hpp's Bf16Emulation): within tol(k) of the float64 product of the bf16 inputs plus
// half a bf16 ulp of the result (2⁻⁸·|ref|); and bit for bit that rounding where float32 arithmetic is exact.
class DtypeConformance : public BackendTest,
                         public ::testing::WithParamInterface<std::tuple<std::string, DType>> {
 protected:
  void SetUp() override {
    const auto& [device, dtype] = GetParam();
    dtype_ = dtype;
    if (!open(device)) GTEST_SKIP() << "no " << device << " backend here";
    if (!be_->supports(dtype_)) GTEST_SKIP() << device << " does not compute in " << to_string(dtype_) << " here";
  }
  // h on the device in the dtype under test (bf16: h's values rounded, h updated to them).
  MatView put(Host& h) {
    const MatView wide = upload(h);
    if (dtype_ == DType::f32) return wide;
    buffers_.emplace_back(*be_, DType::bf16, static_cast<int64_t>(h.v.size()));
    MatView narrow = wide;
    narrow.data = buffers_.back().data();
    narrow.dtype = DType::bf16;
    be_->convert(wide, narrow);
    be_->convert(narrow, wide);
    download(wide, h);
    return narrow;
  }
  // The values of v into h (same layout).
  void get(const MatView& v, Host& h) {
    if (dtype_ == DType::f32) return download(v, h);
    MatView wide = upload(h);
    be_->convert(v, wide);
    download(wide, h);
  }
  double bound(int64_t k, double ref) const { return tol(k) + (dtype_ == DType::bf16 ? std::ldexp(std::abs(ref), -8) : 0); }
  DType dtype_ = DType::f32;
};

// C = 0.75·op(A)·op(B) − 0.5·C (gemm, each transpose), C = 0.75·op(A)·op(A)ᵀ − 0.5·C (syrk both ways) and
// 1.5·S·S² + 0.25·C (symmetric_gemm, tile counts that do not divide m and more tiles than rows), on strided batches.
TEST_P(DtypeConformance, ProductsOnStridedBatches) {
  const int64_t m = 13, n = 6, k = 9, count = 2;
  const auto check = [&](const Host& c0, const Host& c, double alpha, double beta, const auto& op_a, const auto& op_b,
                         int64_t rows, int64_t cols, int64_t inner, const std::string& what) {
    for (int64_t bi = 0; bi < count; ++bi) {
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < cols; ++j) {
          double ref = beta * c0.get(bi, i, j);
          for (int64_t p = 0; p < inner; ++p) ref += alpha * op_a(bi, i, p) * op_b(bi, p, j);
          ASSERT_NEAR(c.get(bi, i, j), ref, bound(inner, ref)) << what << " at " << bi << "," << i << "," << j;
        }
        for (int64_t j = cols; j < c.ld; ++j) ASSERT_EQ(c.get(bi, i, j), c0.get(bi, i, j)) << what << " padding";
      }
    }
  };
  for (const bool ta : {false, true}) {
    for (const bool tb : {false, true}) {
      Host a(ta ? k : m, ta ? m : k, (ta ? m : k) + 2, count, 1), b(tb ? n : k, tb ? k : n, (tb ? k : n) + 1, count, 2);
      Host c(m, n, n + 3, count, 3);
      const MatView av = put(a), bv = put(b), cv = put(c);
      const Host c0 = c;
      be_->gemm(ta, tb, 0.75f, av, bv, -0.5f, cv);
      get(cv, c);
      check(c0, c, 0.75, -0.5, [&](int64_t bi, int64_t i, int64_t p) { return ta ? a.get(bi, p, i) : a.get(bi, i, p); },
            [&](int64_t bi, int64_t p, int64_t j) { return tb ? b.get(bi, j, p) : b.get(bi, p, j); }, m, n, k,
            "gemm ta " + std::to_string(ta) + " tb " + std::to_string(tb));
    }
  }
  for (const bool trans : {false, true}) {
    Host a(trans ? k : m, trans ? m : k, (trans ? m : k) + 1, count, 4), c(m, m, m + 2, count, 5);
    for (int64_t bi = 0; bi < count; ++bi)
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < i; ++j) c.at(bi, i, j) = c.at(bi, j, i);  // beta·C symmetric
    const MatView av = put(a), cv = put(c);
    const Host c0 = c;
    be_->syrk(trans, 0.75f, av, -0.5f, cv);
    get(cv, c);
    const auto op = [&](int64_t bi, int64_t i, int64_t p) { return trans ? a.get(bi, p, i) : a.get(bi, i, p); };
    check(c0, c, 0.75, -0.5, op, [&](int64_t bi, int64_t p, int64_t j) { return op(bi, j, p); }, m, m, k,
          "syrk trans " + std::to_string(trans));
    for (int64_t bi = 0; bi < count; ++bi)
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < i; ++j) ASSERT_EQ(c.get(bi, i, j), c.get(bi, j, i)) << "syrk: exactly symmetric";
  }
  Host s(m, m, m, count, 6), s2(m, m, m + 1, count, 7);
  for (int64_t bi = 0; bi < count; ++bi)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < i; ++j) s.at(bi, i, j) = s.at(bi, j, i);
  const MatView sv = put(s);
  for (int64_t bi = 0; bi < count; ++bi)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j) {
        double x = 0;
        for (int64_t p = 0; p < m; ++p) x += s.get(bi, i, p) * s.get(bi, p, j);
        s2.at(bi, i, j) = static_cast<float>(x);
      }
  const MatView s2v = put(s2);  // bf16: S² rounded, so S·S² is symmetric only up to that rounding
  for (const int tiles : {1, 3, 20}) {
    Host c(m, m, m, count, 8);
    for (int64_t bi = 0; bi < count; ++bi)
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < i; ++j) c.at(bi, i, j) = c.at(bi, j, i);
    const MatView cv = put(c);
    const Host c0 = c;
    be_->symmetric_gemm(1.5f, sv, s2v, 0.25f, cv, tiles);
    get(cv, c);
    // The upper triangle is the product; the lower its mirror (a check on the lower half would test S·S²'s symmetry).
    for (int64_t bi = 0; bi < count; ++bi)
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < m; ++j) {
          const int64_t r = std::min(i, j), q = std::max(i, j);
          double ref = 0.25 * c0.get(bi, r, q);
          for (int64_t p = 0; p < m; ++p) ref += 1.5 * s.get(bi, r, p) * s2.get(bi, p, q);
          ASSERT_NEAR(c.get(bi, i, j), ref, bound(m, ref) - tol(m) + tol(m, 4.0 * m))  // |S²| ≤ m
              << "symmetric_gemm tiles " << tiles << " at " << bi << "," << i << "," << j;
        }
  }
}

// Where every float32 operation is exact (multiples of 1/16 in [−1, 1]: products are multiples of 1/256, sums of 9
// of them need at most 12 bits), the one rounding left is the result's: alpha·Σ + beta·C rounded to nearest even once,
// bit for bit (a bf16 result needs rounding here: 8 significant bits). Rounding the product before adding beta·C, or
// rounding toward zero, fails.
TEST_P(DtypeConformance, ProductRoundsOnceWhereFloat32IsExact) {
  const int64_t m = 7, n = 5, k = 9;
  const auto sixteenths = [](Host& h) {
    for (float& x : h.v) x = std::round(x * 16.0f) / 16.0f;
  };
  Host a(m, k, k, 1, 21), b(k, n, n, 1, 22), c(m, n, n, 1, 23);
  sixteenths(a);
  sixteenths(b);
  sixteenths(c);
  const MatView av = put(a), bv = put(b), cv = put(c);  // sixteenths are bf16 values: unchanged
  const Host c0 = c;
  be_->gemm(false, false, 0.75f, av, bv, -0.5f, cv);
  get(cv, c);
  int rounded = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float sum = 0;
      for (int64_t p = 0; p < k; ++p) sum += a.at(0, i, p) * b.at(0, p, j);  // exact
      const float exact = 0.75f * sum + -0.5f * c0.get(0, i, j);            // exact
      const float want = dtype_ == DType::bf16 ? round_to_bf16(exact) : exact;
      rounded += want != exact;
      EXPECT_EQ(std::bit_cast<uint32_t>(c.at(0, i, j)), std::bit_cast<uint32_t>(want)) << i << "," << j;
    }
  }
  if (dtype_ == DType::bf16) {
    EXPECT_GT(rounded, 5) << "the inputs must make the result round";
  }
}

// scale, add_identity, fill and mirror_upper on the iterates: each value computed in float32 and stored once.
TEST_P(DtypeConformance, ElementwiseOnStridedBatchesRoundOnce) {
  const int64_t r = 6, count = 2;
  Host x(r, r, r + 2, count, 12);
  const MatView v = put(x);
  const Host x0 = x;
  be_->scale(v, -1.7f);
  be_->add_identity(v, 0.3f);
  get(v, x);
  const auto stored = [&](float f) { return dtype_ == DType::bf16 ? round_to_bf16(f) : f; };
  for (int64_t b = 0; b < count; ++b) {
    for (int64_t i = 0; i < r; ++i) {
      for (int64_t j = 0; j < r; ++j) {
        const float scaled = stored(-1.7f * static_cast<float>(x0.get(b, i, j)));
        EXPECT_EQ(x.get(b, i, j), i == j ? stored(scaled + 0.3f) : scaled) << b << "," << i << "," << j;
      }
      for (int64_t j = r; j < x.ld; ++j) EXPECT_EQ(x.get(b, i, j), x0.get(b, i, j));  // padding untouched
    }
  }
  be_->mirror_upper(v);
  get(v, x);
  for (int64_t b = 0; b < count; ++b)
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < i; ++j) EXPECT_EQ(x.get(b, i, j), x.get(b, j, i));
  be_->fill(v, 3.0f);
  get(v, x);
  EXPECT_EQ(x.get(1, 5, 5), 3.0f);
  EXPECT_EQ(x.get(0, 0, 0), 3.0f);
}

// Newton–Schulz's default compute dtype on the CPU, the machine faked both ways: bf16 matrix units give bf16, none float32;
// DMUON_NS_DEFAULT_DTYPE forces either whatever the machine (unset or empty: not forced); another value is refused,
// naming the variable. The process's default is that rule on its own CPU and environment.
TEST(NsDefaultDtype, FollowsTheMachineUnlessForced) {
  for (const char* unset : {static_cast<const char*>(nullptr), ""}) {
    EXPECT_EQ(ns_default_dtype_rule(true, unset), DType::bf16);
    EXPECT_EQ(ns_default_dtype_rule(false, unset), DType::f32);
  }
  for (const bool bf16_units : {true, false}) {
    EXPECT_EQ(ns_default_dtype_rule(bf16_units, "bf16"), DType::bf16);
    EXPECT_EQ(ns_default_dtype_rule(bf16_units, "f32"), DType::f32);
    try {
      ns_default_dtype_rule(bf16_units, "bfloat16");
      ADD_FAILURE() << "DMUON_NS_DEFAULT_DTYPE=bfloat16 accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("DMUON_NS_DEFAULT_DTYPE must be bf16 or f32"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(cpu_ns_default_dtype(), ns_default_dtype_rule(cpu_bf16::matrix_units(), std::getenv("DMUON_NS_DEFAULT_DTYPE")));
}

// The CPU's bf16 SYRK in block rows (n/128 tiles: 3 here, each row block [lo, hi) times the columns lo…) equals the
// general product bit for bit, both ways and with beta·C, on small integers whose float32 sums are exact: every
// element of the upper triangle is computed, the lower one mirrored, the row stride's padding untouched.
TEST(CpuBf16Syrk, BlockRowsEqualTheGeneralProduct) {
  if (!cpu_bf16::available()) GTEST_SKIP() << "a build without oneDNN computes no bf16";
  const int64_t n = 400, k = 24, ldc = n + 3;
  std::mt19937 gen(61);
  std::uniform_int_distribution<int> small(-3, 3);
  std::vector<uint16_t> a(n * k), c0(n * ldc);
  for (auto& x : a) x = bf16_bits(static_cast<float>(small(gen)));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = i; j < ldc; ++j) c0[i * ldc + j] = c0[j < n ? j * ldc + i : i * ldc + j] =
        bf16_bits(static_cast<float>(small(gen)));
  for (const bool trans : {false, true}) {
    // A as n×k, or with trans its transpose stored k×n (the same op(A)).
    std::vector<uint16_t> stored(n * k);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t p = 0; p < k; ++p) stored[trans ? p * n + i : i * k + p] = a[i * k + p];
    const int64_t lda = trans ? n : k;
    std::vector<uint16_t> tiled = c0, general = c0;
    cpu_bf16::syrk(trans, n, k, 0.5f, stored.data(), lda, -2.0f, tiled.data(), ldc);
    cpu_bf16::gemm(trans, !trans, n, n, k, 0.5f, stored.data(), lda, stored.data(), lda, -2.0f, general.data(), ldc);
    EXPECT_EQ(tiled, general) << "trans " << trans;
  }
}

// Whether bf16 competes with float32 in a tuning for calls that ask for no dtype: on the machine's answer (bf16
// instructions that oneDNN uses), faked both ways, unless DMUON_NS_DEFAULT_DTYPE forces a default.
TEST(NsBf16Candidate, FollowsTheMachineUnlessForced) {
  for (const bool bf16_products : {true, false}) {
    EXPECT_EQ(ns_bf16_candidate_rule(bf16_products, nullptr), bf16_products);
    EXPECT_EQ(ns_bf16_candidate_rule(bf16_products, ""), bf16_products);
    EXPECT_TRUE(ns_bf16_candidate_rule(bf16_products, "bf16"));
    EXPECT_FALSE(ns_bf16_candidate_rule(bf16_products, "f32"));
    EXPECT_THROW(ns_bf16_candidate_rule(bf16_products, "bfloat16"), Error);
  }
  EXPECT_EQ(cpu_ns_bf16_candidate(), ns_bf16_candidate_rule(cpu_bf16::native(), std::getenv("DMUON_NS_DEFAULT_DTYPE")));
}

INSTANTIATE_TEST_SUITE_P(Backends, DtypeConformance,
                         ::testing::Combine(::testing::Values("cpu", "cuda", "fenced"),
                                            ::testing::Values(DType::f32, DType::bf16)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace dmuon
