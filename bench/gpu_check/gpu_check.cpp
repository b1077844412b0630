// dmuon_gpu_check: the GPU checks that need only CUDA and the C++ standard library (built in every CUDA build,
// and alone with -DDMUON_GPU_ONLY=ON on machines without our Debian libraries; docs/gpu.md).
//   dmuon_gpu_check test       products and Newton–Schulz on the GPU against float64 references on the host
//                              (bf16 Newton–Schulz also against its emulation, tests/support/ns_reference.hpp; with
//                              the norms checked on the host, and with device norms, the path every benchmark and
//                              dmuon.torch take), and the kernel checks of kernel_checks.hpp; exit 0 when all pass,
//                              1 on a failure, 77 (ctest's skip) without a CUDA device. Every line is flushed as it
//                              is written (a kill loses nothing).
//   dmuon_gpu_check bench ns [--device cuda] [--shapes RxC,...] [--batch K] [--repeats N] [--dtype bf16|f32] [--json]
//                              as `dmuon bench ns --device cuda` (bench/device_ns_bench.hpp)
//   dmuon_gpu_check bench muon --shapes RxC:K,... [--repeats N] [--json]
//                              one device Muon step over those matrices (muon_step_bench.hpp)
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "check_log.hpp"
#include "device_ns_bench.hpp"
#include "dmuon/backend.hpp"
#include "dmuon/error.hpp"
#include "dmuon/ns.hpp"
#include "kernel_checks.hpp"
#include "muon_step_bench.hpp"
#include "ns_reference.hpp"

namespace dmuon {
namespace {

CheckLog check_log;

void report(bool ok, const std::string& what, double value, double limit) { check_log.report(ok, what, value, limit); }

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
    const std::string dt = to_string(dtype);
    for (int t = 0; t < 4; ++t) check_log.guard("gemm " + dt + " #" + std::to_string(t), [&] {
      // gemm, all transposes, odd shapes, float32 result
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
    });
    for (int trans = 0; trans < 2; ++trans) check_log.guard("syrk " + dt + " #" + std::to_string(trans), [&] {
      // syrk: X·Xᵀ and Xᵀ·X (bf16: the tiled GemmEx path)
      const int64_t n = 600, k = 70;
      Buffer x_dev;
      const test::MatD x = as_operand(gpu, test::gaussian(trans ? k : n, trans ? n : k, 30 + trans), dtype, &x_dev);
      const test::MatD op = trans ? test::transposed(x) : x;
      Buffer c(gpu, DType::f32, n * n);
      gpu.syrk(trans, 1.0f, x_dev.view(x.rows, x.cols), 0.0f, c.view(n, n));
      const double err = scaled_error(download(c, n, n), test::matmul(op, test::transposed(op)),
                                      test::matmul(absolute(op), test::transposed(absolute(op))));
      report(err <= (k + 2) * u, "syrk " + to_string(dtype) + (trans ? " X^T X" : " X X^T"), err, (k + 2) * u);
    });
    for (int tiles : {1, 3, 8}) check_log.guard("symmetric_gemm " + dt + " #" + std::to_string(tiles), [&] {
      // tiled symmetric products of commuting symmetric factors
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
    });
  }
}

// One Newton–Schulz check: its name, options (tiles 3) and schedule, and its reference. float32 iterates: against
// the float64 recurrence, within 1e-4 (GPU.md: float32 ≪ 1e-3). bf16 iterates (tests/ns/ns_bf16_emulation_test.cpp
// derives both limits on these very inputs): after 1 and 2 steps against the emulated GPU recurrence (bf16 at every
// store, float32 accumulation), within 1e-3, where accumulation order alone moves a correct result by under 2.5e-4
// and a missing rounding by over 2e-3; after 5 steps, when the bf16 iterates have become chaotic (correct results
// 1e-2 … 3.5e-2 from float64), against float64 within 5e-2.
struct NsCase {
  std::string what;
  NsOptions options;
  std::vector<NsStep> schedule;
  bool emulated, gram;
  double limit;

