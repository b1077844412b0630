// dmuon_gpu_check's kernel checks (kernel_checks.hpp).
#include "kernel_checks.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/bf16.hpp"
#include "backend/cuda_support.hpp"  // cuda::query_event
#include "backend/rules/accumulate.hpp"
#include "backend/rules/adamw_step.hpp"
#include "backend/rules/muon_apply.hpp"
#include "backend/rules/muon_momentum.hpp"
#include "backend/rules/normuon_normalize.hpp"
#include "backend/rules/sum_of_squares.hpp"
#include "dmuon/error.hpp"
#include "dmuon/update_rules.hpp"

namespace dmuon {
namespace {

constexpr float kGap = -12345.0f;  // what lies between rows and matrices: must never change

// float32 as stored in `dtype`.
float stored(DType dtype, float x) { return dtype == DType::bf16 ? round_to_bf16(x) : x; }

// A host image of a strided batch of `dtype` with gaps (ld > cols, stride > rows·ld) holding kGap.
struct HostBatch {
  DType dtype;
  int64_t rows, cols, ld, count, stride;
  std::vector<float> v;  // every element, gaps included, as float (bf16-exact when dtype is bf16)

  HostBatch(DType t, int64_t r, int64_t c, int64_t n, uint32_t seed)
      : dtype(t), rows(r), cols(c), ld(c + 3), count(n), stride(r * (c + 3) + 5) {
    v.assign(static_cast<size_t>(stride * count), kGap);
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t b = 0; b < count; ++b)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) at(b, i, j) = stored(dtype, normal(rng));
  }
  float& at(int64_t b, int64_t i, int64_t j) { return v[b * stride + i * ld + j]; }
  float at(int64_t b, int64_t i, int64_t j) const { return v[b * stride + i * ld + j]; }
  size_t bytes() const { return v.size() * dtype_size(dtype); }
};

// A device copy of a host batch and its view.
struct DeviceBatch {
  Buffer buffer;
  MatView view;
  DeviceBatch(Backend& gpu, const HostBatch& h) : buffer(gpu, h.dtype, static_cast<int64_t>(h.v.size())) {
    std::vector<char> bytes(h.bytes());
    for (size_t i = 0; i < h.v.size(); ++i) {
      if (h.dtype == DType::f32) {
        std::memcpy(bytes.data() + 4 * i, &h.v[i], 4);
      } else {
        const uint16_t b = bf16_bits(h.v[i]);
        std::memcpy(bytes.data() + 2 * i, &b, 2);
      }
    }
    gpu.copy_from_host(buffer.data(), bytes.data(), bytes.size());
    view = {buffer.data(), DeviceKind::cuda, h.dtype, h.rows, h.cols, h.ld, h.count, h.stride};
  }
  HostBatch read(Backend& gpu, HostBatch like) const {
    std::vector<char> bytes(like.bytes());
    gpu.copy_to_host(bytes.data(), buffer.data(), bytes.size());
    for (size_t i = 0; i < like.v.size(); ++i) {
      if (like.dtype == DType::f32) {
        std::memcpy(&like.v[i], bytes.data() + 4 * i, 4);
      } else {
        uint16_t b;
        std::memcpy(&b, bytes.data() + 2 * i, 2);
        like.v[i] = bf16_value(b);
      }
    }
    return like;
  }
};

// Elements that differ in bits (NaN equal to NaN), gaps included.
int64_t bit_differences(const HostBatch& got, const HostBatch& want) {
  int64_t n = 0;
  for (size_t i = 0; i < got.v.size(); ++i)
    if (std::bit_cast<uint32_t>(got.v[i]) != std::bit_cast<uint32_t>(want.v[i]) &&
        !(std::isnan(got.v[i]) && std::isnan(want.v[i])))
      ++n;
  return n;
}

std::vector<float> device_floats(const Buffer& b) {
  std::vector<float> out(static_cast<size_t>(b.size()));
  b.download(out);
  return out;
}

