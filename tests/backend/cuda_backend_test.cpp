// Conformance of the CUDA backend with the CPU backend (as ggml's test-backend-ops): every operation runs on both
// from the same host inputs and the results are compared — products within the float32 error bound of a dot
// product (plus bf16's rounding of a bf16 result), elementwise ops and the update rules bit for bit, reductions
// in double to 1e-12. Strided views (row stride > width, gaps between batch matrices) hold NaN outside the
// matrices, so a kernel that reads or writes outside its view shows. Skips, saying why, without a CUDA build or
// a CUDA device.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/cuda/tile_grid.hpp"
#include "cuda_device.hpp"
#include "dmuon/backend.hpp"
#include "dmuon/error.hpp"
#include "dmuon/update_rules.hpp"
#include "strided_batch.hpp"
#ifdef DMUON_HAVE_CUDA
#include "backend/cuda/cuda_backend.hpp"  // cuda::blas_math_mode, cuda::device_count
#endif

namespace dmuon {
namespace {

using test::Batch;

// bf16 round to nearest even of a finite float, on the host.
float round_bf16(float x) {
  uint32_t bits = std::bit_cast<uint32_t>(x);
  bits += 0x7fff + ((bits >> 16) & 1);
  return std::bit_cast<float>(bits & 0xffff0000u);
}

void round_all_bf16(Batch& b) {
  for (float& x : b.data)
    if (!std::isnan(x)) x = round_bf16(x);
}

// A host batch copied to a backend, as a view of the same strides (and, for bf16, a converted copy).
struct OnBackend {
  Backend& backend;
  Buffer f32;
  Buffer narrow;  // bf16 copy when asked
  MatView view;