  NsCase(const std::string& path, DType dtype, int64_t rows, int64_t cols, int steps, const std::string& suffix)
      : what("newton_schulz " + path + " " + to_string(dtype) + " " + std::to_string(rows) + "x" + std::to_string(cols) +
             " " + std::to_string(steps) + " steps" + suffix),
        options(device_ns_path_options(path, dtype)) {
    options.tiles = 3;
    options.steps = steps;
    schedule = ns_schedule(options.coeffs, options.steps);
    emulated = dtype == DType::bf16 && steps <= 2;
    gram = ns_effective_options(options, rows, cols).algo == NsAlgo::gram;
    limit = dtype == DType::f32 ? 1e-4 : emulated ? 1e-3 : 5e-2;
  }
  test::MatD want(const test::MatD& u) const {
    const test::Bf16Emulation<float> bf16;
    if (!emulated) return test::standard_ns_reference(u, schedule, 1.0);
    return gram ? bf16.gram(u, schedule, 1.0, options.restarts) : bf16.standard(u, schedule, 1.0);
  }
  // Reports the output `got` of input u.
  void check(const test::MatD& got, const test::MatD& u, const std::string& item) const {
    const double err = test::relative_distance(got, want(u));
    report(err <= limit, item + " vs " + (emulated ? "emulated bf16" : "float64"), err, limit);
  }
};

// One matrix at a time, the norms read back and checked on the host: only the recurrence is a graph.
void check_newton_schulz(Backend& gpu) {
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{96, 512}, {512, 96}, {256, 256}}) {
      const test::MatD u = test::gaussian(rows, cols, 50 + rows);
      for (const std::string path : {"reference", "standard", "gram"}) {
        for (const int steps : dtype == DType::f32 ? std::vector<int>{5} : std::vector<int>{1, 2, 5}) {
          const NsCase c(path, dtype, rows, cols, steps, "");
          check_log.guard(c.what, [&] {
            Buffer in = upload(gpu, u), out(gpu, DType::f32, rows * cols);
            const MatView iv = in.view(rows, cols), ov = out.view(rows, cols);
            newton_schulz_batched(gpu, std::span<const MatView>(&iv, 1), std::span<const MatView>(&ov, 1), c.options);
            c.check(download(out, rows, cols), u, c.what);
          });
        }
      }
    }
  }
}

// Newton–Schulz with device norms, as bench ns, bench muon and dmuon.torch run it: the norms stay in device memory
// (newton_schulz_batched's `norms`), so each chunk — norms, their cudaMallocAsync/cudaFreeAsync scratch
// (device_view.cuh) and the recurrence — is one CUDA graph. Three matrices of one stack orthogonalised in place (as
// bench muon's buckets are), twice over the same addresses with new inputs, so the second call replays the graph
// recorded by the first: each output against its NsCase reference (5 float32 steps, 2 bf16 ones), and the norms left
// on the device against float64 (float32 squares are exact in double, the sums round at 2^-53 each: within 1e-10).
void check_newton_schulz_device_norms(Backend& gpu) {
  constexpr int64_t kCount = 3;
  for (DType dtype : {DType::f32, DType::bf16}) {
    for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{96, 512}, {512, 96}}) {
      for (const std::string path : {"standard", "gram"}) {
        const NsCase c(path, dtype, rows, cols, dtype == DType::f32 ? 5 : 2, ", device norms");
        check_log.guard(c.what, [&] {
          const int64_t size = rows * cols;
          Buffer stack(gpu, DType::f32, kCount * size), norms(gpu, DType::f32, 2 * kCount);  // kCount doubles
          std::vector<MatView> views;
          for (int64_t i = 0; i < kCount; ++i) views.push_back(stack.view(rows, cols, 1, i * size));
          for (const int replay : {0, 1}) {
            std::vector<test::MatD> inputs;
            std::vector<float> host;
            for (int64_t i = 0; i < kCount; ++i) {
              inputs.push_back(test::gaussian(rows, cols, 60 + rows + 7 * i + 100 * replay));
              const std::vector<float> f = test::to_floats(inputs.back());
              host.insert(host.end(), f.begin(), f.end());
            }
            stack.upload(host);
            gpu.fill(norms.view(1, 2 * kCount), std::nanf(""));  // poisoned: a norm not written shows
            newton_schulz_batched(gpu, views, views, c.options, {}, reinterpret_cast<double*>(norms.data()));
            std::vector<float> out(static_cast<size_t>(kCount * size)), norm_bits(2 * kCount);
            stack.download(out);
            norms.download(norm_bits);
            for (int64_t i = 0; i < kCount; ++i) {
              const test::MatD& u = inputs[static_cast<size_t>(i)];
              const std::string item = c.what + (replay ? ", replayed" : ", recorded") + ", matrix " + std::to_string(i);
              c.check(test::from_floats(out.data() + i * size, rows, cols), u, item);
              double want_norm = 0;  // of the float32 values the device holds
              for (float x : test::to_floats(u)) want_norm += static_cast<double>(x) * x;
              want_norm = std::sqrt(want_norm);
              double got_norm = 0;
              std::memcpy(&got_norm, norm_bits.data() + 2 * i, sizeof got_norm);
              const double norm_err = std::abs(got_norm - want_norm) / want_norm;
              report(norm_err <= 1e-10, item + " input norm", norm_err, 1e-10);
            }
          }
        });
      }
    }
  }
}