void check_elementwise(Backend& gpu, CheckLog& log) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    std::string t(" ");  // appended, not "a" + b: GCC 12's -Wrestrict misfires on that concatenation here
    t.append(to_string(dtype)).append(" strided batch");
    const HostBatch x(dtype, 37, 45, 3, 1), square(dtype, 41, 41, 3, 2);
    const auto expect_same = [&](const HostBatch& got, const HostBatch& want, const std::string& what) {
      const auto bad = bit_differences(got, want);
      log.report(bad == 0, what + t + ": elements off (bits, gaps included)", static_cast<double>(bad), 0);
    };
    {
      DeviceBatch d(gpu, x);
      gpu.fill(d.view, 0.75f);
      HostBatch want = x;
      for (int64_t b = 0; b < x.count; ++b)
        for (int64_t i = 0; i < x.rows; ++i)
          for (int64_t j = 0; j < x.cols; ++j) want.at(b, i, j) = 0.75f;
      expect_same(d.read(gpu, x), want, "fill");
    }
    {
      DeviceBatch d(gpu, x);
      gpu.scale(d.view, 1.3f);
      HostBatch want = x;
      for (int64_t b = 0; b < x.count; ++b)
        for (int64_t i = 0; i < x.rows; ++i)
          for (int64_t j = 0; j < x.cols; ++j) want.at(b, i, j) = stored(dtype, x.at(b, i, j) * 1.3f);
      expect_same(d.read(gpu, x), want, "scale");
    }
    {
      DeviceBatch d(gpu, square);
      gpu.add_identity(d.view, 0.625f);
      HostBatch want = square;
      for (int64_t b = 0; b < square.count; ++b)
        for (int64_t i = 0; i < square.rows; ++i) want.at(b, i, i) = stored(dtype, square.at(b, i, i) + 0.625f);
      expect_same(d.read(gpu, square), want, "add_identity");
    }
    {
      DeviceBatch d(gpu, square);
      gpu.mirror_upper(d.view);
      HostBatch want = square;
      for (int64_t b = 0; b < square.count; ++b)
        for (int64_t i = 0; i < square.rows; ++i)
          for (int64_t j = 0; j < i; ++j) want.at(b, i, j) = square.at(b, j, i);
      expect_same(d.read(gpu, square), want, "mirror_upper");
    }
    // Out of place from x into a fresh batch (its own strides and gaps) whose expected elements `want` sets.
    const auto into = [&](const HostBatch& out_host, const std::string& what,
                          const std::function<void(const MatView&, const MatView&)>& op,
                          const std::function<float(int64_t, int64_t, int64_t, HostBatch&)>& want_at) {
      DeviceBatch in(gpu, x), out(gpu, out_host);
      op(in.view, out.view);
      HostBatch want = out_host;
      for (int64_t b = 0; b < x.count; ++b)
        for (int64_t i = 0; i < x.rows; ++i)
          for (int64_t j = 0; j < x.cols; ++j) want_at(b, i, j, want);
      expect_same(out.read(gpu, out_host), want, what);
    };
    into(HostBatch(dtype, x.cols, x.rows, x.count, 3), "transpose",
         [&](const MatView& in, const MatView& out) { gpu.transpose(in, out); },
         [&](int64_t b, int64_t i, int64_t j, HostBatch& want) { return want.at(b, j, i) = x.at(b, i, j); });
    const DType other = dtype == DType::f32 ? DType::bf16 : DType::f32;
    into(HostBatch(other, x.rows, x.cols, x.count, 4), "convert to " + to_string(other) + " of a",
         [&](const MatView& in, const MatView& out) { gpu.convert(in, out); },
         [&](int64_t b, int64_t i, int64_t j, HostBatch& want) { return want.at(b, i, j) = stored(other, x.at(b, i, j)); });
    {  // norms in double against a float64 sum; NaN and Inf flagged; then the normalisation by them, bit for bit
      HostBatch h = x;
      h.at(1, 3, 4) = std::nanf("");
      h.at(2, 0, 0) = INFINITY;
      DeviceBatch d(gpu, h);
      Buffer norms(gpu, DType::f32, 2 * h.count);
      gpu.frobenius_norms(d.view, reinterpret_cast<double*>(norms.data()));
      std::vector<double> got(h.count);
      gpu.copy_to_host(got.data(), norms.data(), sizeof(double) * h.count);
      double s = 0;
      for (int64_t i = 0; i < h.rows; ++i)
        for (int64_t j = 0; j < h.cols; ++j) s += double(h.at(0, i, j)) * h.at(0, i, j);
      const double rel = std::abs(got[0] - std::sqrt(s)) / std::sqrt(s);
      log.report(rel <= 1e-12, "frobenius_norms" + t + ": relative error", rel, 1e-12);
      log.expect(std::isnan(got[1]) && std::isinf(got[2]), "frobenius_norms" + t + ": NaN and Inf matrices flagged");
      DeviceBatch clean(gpu, x);
      gpu.frobenius_norms(clean.view, reinterpret_cast<double*>(norms.data()));
      gpu.copy_to_host(got.data(), norms.data(), sizeof(double) * h.count);
      gpu.scale_by_inverse_norm(clean.view, reinterpret_cast<const double*>(norms.data()), 1.01, 1e-7);
      HostBatch want = x;
      for (int64_t b = 0; b < x.count; ++b) {
        const auto factor = static_cast<float>(1.0 / (got[b] * 1.01 + 1e-7));  // as the CPU: no FMA
        for (int64_t i = 0; i < x.rows; ++i)
          for (int64_t j = 0; j < x.cols; ++j) want.at(b, i, j) = stored(dtype, x.at(b, i, j) * factor);
      }
      expect_same(clean.read(gpu, x), want, "scale_by_inverse_norm");
    }
  }
}

