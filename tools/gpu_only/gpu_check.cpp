// dmuon_gpu_check: the GPU checks that need only CUDA and the C++ standard library (built in every CUDA build,
// and alone with -DDMUON_GPU_ONLY=ON on machines without our Debian libraries; docs/gpu.md).
//   dmuon_gpu_check test       products and Newton–Schulz on the GPU against float64 references on the host;
//                              exit 0 when all pass, 1 on a failure, 77 (ctest's skip) without a CUDA device
//   dmuon_gpu_check bench ns [--device cuda] [--shapes RxC,...] [--batch K] [--repeats N] [--dtype bf16|f32] [--json]
//                              as `dmuon bench ns --device cuda` (tools/device_ns_bench.hpp)
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.hpp"
#include "device_ns_bench.hpp"
#include "dmuon/backend.hpp"
#include "dmuon/error.hpp"
#include "dmuon/ns.hpp"
#include "ns_reference.hpp"

namespace dmuon {
namespace {

int failures = 0;

void report(bool ok, const std::string& what, double value, double limit) {
  std::printf("%-4s %-60s %.3g (limit %.3g)\n", ok ? "ok" : "FAIL", what.c_str(), value, limit);
  if (!ok) ++failures;
}

// A float64 matrix as float32 (optionally bf16-rounded) on the device, and back.
Buffer upload(Backend& gpu, const test::MatD& m) {
  Buffer b(gpu, DType::f32, m.rows * m.cols);
  b.upload(test::to_floats(m));
  return b;
}
test::MatD download(const Buffer& b, int64_t rows, int64_t cols) {
  std::vector<float> host(static_cast<size_t>(rows * cols));
  b.download(host);
  return test::from_floats(host.data(), rows, cols);
}
// Rounds through the device's bf16 conversion when asked, so the host reference sees the GPU's operands.
test::MatD as_operand(Backend& gpu, const test::MatD& m, DType dtype, Buffer* narrow_out) {
  Buffer f = upload(gpu, m);
  if (dtype == DType::f32) {
    *narrow_out = std::move(f);
    return m;
  }
  Buffer n(gpu, DType::bf16, m.rows * m.cols);
  gpu.convert(f.view(m.rows, m.cols), n.view(m.rows, m.cols));
  Buffer back(gpu, DType::f32, m.rows * m.cols);
  gpu.convert(n.view(m.rows, m.cols), back.view(m.rows, m.cols));
  *narrow_out = std::move(n);
  return download(back, m.rows, m.cols);
}

// max |got − want| / (|A|·|B|)_ij over the elements: below (k + 2)·u for float32 accumulation.
double scaled_error(const test::MatD& got, const test::MatD& want, const test::MatD& abs_product) {
  double worst = 0;
  for (size_t i = 0; i < got.v.size(); ++i) worst = std::max(worst, std::abs(got.v[i] - want.v[i]) / (abs_product.v[i] + 1e-300));
  return worst;
}

test::MatD absolute(test::MatD m) {
  for (double& x : m.v) x = std::abs(x);
  return m;
}

void check_products(Backend& gpu) {
  const double u = FLT_EPSILON / 2;
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (int t = 0; t < 4; ++t) {  // gemm, all transposes, odd shapes, float32 result
      const bool ta = t & 1, tb = t & 2;
      const int64_t m = 67, n = 45, k = 129;
      Buffer a_dev, b_dev;
      const test::MatD a = as_operand(gpu, test::gaussian(ta ? k : m, ta ? m : k, 10 + t), dtype, &a_dev);
      const test::MatD b = as_operand(gpu, test::gaussian(tb ? n : k, tb ? k : n, 20 + t), dtype, &b_dev);
      const test::MatD op_a = ta ? test::transposed(a) : a, op_b = tb ? test::transposed(b) : b;
      Buffer c(gpu, DType::f32, m * n);
      gpu.gemm(ta, tb, 1.0f, a_dev.view(a.rows, a.cols), b_dev.view(b.rows, b.cols), 0.0f, c.view(m, n));
      const double err = scaled_error(download(c, m, n), test::matmul(op_a, op_b), test::matmul(absolute(op_a), absolute(op_b)));
      report(err <= (k + 2) * u, "gemm " + to_string(dtype) + (ta ? " A^T" : " A") + (tb ? " B^T" : " B"), err, (k + 2) * u);
    }
    for (int trans = 0; trans < 2; ++trans) {  // syrk: X·Xᵀ and Xᵀ·X (bf16: the tiled GemmEx path)
      const int64_t n = 600, k = 70;
      Buffer x_dev;
      const test::MatD x = as_operand(gpu, test::gaussian(trans ? k : n, trans ? n : k, 30 + trans), dtype, &x_dev);
      const test::MatD op = trans ? test::transposed(x) : x;
      Buffer c(gpu, DType::f32, n * n);
      gpu.syrk(trans, 1.0f, x_dev.view(x.rows, x.cols), 0.0f, c.view(n, n));
      const double err = scaled_error(download(c, n, n), test::matmul(op, test::transposed(op)),
                                      test::matmul(absolute(op), test::transposed(absolute(op))));
      report(err <= (k + 2) * u, "syrk " + to_string(dtype) + (trans ? " X^T X" : " X X^T"), err, (k + 2) * u);
    }
    for (int tiles : {1, 3, 8}) {  // tiled symmetric products of commuting symmetric factors
      const int64_t m = 301;
      const test::MatD g = test::gaussian(m, m, 40 + tiles);
      const test::MatD r = test::matmul(g, test::transposed(g), 1.0 / m);
      const test::MatD r2 = test::matmul(r, r);
      Buffer a_dev, b_dev;
      const test::MatD a = as_operand(gpu, r, dtype, &a_dev), b = as_operand(gpu, r2, dtype, &b_dev);
      Buffer c(gpu, DType::f32, m * m);
      gpu.symmetric_gemm(1.0f, a_dev.view(m, m), b_dev.view(m, m), 0.0f, c.view(m, m), tiles);
      // Rounded operands need not commute exactly: compare the upper triangle, which is what is computed.
      test::MatD got = download(c, m, m), want = test::matmul(a, b), bound = test::matmul(absolute(a), absolute(b));
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < i; ++j) got(i, j) = want(i, j) = bound(i, j) = 0;
      const double err = scaled_error(got, want, bound);
      report(err <= (m + 2) * u, "symmetric_gemm " + to_string(dtype) + " tiles " + std::to_string(tiles), err,
             (m + 2) * u);
    }
  }
}