// The options of a `bench` subcommand: --NAME VALUE for the names in `valued`, --json, and --device cuda.
struct BenchArgs {
  std::map<std::string, std::string> values;
  bool json = false;

  BenchArgs(int argc, char** argv, const std::string& command, const std::map<std::string, std::string>& defaults)
      : values(defaults) {
    for (int i = 0; i < argc; ++i) {
      const std::string arg = argv[i];
      if (arg == "--json") {
        json = true;
        continue;
      }
      DMUON_CHECK(i + 1 < argc, command, ": ", arg, " needs a value");
      const std::string value = argv[++i];
      if (arg == "--device") {
        DMUON_CHECK(value == "cuda", "dmuon_gpu_check runs on --device cuda only");
      } else {
        DMUON_CHECK(arg.rfind("--", 0) == 0 && defaults.count(arg.substr(2)), command, ": unknown argument '", arg, "'");
        values[arg.substr(2)] = value;
      }
    }
  }
  int integer(const std::string& name) const { return std::stoi(values.at(name)); }
};

int bench_ns(int argc, char** argv) {
  const BenchArgs args(argc, argv, "bench ns",
                       {{"shapes", "896x4864,4864x896,4096x4096"}, {"batch", "1"}, {"repeats", "20"}, {"dtype", "bf16"}});
  const std::string dtype = args.values.at("dtype");
  DMUON_CHECK(dtype == "bf16" || dtype == "f32", "--dtype must be bf16 or f32, got '", dtype, "'");
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (const MuonBucket& b : parse_buckets(args.values.at("shapes"))) {
    DMUON_CHECK(b.count == 1, "bench ns: --shapes takes ROWSxCOLS (the batch is --batch)");
    shapes.emplace_back(b.rows, b.cols);
  }
  const auto report = bench_ns_on_device(backend_for(DeviceKind::cuda, 0), shapes, args.integer("batch"),
                                         args.integer("repeats"), dtype == "bf16" ? DType::bf16 : DType::f32);
  std::fputs((args.json ? device_ns_json(report) : device_ns_table(report)).c_str(), stdout);
  const std::string failures = device_ns_failures(report);  // the shapes that threw: in the output, and the status
  std::fputs(failures.c_str(), stderr);
  return failures.empty() ? 0 : 1;
}

int bench_muon(int argc, char** argv) {
  const BenchArgs args(argc, argv, "bench muon", {{"shapes", ""}, {"repeats", "10"}});
  DMUON_CHECK(!args.values.at("shapes").empty(), "bench muon: --shapes ROWSxCOLS:COUNT,... is required");
  const auto report =
      bench_muon_step(backend_for(DeviceKind::cuda, 0), parse_buckets(args.values.at("shapes")), args.integer("repeats"));
  std::fputs((args.json ? muon_step_json(report) : muon_step_table(report)).c_str(), stdout);
  const std::string failures = muon_step_failures(report);
  std::fputs(failures.c_str(), stderr);
  return failures.empty() ? 0 : 1;
}

int run(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  if (command == "test") {
    if (device_count(DeviceKind::cuda) == 0) {
      std::printf("skipped: no CUDA device on this machine\n");
      return 77;
    }
    Backend& gpu = backend_for(DeviceKind::cuda, 0);
    std::printf("%s\n", gpu.description().c_str());
    check_products(gpu);
    check_newton_schulz(gpu);
    check_newton_schulz_device_norms(gpu);
    check_kernels(gpu, check_log);
    std::printf("%d failure(s)\n", check_log.failures());
    return check_log.failures() == 0 ? 0 : 1;
  }
  if (command == "bench" && argc > 2 && std::string(argv[2]) == "ns") return bench_ns(argc - 3, argv + 3);
  if (command == "bench" && argc > 2 && std::string(argv[2]) == "muon") return bench_muon(argc - 3, argv + 3);
  std::fprintf(stderr, "usage: dmuon_gpu_check test | bench ns [--shapes RxC,...] [--batch K] [--repeats N] "
                       "[--dtype bf16|f32] [--json] | bench muon --shapes RxC:K,... [--repeats N] [--json]\n");
  return 2;
}

}  // namespace
}  // namespace dmuon

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // line by line into the GPU check's logs, whatever ends the process
  try {
    return dmuon::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dmuon_gpu_check: %s\n", e.what());
    return 1;
  }
}