// A transpose of more rows than 65535 tiles of 32 (the grid's y limit): the tile kernels stride over the row tiles
// past it (src/backend/cuda/tile_grid.hpp), so every element still moves, bit for bit.
void check_tall_transpose(Backend& gpu, CheckLog& log) {
  const HostBatch x(DType::f32, 2'200'001, 3, 1, 4), out_host(DType::f32, 3, 2'200'001, 1, 5);
  DeviceBatch in(gpu, x), out(gpu, out_host);
  gpu.transpose(in.view, out.view);
  HostBatch want = out_host;
  for (int64_t i = 0; i < x.rows; ++i)
    for (int64_t j = 0; j < x.cols; ++j) want.at(0, j, i) = x.at(0, i, j);
  const auto bad = bit_differences(out.read(gpu, out_host), want);
  log.report(bad == 0, "transpose 2200001x3 f32 (past the grid's 65535 row tiles): elements off (bits)",
             static_cast<double>(bad), 0);
}

void check_update_rules(Backend& gpu, CheckLog& log) {
  const int64_t n = 100003;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto values = [&](float scale) {
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng) * scale;
    return v;
  };
  const std::vector<float> p0 = values(1.0f), g1 = values(1e-2f), g2 = values(1e-2f);
  const auto upload = [&](const std::vector<float>& v) {
    Buffer b(gpu, DType::f32, n);
    b.upload(v);
    return b;
  };
  const auto same = [&](const Buffer& got, const std::vector<float>& want, const std::string& what) {
    const std::vector<float> g = device_floats(got);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad += std::bit_cast<uint32_t>(g[i]) != std::bit_cast<uint32_t>(want[i]);
    log.report(bad == 0, what + ": values off the host loop (bits)", static_cast<double>(bad), 0);
  };
  const auto span = [&](const Buffer& b) { return DeviceSpan(gpu, b.f32(), static_cast<size_t>(b.size())); };
  {
    Buffer grad = upload(g1), sum(gpu, DType::f32, 2);
    double* device_sum = reinterpret_cast<double*>(sum.data());
    gpu.run({rules::SumOfSquares{.grad = span(grad), .grad_scale = 0.5f, .sum = device_sum}});
    double got = 0;
    gpu.copy_to_host(&got, sum.data(), sizeof(double));
    const double want = rules::sum_of_squares_loop(g1.data(), n, 0.5f);
    log.report(std::abs(got - want) <= 1e-12 * want, "sum_of_squares: relative error", std::abs(got - want) / want,
               1e-12);
  }
  {
    Buffer acc = upload(p0), a = upload(g1), b = upload(g2);
    gpu.run({rules::Accumulate{.acc = span(acc), .grad = span(a), .first = true}});
    gpu.run({rules::Accumulate{.acc = span(acc), .grad = span(b), .first = false}});
    std::vector<float> want = p0;
    rules::accumulate_loop(want.data(), g1.data(), n, true);
    rules::accumulate_loop(want.data(), g2.data(), n, false);
    same(acc, want, "accumulate");
  }
  {
    Buffer p = upload(p0), m = upload(std::vector<float>(n, 0.0f)), v = upload(std::vector<float>(n, 0.0f));
    std::vector<float> hp = p0, hm(n, 0.0f), hv(n, 0.0f);
    for (int t = 1; t <= 2; ++t) {
      const AdamWStepConstants k{static_cast<float>(1 - 1e-3 * 0.1), 0.1f, 0.999f, 0.001f,
                                 static_cast<float>(1e-3 / (1 - std::pow(0.9, t))),
                                 static_cast<float>(std::sqrt(1 - std::pow(0.999, t))), 1e-8f};
      Buffer g = upload(t == 1 ? g1 : g2);
      gpu.run(
          {rules::AdamWStep{.p = span(p), .grad = span(g), .m = span(m), .v = span(v), .k = k, .grad_scale = 0.5f}});
      rules::adamw_step_loop(hp.data(), (t == 1 ? g1 : g2).data(), 0.5f, hm.data(), hv.data(), n, k);
    }
    same(p, hp, "adamw_step p");
    same(m, hm, "adamw_step exp_avg");
    same(v, hv, "adamw_step exp_avg_sq");
  }
  // The device scalars: {grad scale 0.5, keep 1, keep 0}.
  Buffer scalars(gpu, DType::f32, 3);
  scalars.upload(std::vector<float>{0.5f, 1.0f, 0.0f});
  const float* device_scale = scalars.f32();
  const float* kept = scalars.f32() + 1;
  const float* dropped = scalars.f32() + 2;
  struct MomentumCase {
    const char* what;
    bool nesterov, device_scale, empty_grad;
    const float* keep;
  };
  for (const MomentumCase& c : {MomentumCase{"nesterov", true, false, false, nullptr},
                                MomentumCase{"plain", false, false, false, nullptr},
                                MomentumCase{"nesterov, device scale, keep 1", true, true, false, kept},
                                MomentumCase{"nesterov, keep 0", true, false, false, dropped},
                                MomentumCase{"plain, empty gradient", false, false, true, nullptr}}) {
    Buffer grad = upload(g1), momentum = upload(g2), u = upload(std::vector<float>(n, kGap));
    gpu.run({rules::MuonMomentum{.grad = c.empty_grad ? DeviceSpan<const float>() : span(grad),
                                 .momentum = span(momentum),
                                 .u = span(u),
                                 .one_minus_beta = 0.05f,
                                 .beta = 0.95f,
                                 .nesterov = c.nesterov,
                                 .grad_scale = c.device_scale ? 7.0f : 0.5f,
                                 .device_grad_scale = c.device_scale ? device_scale : nullptr,
                                 .keep = c.keep}});
    std::vector<float> hm = g2, hu(n);
    rules::muon_momentum_loop(c.empty_grad ? nullptr : g1.data(), 0.5f, hm.data(), hu.data(), n, 0.05f, 0.95f,
                              c.nesterov, c.keep != dropped);
    same(momentum, hm, std::string("muon_momentum (") + c.what + ") momentum");
    same(u, hu, std::string("muon_momentum (") + c.what + ") update");
  }
  for (const bool cautious_wd : {false, true}) {
    for (const float* keep : {static_cast<const float*>(nullptr), kept, dropped}) {
      Buffer w = upload(p0), o = upload(g1);
      gpu.run({rules::MuonApply{.w = span(w),
                                .o = span(o),
                                .decay = 0.998f,
                                .neg_lr = -0.02f,
                                .scale = 1.7f,
                                .keep = keep,
                                .cautious_wd = cautious_wd}});
      std::vector<float> hw = p0;
      rules::muon_apply_loop(hw.data(), g1.data(), n, 0.998f, -0.02f, 1.7f, keep != dropped, cautious_wd);
      same(w, hw, std::string("muon_apply") + (cautious_wd ? " cautious" : "") +
                      (keep == kept ? " (keep 1)" : keep == dropped ? " (keep 0)" : ""));
    }
  }
  {
    // NorMuon on a 317 × 315 matrix: the GPU sums each row as a tree, the host loop in order, so the row sums may
    // differ in a double's last bits: within 8 float32 ulps of the largest |O| and 4 of each v.
    const int64_t rows = 317, cols = 315;
    const std::vector<float> o0(g1.begin(), g1.begin() + rows * cols);
    Buffer o(gpu, DType::f32, rows * cols), v(gpu, DType::f32, rows);
    o.upload(o0);
    v.upload(std::vector<float>(rows, 1e-4f));
    gpu.run({rules::NorMuonNormalize{.o = DeviceSpan(gpu, o.f32(), static_cast<size_t>(rows * cols)),
                                     .v = DeviceSpan(gpu, v.f32(), static_cast<size_t>(rows)),
                                     .rows = rows,
                                     .cols = cols,
                                     .one_minus_beta2 = 0.05f}});
    std::vector<float> ho = o0, hv(rows, 1e-4f);
    rules::normuon_normalize_loop(ho.data(), hv.data(), rows, cols, 0.05f);
    const std::vector<float> go = device_floats(o), gv = device_floats(v);
    double largest = 0, off_o = 0, off_v = 0;
    for (float x : ho) largest = std::max(largest, double(std::abs(x)));
    for (int64_t i = 0; i < rows * cols; ++i) off_o = std::max(off_o, std::abs(double(go[i]) - ho[i]) / largest);
    for (int64_t r = 0; r < rows; ++r) off_v = std::max(off_v, std::abs(double(gv[r]) - hv[r]) / hv[r]);
    log.report(off_o <= 8 * 6e-8, "normuon_normalize: O off the host loop / largest |O|", off_o, 8 * 6e-8);
    log.report(off_v <= 4 * 6e-8, "normuon_normalize: v off the host loop (relative)", off_v, 4 * 6e-8);
  }
}