void check_newton_schulz(Backend& gpu) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    // GPU.md: float32 ≪ 1e-3, bf16 operands 1e-3 … 1e-2 (relative Frobenius distance to float64).
    const double limit = dtype == DType::f32 ? 1e-4 : 1e-2;
    for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{96, 512}, {512, 96}, {256, 256}}) {
      for (const std::string path : {"reference", "standard", "gram"}) {
        const test::MatD u = test::gaussian(rows, cols, 50 + rows);
        NsOptions options = device_ns_path_options(path, dtype);
        options.tiles = 3;
        const auto schedule = ns_schedule(options.coeffs, options.steps);
        const test::MatD want = test::standard_ns_reference(u, schedule, 1.0);
        Buffer in = upload(gpu, u), out(gpu, DType::f32, rows * cols);
        const MatView iv = in.view(rows, cols), ov = out.view(rows, cols);
        newton_schulz_batched(gpu, std::span<const MatView>(&iv, 1), std::span<const MatView>(&ov, 1), options);
        const double err = test::relative_distance(download(out, rows, cols), want);
        report(err <= limit,
               "newton_schulz " + path + " " + to_string(dtype) + " " + std::to_string(rows) + "x" + std::to_string(cols),
               err, limit);
      }
    }
  }
}

std::vector<std::pair<int64_t, int64_t>> parse_shapes(const std::string& list) {
  std::vector<std::pair<int64_t, int64_t>> shapes;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t end = std::min(list.find(',', start), list.size());
    long long r = 0, c = 0;
    char tail = 0;
    const std::string item = list.substr(start, end - start);
    DMUON_CHECK(std::sscanf(item.c_str(), "%lldx%lld%c", &r, &c, &tail) == 2 && r > 0 && c > 0, "--shapes: '", item,
                "' is not ROWSxCOLS");
    shapes.emplace_back(r, c);
    start = end + 1;
  }
  return shapes;
}

int bench_ns(int argc, char** argv) {
  std::string shapes = "896x4864,4864x896,4096x4096", dtype = "bf16";
  int batch = 1, repeats = 20;
  bool json = false;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      DMUON_CHECK(i + 1 < argc, arg, " needs a value");
      return argv[++i];
    };
    if (arg == "--shapes") shapes = value();
    else if (arg == "--batch") batch = std::stoi(value());
    else if (arg == "--repeats") repeats = std::stoi(value());
    else if (arg == "--dtype") dtype = value();
    else if (arg == "--json") json = true;
    else if (arg == "--device") DMUON_CHECK(value() == "cuda", "dmuon_gpu_check runs on --device cuda only");
    else DMUON_FAIL("bench ns: unknown argument '", arg, "'");
  }
  DMUON_CHECK(dtype == "bf16" || dtype == "f32", "--dtype must be bf16 or f32, got '", dtype, "'");
  const auto report = bench_ns_on_device(backend_for(DeviceKind::cuda, 0), parse_shapes(shapes), batch, repeats,
                                         dtype == "bf16" ? DType::bf16 : DType::f32);
  std::fputs((json ? device_ns_json(report) : device_ns_table(report)).c_str(), stdout);
  return 0;
}

int run(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  if (command == "test") {
    if (cuda::device_count() == 0) {
      std::printf("skipped: no CUDA device on this machine\n");
      return 77;
    }
    Backend& gpu = backend_for(DeviceKind::cuda, 0);
    std::printf("%s\n", gpu.description().c_str());
    check_products(gpu);
    check_newton_schulz(gpu);
    std::printf("%d failure(s)\n", failures);
    return failures == 0 ? 0 : 1;
  }
  if (command == "bench" && argc > 2 && std::string(argv[2]) == "ns") return bench_ns(argc - 3, argv + 3);
  std::fprintf(stderr, "usage: dmuon_gpu_check test | bench ns [--shapes RxC,...] [--batch K] [--repeats N] "
                       "[--dtype bf16|f32] [--json]\n");
  return 2;
}

}  // namespace
}  // namespace dmuon

int main(int argc, char** argv) {
  try {
    return dmuon::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dmuon_gpu_check: %s\n", e.what());
    return 1;
  }
}