  OnBackend(Backend& b, const Batch& host, DType dtype = DType::f32)
      : backend(b), f32(b, DType::f32, static_cast<int64_t>(host.data.size())) {
    f32.upload(host.data);
    view = MatView{f32.data(), b.device(), DType::f32, host.rows, host.cols, host.ld, host.count, host.stride};
    if (dtype == DType::bf16) {
      narrow = Buffer(b, DType::bf16, static_cast<int64_t>(host.data.size()));
      MatView v = view;
      v.data = narrow.data();
      v.dtype = DType::bf16;
      b.convert(view, v);
      view = v;
    }
  }
  // The values of the view (converted back to float32 when bf16) into `host`'s matrices.
  void download(Batch& host) {
    if (view.dtype == DType::bf16) {
      MatView v = view;
      v.data = f32.data();
      v.dtype = DType::f32;
      backend.convert(view, v);
    }
    f32.download(host.data);
  }
};

// Device doubles (norms, sums).
struct Doubles {
  Backend& backend;
  double* data;
  int64_t n;
  Doubles(Backend& b, int64_t count) : backend(b), data(static_cast<double*>(b.allocate(sizeof(double) * count))), n(count) {}
  ~Doubles() { backend.deallocate(data); }
  std::vector<double> read() {
    std::vector<double> out(n);
    backend.copy_to_host(out.data(), data, sizeof(double) * n);
    return out;
  }
};

void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
        << what << " differs at " << i << ": " << got[i] << " vs " << want[i];
}

using CudaBackendTest = test::CudaDeviceTest;

// Runs without a device (plain C++): the tile kernels' grid stays within CUDA's 65535 blocks in y past 2.1 M rows,
// and names every row tile for the kernels to stride over (dmuon_gpu_check's tall transpose runs it on a GPU).
TEST(CudaTileGrid, StaysWithinTheGridLimitsAndCoversEveryRowTile) {
  const cuda::TileGrid small = cuda::tile_grid(100, 70, 3, 32);
  EXPECT_EQ(small.x, 3u);
  EXPECT_EQ(small.y, 4u);
  EXPECT_EQ(small.z, 3u);
  EXPECT_EQ(small.row_tiles, 4);
  const cuda::TileGrid tall = cuda::tile_grid(2'200'001, 3, 1, 32);
  EXPECT_EQ(tall.x, 1u);
  EXPECT_EQ(tall.y, 65535u);
  EXPECT_EQ(tall.row_tiles, 68751);
  EXPECT_THROW(cuda::tile_grid(10, 10, 65536, 32), Error);
}

// Runs without a device: the sums of squares take more than 65535 vectors (NorMuon's row norms of a 151,936-row
// embedding, Qwen's vocabulary) with y at 65535 blocks, the kernel striding over the rest, instead of refusing them.
TEST(CudaReductionGrid, TakesMoreVectorsThanTheGridHasRows) {
  const cuda::ReductionGrid vocab = cuda::reduction_grid(896, 151'936, 256);
  EXPECT_EQ(vocab.y, 65535u);
  EXPECT_EQ(vocab.parts, 1u);
  const cuda::ReductionGrid matrices = cuda::reduction_grid(4096 * 4096, 3, 256);
  EXPECT_EQ(matrices.y, 3u);
  EXPECT_EQ(matrices.parts, 128u);
  EXPECT_EQ(cuda::reduction_grid(256 * 16 * 5, 1, 256).parts, 5u);
}

// ---- products ----

#ifdef DMUON_HAVE_CUDA
// Runs without a device: the handle's math mode never lets cuBLAS sum bf16 products' partials in bf16.
TEST(CudaBackendMathMode, AccumulatesInFloat32WithAndWithoutTf32) {
  for (bool tf32 : {false, true}) {
    const int mode = cuda::blas_math_mode(tf32);
    EXPECT_TRUE(mode & CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION) << "tf32 " << tf32;
    EXPECT_EQ(mode & 0xf, tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_PEDANTIC_MATH) << "tf32 " << tf32;
  }
}
#endif

// Runs without a device: the public count (backend.hpp) is the CUDA runtime's where this build has the backend,
// and a host backend has no native queue.
TEST(DeviceCount, CountsWhatThisBuildCanUse) {
  EXPECT_EQ(device_count(DeviceKind::cpu), 1);
  EXPECT_EQ(device_count(DeviceKind::record), 1);
#ifdef DMUON_HAVE_CUDA
  EXPECT_EQ(device_count(DeviceKind::cuda), cuda::device_count());
#else
  EXPECT_EQ(device_count(DeviceKind::cuda), 0);
#endif
  EXPECT_EQ(cpu_backend().native_queue(), nullptr);
}

// Code above the seam orders its own work with a CUDA backend's through native_queue(): the backend's stream.
TEST_F(CudaBackendTest, NativeQueueIsTheBackendsStream) {
  EXPECT_NE(gpu->native_queue(), nullptr);
  EXPECT_EQ(gpu->native_queue(), gpu->properties().native_queue);
}

struct ProductCase {
  bool ta, tb;
  int64_t m, n, k, count;
  DType operands, result;
};

class CudaGemm : public CudaBackendTest, public ::testing::WithParamInterface<ProductCase> {};

TEST_P(CudaGemm, MatchesCpuBackend) {
  const ProductCase p = GetParam();
  Batch a(p.ta ? p.k : p.m, p.ta ? p.m : p.k, 3, p.count, 1), b(p.tb ? p.n : p.k, p.tb ? p.k : p.n, 1, p.count, 2);
  Batch c0(p.m, p.n, 2, p.count, 3);
  if (p.operands == DType::bf16) {
    round_all_bf16(a);  // the CPU computes with the operands the GPU sees
    round_all_bf16(b);
  }
  if (p.result == DType::bf16) round_all_bf16(c0);
  const float alpha = 0.75f, beta = -0.5f;
  Batch want = c0, got = c0;
  {
    OnBackend da(cpu, a), db(cpu, b), dc(cpu, c0);
    cpu.gemm(p.ta, p.tb, alpha, da.view, db.view, beta, dc.view);
    dc.download(want);
  }
  OnBackend da(*gpu, a, p.operands), db(*gpu, b, p.operands), dc(*gpu, c0, p.result);
  gpu->gemm(p.ta, p.tb, alpha, da.view, db.view, beta, dc.view);
  dc.download(got);
  test::expect_close(got, want, test::product_bound(a, p.ta, b, p.tb, alpha, beta, c0), p.k,
                     p.result == DType::bf16 ? 1.0 / 256 : 0.0);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaGemm,
    ::testing::Values(ProductCase{false, false, 33, 17, 65, 1, DType::f32, DType::f32},
                      ProductCase{true, false, 17, 33, 9, 3, DType::f32, DType::f32},
                      ProductCase{false, true, 40, 29, 40, 2, DType::f32, DType::f32},
                      ProductCase{true, true, 31, 1, 12, 4, DType::f32, DType::f32},
                      ProductCase{false, false, 130, 70, 257, 1, DType::bf16, DType::f32},
                      ProductCase{false, true, 64, 96, 33, 3, DType::bf16, DType::bf16},
                      ProductCase{true, false, 45, 45, 128, 2, DType::bf16, DType::bf16}));

struct SymmetricCase {
  int op;  // 0: syrk, 1: syrk transposed, 2: symmetric_gemm
  int64_t m, k, count;
  int tiles;
  DType dtype;
};

class CudaSymmetric : public CudaBackendTest, public ::testing::WithParamInterface<SymmetricCase> {};

TEST_P(CudaSymmetric, MatchesCpuBackend) {
  const SymmetricCase p = GetParam();
  const bool trans = p.op == 1;
  Batch a(trans ? p.k : p.m, trans ? p.m : p.k, 2, p.count, 4), b(p.k, p.m, 1, p.count, 5);
  Batch c0(p.m, p.m, 3, p.count, 6);
  c0.symmetrise();
  if (p.dtype == DType::bf16) {
    round_all_bf16(a);
    round_all_bf16(b);
    round_all_bf16(c0);
  }
  const float alpha = 1.25f, beta = 0.5f;
  auto run = [&](Backend& be, DType dtype, Batch& out) {
    OnBackend da(be, a, dtype), db(be, b, dtype), dc(be, c0, dtype);
    if (p.op == 2)
      be.symmetric_gemm(alpha, da.view, db.view, beta, dc.view, p.tiles);
    else
      be.syrk(trans, alpha, da.view, beta, dc.view);
    dc.download(out);
  };
  Batch want = c0, got = c0;
  run(cpu, DType::f32, want);
  run(*gpu, p.dtype, got);
  const auto bound = p.op == 2 ? test::product_bound(a, false, b, false, alpha, beta, c0)
                               : test::product_bound(a, trans, a, !trans, alpha, beta, c0);
  test::expect_close(got, want, bound, p.k, p.dtype == DType::bf16 ? 1.0 / 256 : 0.0);
  for (int64_t s = 0; s < p.count; ++s)  // exactly symmetric: mirrored
    for (int64_t i = 0; i < p.m; ++i)
      for (int64_t j = 0; j < i; ++j) ASSERT_EQ(got.at(s, i, j), got.at(s, j, i));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaSymmetric,
                         ::testing::Values(SymmetricCase{0, 70, 33, 1, 1, DType::f32},
                                           SymmetricCase{1, 70, 33, 1, 1, DType::f32},
                                           SymmetricCase{0, 45, 100, 3, 1, DType::f32},
                                           SymmetricCase{1, 600, 64, 1, 1, DType::bf16},
                                           SymmetricCase{0, 1100, 40, 2, 1, DType::bf16},
                                           SymmetricCase{2, 13, 9, 1, 3, DType::f32},
                                           SymmetricCase{2, 100, 37, 3, 4, DType::f32},
                                           SymmetricCase{2, 257, 64, 1, 5, DType::bf16},
                                           SymmetricCase{2, 96, 96, 4, 2, DType::bf16}));

// ---- elementwise ----

TEST_F(CudaBackendTest, ElementwiseOpsMatchCpuBitForBit) {
  Batch x(37, 37, 3, 3, 7);
  auto run = [&](Backend& be) {
    std::vector<Batch> out;
    {
      OnBackend d(be, x);
      be.scale(d.view, -1.7f);
      be.add_identity(d.view, 0.3f);
      out.push_back(x);
      d.download(out.back());
      be.mirror_upper(d.view);
      out.push_back(x);
      d.download(out.back());
    }
    {
      OnBackend d(be, x);
      Batch t(x.cols, x.rows, 2, x.count, 9);
      OnBackend dt(be, t);
      be.transpose(d.view, dt.view);
      dt.download(t);
      out.push_back(t);
      be.fill(d.view, 2.5f);
      out.push_back(x);
      d.download(out.back());
    }
    return out;
  };
  const auto want = run(cpu), got = run(*gpu);
  const char* names[] = {"scale + add_identity", "mirror_upper", "transpose", "fill"};
  for (size_t i = 0; i < want.size(); ++i) expect_same_bits(got[i].data, want[i].data, names[i]);
}

TEST_F(CudaBackendTest, ConvertRoundsToNearestEven) {
  Batch x(19, 23, 2, 2, 11);
  x.at(0, 0, 0) = 1.0f + 1.0f / 256;             // a tie: rounds to even (1.0)
  x.at(0, 0, 1) = 1.0f + 3.0f / 256;             // a tie: rounds to even (1 + 1/64)
  x.at(1, 3, 4) = std::numeric_limits<float>::infinity();
  Batch want = x;
  round_all_bf16(want);
  want.at(1, 3, 4) = std::numeric_limits<float>::infinity();
  Batch got = x;
  OnBackend d(*gpu, x, DType::bf16);
  d.download(got);
  expect_same_bits(got.data, want.data, "f32 -> bf16 -> f32");
}

TEST_F(CudaBackendTest, NormsAndNormalisationMatchCpu) {
  Batch x(50, 70, 3, 4, 13);
  x.at(2, 5, 6) = std::nanf("");
  x.at(3, 7, 8) = std::numeric_limits<float>::infinity();
  auto run = [&](Backend& be, DType dtype, std::vector<double>& norms) {
    OnBackend d(be, x, dtype);
    Doubles n(be, x.count);
    be.frobenius_norms(d.view, n.data);
    be.scale_by_inverse_norm(d.view, n.data, 1.01, 1e-7);
    norms = n.read();
    Batch out = x;
    d.download(out);
    return out;
  };
  std::vector<double> want_norms, got_norms;
  const Batch want = run(cpu, DType::f32, want_norms), got = run(*gpu, DType::f32, got_norms);
  EXPECT_TRUE(std::isnan(got_norms[2]));
  EXPECT_TRUE(std::isinf(got_norms[3]));
  for (int s = 0; s < 2; ++s) {
    EXPECT_NEAR(got_norms[s], want_norms[s], 1e-12 * want_norms[s]) << "matrix " << s;
    for (int64_t i = 0; i < x.rows; ++i)
      for (int64_t j = 0; j < x.cols; ++j)  // the float scale may differ by one rounding of the double norm
        ASSERT_NEAR(got.at(s, i, j), want.at(s, i, j), 2 * std::abs(want.at(s, i, j)) * FLT_EPSILON);
  }
}

// ---- the update rules ----

std::vector<float> random_values(int64_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// Every rule and option on the GPU gives the CPU's bits (which backend_conformance_test checks against plain loops):
// u aliasing grad, a device grad scale, keep 1 and 0, an empty gradient.
TEST_F(CudaBackendTest, UpdateRulesMatchCpuBitForBit) {
  const int64_t n = 100003;
  const auto grad = random_values(n, 1, -2, 2), p0 = random_values(n, 2, -1, 1), m0 = random_values(n, 3, -0.1f, 0.1f);
  const auto v0 = random_values(n, 4, 0, 0.01f), o = random_values(n, 5, -1, 1);
  const AdamWStepConstants k{0.9999f, 0.1f, 0.95f, 0.05f, 0.0123f, 0.3f, 1e-8f};
  auto run = [&](Backend& be) {
    std::vector<Buffer> b;
    for (const auto* host : {&grad, &p0, &m0, &v0, &o, &m0, &m0, &o, &m0, &o, &m0, &o, &p0}) {
      b.emplace_back(be, DType::f32, n);
      b.back().upload(*host);
    }
    Buffer scalars(be, DType::f32, 3);  // {grad scale, keep 1, keep 0}
    scalars.upload(std::vector<float>{0.25f, 1.0f, 0.0f});
    const float *device_scale = scalars.f32(), *kept = scalars.f32() + 1, *dropped = scalars.f32() + 2;
    const auto at = [&](size_t i) { return DeviceSpan(be, b[i].f32(), static_cast<size_t>(n)); };
    const auto momentum = [&](DeviceSpan<const float> g, size_t m, size_t u, bool nesterov, float scale,
                              const float* device_grad_scale, const float* keep) {
      be.run({rules::MuonMomentum{.grad = g,
                                  .momentum = at(m),
                                  .u = at(u),
                                  .one_minus_beta = 0.05f,
                                  .beta = 0.95f,
                                  .nesterov = nesterov,
                                  .grad_scale = scale,
                                  .device_grad_scale = device_grad_scale,
                                  .keep = keep}});
    };
    be.run({rules::Accumulate{.acc = at(5), .grad = at(0), .first = false}});  // b5 = m0 + grad
    be.run({rules::Accumulate{.acc = at(4), .grad = at(0), .first = true}});   // b4 = grad
    be.run({rules::AdamWStep{.p = at(1), .grad = at(0), .m = at(2), .v = at(3), .k = k, .grad_scale = 0.5f}});
    momentum(at(0), 2, 0, true, 0.25f, nullptr, nullptr);  // u aliases grad
    momentum(at(4), 3, 4, false, 1.0f, nullptr, nullptr);
    momentum(at(5), 6, 7, true, 9.0f, device_scale, kept);  // the device scale replaces 9
    momentum(at(5), 8, 9, true, 1.0f, nullptr, dropped);
    momentum({}, 10, 11, false, 0.5f, nullptr, nullptr);
    be.run({rules::MuonApply{.w = at(1), .o = at(5), .decay = 0.999f, .neg_lr = -0.02f, .scale = 1.5f}});
    be.run({rules::MuonApply{
        .w = at(12), .o = at(5), .decay = 0.999f, .neg_lr = -0.02f, .scale = 1.5f, .keep = dropped}});
    Doubles sum(be, 1);
    be.run({rules::SumOfSquares{.grad = at(5), .grad_scale = 0.5f, .sum = sum.data}});
    std::vector<std::vector<float>> out(b.size(), std::vector<float>(n));
    for (size_t i = 0; i < b.size(); ++i) b[i].download(out[i]);
    return std::make_pair(out, sum.read()[0]);
  };
  const auto [want, want_sum] = run(cpu);
  const auto [got, got_sum] = run(*gpu);
  const char* names[] = {"nesterov u",       "weights",           "adam m / momentum",       "adam v / momentum",
                         "plain u",          "accumulated",       "device scale momentum",   "device scale u",
                         "keep 0 momentum",  "keep 0 u",          "empty gradient momentum", "empty gradient u",
                         "keep 0 weights"};
  for (size_t i = 0; i < want.size(); ++i) expect_same_bits(got[i], want[i], names[i]);
  expect_same_bits(got[12], p0, "keep 0 weights unchanged");
  expect_same_bits(got[8], m0, "keep 0 momentum unchanged");
  EXPECT_NEAR(got_sum, want_sum, 1e-12 * want_sum);
}

// NorMuonNormalize on the GPU against the CPU over two steps: the GPU sums each row as a tree, the CPU in order, so
// a row's Σ O² may differ in its last bits of a double, which reach v and the ratio after their rounding to float32
// at most once in a while: within 2 ulps of v and 4 of the largest |O| per step.
TEST_F(CudaBackendTest, NorMuonNormalizeMatchesCpu) {
  const int64_t rows = 300, cols = 1000, n = rows * cols;
  const auto o0 = random_values(n, 6, -1, 1), o1 = random_values(n, 7, -0.5f, 0.5f);
  auto run = [&](Backend& be) {
    Buffer o(be, DType::f32, n), v(be, DType::f32, rows);
    v.upload(std::vector<float>(rows, 0.0f));
    for (const auto* host : {&o0, &o1}) {
      o.upload(*host);
      be.run({rules::NorMuonNormalize{.o = DeviceSpan(be, o.f32(), static_cast<size_t>(n)),
                                      .v = DeviceSpan(be, v.f32(), static_cast<size_t>(rows)),
                                      .rows = rows,
                                      .cols = cols,
                                      .one_minus_beta2 = 0.05f}});
    }
    std::vector<float> out(n), moments(rows);
    o.download(out);
    v.download(moments);
    return std::make_pair(out, moments);
  };
  const auto [want_o, want_v] = run(cpu);
  const auto [got_o, got_v] = run(*gpu);
  float largest = 0;
  for (float x : want_o) largest = std::max(largest, std::abs(x));
  for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(got_o[i], want_o[i], 8 * 6e-8 * largest) << "element " << i;
  for (int64_t r = 0; r < rows; ++r) ASSERT_NEAR(got_v[r], want_v[r], 4 * 6e-8 * want_v[r]) << "row " << r;
}

// ---- ordering ----

TEST_F(CudaBackendTest, ConcurrentQueuesAndEvents) {
  Batch x(64, 48, 0, 3, 17);
  Batch want = x, got = x;
  for (int64_t s = 0; s < x.count; ++s)
    for (int64_t i = 0; i < x.rows; ++i)
      for (int64_t j = 0; j < x.cols; ++j) want.at(s, i, j) = x.at(s, i, j) * static_cast<float>(s + 2);
  OnBackend d(*gpu, x);
  gpu->run_concurrently(3, [&](Backend& queue, int w) {
    EXPECT_NE(&queue, gpu);
    queue.scale(d.view.matrix(w), static_cast<float>(w + 2));
  });
  gpu->record_event()->wait();
  d.download(got);
  expect_same_bits(got.data, want.data, "scaled on three streams");
  EXPECT_EQ(gpu->parallelism(), 1);
  EXPECT_FALSE(gpu->host_memory());
  EXPECT_TRUE(gpu->supports(DType::bf16));
}

// ---- graphs ----

// run_graph records fn once per key and replays the recording: fn runs once per key, every call's work is done,
// a new address (a new key) records anew, and a host read inside fn is refused.
TEST_F(CudaBackendTest, GraphsRecordOncePerKeyAndReplay) {
  Batch x(32, 24, 0, 1, 5);
  OnBackend a(*gpu, x), b(*gpu, x);
  int calls = 0;
  const auto doubled = [&](OnBackend& d) {
    const std::vector<int64_t> key = {1, static_cast<int64_t>(reinterpret_cast<intptr_t>(d.view.data))};
    gpu->run_graph(key, [&] {
      ++calls;
      gpu->scale(d.view, 2.0f);
    });
  };
  doubled(a);
  doubled(a);
  doubled(a);
  doubled(b);
  EXPECT_EQ(calls, 2);
  Batch got_a = x, got_b = x, want_a = x, want_b = x;
  for (int64_t i = 0; i < x.rows; ++i)
    for (int64_t j = 0; j < x.cols; ++j) want_a.at(0, i, j) *= 8.0f, want_b.at(0, i, j) *= 2.0f;
  a.download(got_a);
  b.download(got_b);
  expect_same_bits(got_a.data, want_a.data, "three launches of one graph");
  expect_same_bits(got_b.data, want_b.data, "another key's graph");
  float host = 0;
  EXPECT_THROW(gpu->run_graph({2}, [&] { gpu->copy_to_host(&host, a.view.data, sizeof host); }), Error);
  gpu->synchronize();  // the backend is usable after a refused capture
}

}  // namespace
}  // namespace dmuon