// k = 0: C = beta·C; beta = 0 writes zeros over NaN (BLAS's rule), without cuBLAS.
void check_empty_products(Backend& gpu, CheckLog& log) {
  const int64_t n = 6;
  for (const float beta : {0.0f, 0.5f}) {
    HostBatch c(DType::f32, n, n, 1, 6);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < i; ++j) c.at(0, i, j) = c.at(0, j, i);
    if (beta == 0.0f) c.at(0, 1, 2) = c.at(0, 2, 1) = std::nanf("");
    HostBatch want = c;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) want.at(0, i, j) = beta == 0.0f ? 0.0f : beta * c.at(0, i, j);
    Buffer empty(gpu, DType::f32, 1);
    const MatView a{empty.data(), DeviceKind::cuda, DType::f32, n, 0, 1, 1, 0};
    const MatView b{empty.data(), DeviceKind::cuda, DType::f32, 0, n, n, 1, 0};
    const std::string tag = " with k = 0, beta " + std::to_string(beta).substr(0, 3);
    DeviceBatch g(gpu, c), s(gpu, c), t(gpu, c);
    gpu.gemm(false, false, 1.0f, a, b, beta, g.view);
    gpu.syrk(false, 1.0f, a, beta, s.view);
    gpu.symmetric_gemm(1.0f, a, b, beta, t.view, 2);
    log.report(bit_differences(g.read(gpu, c), want) == 0, "gemm" + tag + ": elements off",
               static_cast<double>(bit_differences(g.read(gpu, c), want)), 0);
    log.report(bit_differences(s.read(gpu, c), want) == 0, "syrk" + tag + ": elements off",
               static_cast<double>(bit_differences(s.read(gpu, c), want)), 0);
    log.report(bit_differences(t.read(gpu, c), want) == 0, "symmetric_gemm" + tag + ": elements off",
               static_cast<double>(bit_differences(t.read(gpu, c), want)), 0);
  }
}

// run_graph: captured once per key, replayed after; another key captures again; a host read inside is refused and
// leaves the backend (and the thread's CUDA error state) usable.
void check_graphs(Backend& gpu, CheckLog& log) {
  const bool graphs = gpu.description().find("CUDA graphs off") == std::string::npos;
  const HostBatch h(DType::f32, 30, 50, 1, 7);
  DeviceBatch a(gpu, h), b(gpu, h);
  int calls_a = 0, calls_b = 0;
  const auto key = [](const MatView& v) { return std::vector<int64_t>{7, static_cast<int64_t>(reinterpret_cast<intptr_t>(v.data))}; };
  for (int i = 0; i < 3; ++i) gpu.run_graph(key(a.view), [&] { ++calls_a, gpu.scale(a.view, 2.0f); });
  gpu.run_graph(key(b.view), [&] { ++calls_b, gpu.scale(b.view, 0.5f); });
  HostBatch want_a = h, want_b = h;
  for (int64_t i = 0; i < h.rows; ++i)
    for (int64_t j = 0; j < h.cols; ++j) want_a.at(0, i, j) *= 8.0f, want_b.at(0, i, j) *= 0.5f;
  log.expect(bit_differences(a.read(gpu, h), want_a) == 0 && bit_differences(b.read(gpu, h), want_b) == 0,
             "run_graph: three launches of one graph and one of another give their results");
  if (graphs) {
    log.expect(calls_a == 1 && calls_b == 1, "run_graph: fn called once per key (" + std::to_string(calls_a) + ", " +
                                                 std::to_string(calls_b) + ")");
  } else {
    log.note("CUDA graphs are off (DMUON_CUDA_NO_GRAPHS=1): fn runs every time");
  }
  bool refused = !graphs;
  if (graphs) {
    try {
      float x = 0;
      gpu.run_graph({8}, [&] { gpu.copy_to_host(&x, a.buffer.data(), sizeof(float)); });
    } catch (const Error&) {
      refused = true;
    }
  }
  log.expect(refused, "run_graph: a host read inside a recording is refused");
  gpu.scale(a.view, 0.125f);  // a launch after the refused capture: no stale error
  log.expect(bit_differences(a.read(gpu, h), h) == 0, "the next launch after a refused capture runs (no stale error)");
}

// run_concurrently: each worker's stream starts after what this stream queued before (a large product into each
// worker's input) and this stream continues after every worker (the read-back sees their results).
void check_concurrent(Backend& gpu, CheckLog& log) {
  constexpr int kWorkers = 3;
  const HostBatch h(DType::f32, 512, 512, 1, 11);
  HostBatch want = h;
  for (int64_t i = 0; i < h.rows; ++i)
    for (int64_t j = 0; j < h.cols; ++j) want.at(0, i, j) *= 2.0f;
  const HostBatch stale(DType::f32, 512, 512, 1, 99);  // what a worker that started too early would copy
  std::vector<DeviceBatch> inputs, outputs;
  inputs.reserve(kWorkers), outputs.reserve(kWorkers);
  for (int w = 0; w < kWorkers; ++w) inputs.emplace_back(gpu, stale), outputs.emplace_back(gpu, h);
  const DeviceBatch source(gpu, h);
  for (int w = 0; w < kWorkers; ++w) gpu.copy(inputs[w].buffer.data(), source.buffer.data(), h.bytes());
  gpu.run_concurrently(kWorkers, [&](Backend& queue, int w) {
    queue.copy(outputs[w].buffer.data(), inputs[w].buffer.data(), h.bytes());
    queue.scale(outputs[w].view, 2.0f);
  });
  for (int w = 0; w < kWorkers; ++w)
    log.expect(bit_differences(outputs[w].read(gpu, h), want) == 0,
               "run_concurrently: worker " + std::to_string(w) + " saw this stream's copy, this stream its result");
}

// The graph cache's bounds: a graph whose key names a deallocated buffer is dropped (a new buffer at the same
// address captures again), and past 128 keys the least recently launched goes (its key captures again).
void check_graph_eviction(Backend& gpu, CheckLog& log) {
  if (gpu.description().find("CUDA graphs off") != std::string::npos) {
    log.note("CUDA graphs are off (DMUON_CUDA_NO_GRAPHS=1): no graph cache to check");
    return;
  }
  const HostBatch h(DType::f32, 8, 8, 1, 12);
  const auto address = [](const void* p) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(p)); };
  int calls = 0;
  const void* first = nullptr;
  {
    DeviceBatch a(gpu, h);
    first = a.buffer.data();
    gpu.run_graph({9, address(first)}, [&] { ++calls, gpu.scale(a.view, 2.0f); });
  }
  DeviceBatch b(gpu, h);
  gpu.run_graph({9, address(b.buffer.data())}, [&] { ++calls, gpu.scale(b.view, 2.0f); });
  if (b.buffer.data() == first) {
    log.expect(calls == 2, "run_graph: a buffer deallocated and allocated again at its address captures again");
  } else {
    log.note("the pool gave the second buffer another address: deallocation's eviction not observable");
  }
  int evicted_calls = 0;
  const auto scale_b = [&](int64_t key, int* counter) {
    gpu.run_graph({10, key}, [&] { ++*counter, gpu.scale(b.view, 1.0f); });
  };
  scale_b(0, &evicted_calls);
  int others = 0;
  for (int64_t key = 1; key <= 128; ++key) scale_b(key, &others);  // 129 keys: key 0, the oldest, goes
  scale_b(0, &evicted_calls);
  log.expect(evicted_calls == 2 && others == 128,
             "run_graph: past 128 graphs the least recently launched is evicted and captured again (" +
                 std::to_string(evicted_calls) + " captures of it)");
  HostBatch want = h;
  for (int64_t i = 0; i < h.rows; ++i)
    for (int64_t j = 0; j < h.cols; ++j) want.at(0, i, j) *= 2.0f;
  log.expect(bit_differences(b.read(gpu, h), want) == 0, "run_graph: the evicted and replayed graphs computed right");
}

// After a not-ready event query the CUDA runtime may keep cudaErrorNotReady as the thread's last error: whether it
// does is noted from a plain cudaEventQuery; then cuda::query_event (the NCCL communicator's poll) must leave
// nothing behind, so that the next launch's check succeeds. Vacuous (noted) when the event has fired already.
void check_not_ready_query(Backend& gpu, CheckLog& log) {
  const auto stream = static_cast<cudaStream_t>(gpu.native_queue());
  const int64_t n = 4096;
  Buffer x(gpu, DType::bf16, n * n), y(gpu, DType::f32, n * n);
  gpu.fill(x.view(n, n), 0.01f);
  const auto busy_event = [&] {  // an event behind about 1 TFLOP of products: not ready when queried at once
    for (int i = 0; i < 8; ++i) gpu.gemm(false, true, 1.0f, x.view(n, n), x.view(n, n), 0.0f, y.view(n, n));
    cudaEvent_t event = nullptr;
    DMUON_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming) == cudaSuccess &&
                    cudaEventRecord(event, stream) == cudaSuccess,
                "creating or recording an event failed");
    return event;
  };
  cudaEvent_t plain = busy_event();
  const cudaError_t rc = cudaEventQuery(plain);
  log.note(std::string("cudaEventQuery right after queuing: ") + cudaGetErrorName(rc) + "; last error then: " +
           cudaGetErrorName(cudaPeekAtLastError()));
  (void)cudaGetLastError();
  cudaEventDestroy(plain);
  cudaEvent_t event = busy_event();
  const cudaError_t ours = cuda::query_event(event);
  if (ours != cudaErrorNotReady) log.note(std::string("cuda::query_event answered ") + cudaGetErrorName(ours));
  bool launched = false;
  try {
    gpu.scale(y.view(n, n), 0.5f);
    gpu.synchronize();
    launched = true;
  } catch (const Error& e) {
    log.note(e.what());
  }
  cudaEventDestroy(event);
  log.expect(launched, "a launch right after cuda::query_event answered not ready succeeds (no stale error)");
}

}  // namespace

void check_kernels(Backend& gpu, CheckLog& log) {
  log.guard("elementwise kernels", [&] { check_elementwise(gpu, log); });
  log.guard("tall transpose", [&] { check_tall_transpose(gpu, log); });
  log.guard("update rules", [&] { check_update_rules(gpu, log); });
  log.guard("empty products", [&] { check_empty_products(gpu, log); });
  log.guard("graphs", [&] { check_graphs(gpu, log); });
  log.guard("concurrent streams", [&] { check_concurrent(gpu, log); });
  log.guard("graph eviction", [&] { check_graph_eviction(gpu, log); });
  log.guard("not-ready event query", [&] { check_not_ready_query(gpu, log); });
}

}  // namespace dmuon
