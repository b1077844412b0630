// `dmuon bench ns`: Newton–Schulz speed per shape (DESIGN 2.5). Measures the machine's sgemm peak
// and, per shape, the `reference` row (plain recurrence, full sgemm: the cost of the public
// reference code) beside `standard` (SYRK), `gram` and `auto`. Useful GFLOP/s is always the plain
// standard flop count over the time, so a path doing fewer flops can pass the peak.
//
// With --batch K > 1 each row runs K same-shape matrices through newton_schulz_batched; with
// --batch-mode best (the default) a probe of each mode picks the faster, which is then timed and
// reported with its name (the JSON also gives each mode's probe time).
//
// With --split-heads (one head count per shape, --split-dims 0: rows, 1: columns) each shape's row instead compares
// split Newton–Schulz (dmuon train --muon-group '...:split-heads=H'; docs/optimizers.md) with the whole matrix: the
// H blocks in one newton_schulz_batched call (a column split's blocks gathered into contiguous blocks and put back,
// as the optimizer does, inside the timing) against one call on the whole matrix, float32, the auto algorithm.
//
// Both precisions side by side on the CPU: where its backend computes in bfloat16 (oneDNN) the rows `standard`,
// `gram` and `auto` run again with bf16 iterates (dtype bfloat16; --dtype f32 leaves them out, --dtype bf16 keeps
// only them beside `reference`), each row's % of peak against its own precision's measured peak: OpenBLAS's sgemm
// for float32, oneDNN's bf16 matmul for bfloat16 (oneDNN's float32 matmul is measured beside them).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "backend/cpu_bf16.hpp"
#include "cli_kit/cli.hpp"
#include "cli_kit/device_args.hpp"
#include "device_ns_bench.hpp"
#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/ns.hpp"
#include "dmuon/statistics.hpp"

namespace ns_bench {

using Clock = std::chrono::steady_clock;

struct BenchArgs {
  std::string shapes = "896x4864,4864x896,896x896,128x896,2048x2048";
  std::string batch_mode = "best";
  std::vector<int64_t> split_heads, split_dims;  // per shape (--split-heads, --split-dims)
  int batch = 1, threads = 0, repeats = 2;  // 2: `make demo` stays under 2 minutes on 2 cores
  bool json = false;
  dmuon::cli::DeviceArgs device;
};

struct Shape {
  int64_t rows, cols;
};

std::vector<Shape> parse_shapes(const std::string& list) {
  std::vector<Shape> shapes;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t end = std::min(list.find(',', start), list.size());
    const std::string item = list.substr(start, end - start);
    long long r = 0, c = 0;
    char tail = 0;
    DMUON_CHECK(std::sscanf(item.c_str(), "%lldx%lld%c", &r, &c, &tail) == 2 && r > 0 && c > 0, "--shapes: '", item,
                "' is not ROWSxCOLS with positive sizes (e.g. 896x4864)");
    shapes.push_back({r, c});
    start = end + 1;
  }
  return shapes;
}

// Wall-clock seconds, and process CPU seconds divided by the BLAS thread count. On a shared machine
// the CPU figure ignores time the process spent waiting for a core, so at --threads 1 it is the
// robust one; with several threads OpenBLAS's spinning workers inflate it for sequential runs.
struct Timing {
  double wall = 0, cpu = 0;
};

double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

class Stopwatch {
 public:
  Stopwatch() : wall0_(Clock::now()), cpu0_(process_cpu_seconds()) {}
  Timing elapsed() const {
    return {std::chrono::duration<double>(Clock::now() - wall0_).count(),
            (process_cpu_seconds() - cpu0_) / dmuon::linalg::threads()};
  }

 private:
  Clock::time_point wall0_;
  double cpu0_;
};

// Best-of-`repeats` GFLOP/s of `product`, a 2048³ matrix product with the current threads (wall and cpu).
Timing peak_gflops(int repeats, const std::function<void()>& product) {
  constexpr double n = 2048;
  Timing best{1e30, 1e30};
  for (int r = 0; r < repeats + 1; ++r) {  // the first run warms up and is not counted
    const Stopwatch watch;
    product();
    const Timing t = watch.elapsed();
    if (r > 0) best = {std::min(best.wall, t.wall), std::min(best.cpu, t.cpu)};
  }
  const double flops = 2.0 * n * n * n;
  return {flops / best.wall / 1e9, flops / best.cpu / 1e9};
}

// oneDNN's 2048³ matmul in `dtype` (float32, or bfloat16 with float32 accumulation), the products of the CPU's bf16
// Newton–Schulz; the operands live as long as the returned function.
std::function<void()> onednn_product_2048(dmuon::DType dtype) {
  constexpr int64_t n = 2048;
  if (dtype == dmuon::DType::bf16) {
    auto m = std::make_shared<std::vector<uint16_t>>(3 * n * n, uint16_t{0x3f00});  // 0.5
    return [m] {
      uint16_t* p = m->data();
      dmuon::cpu_bf16::gemm(false, false, n, n, n, 1.0f, p, n, p + n * n, n, 0.0f, p + 2 * n * n, n);
    };
  }
  auto m = std::make_shared<std::vector<float>>(3 * n * n, 0.5f);
  return [m] {
    float* p = m->data();
    dmuon::cpu_bf16::gemm_f32(false, false, n, n, n, 1.0f, p, n, p + n * n, n, 0.0f, p + 2 * n * n, n);
  };
}

Timing sgemm_peak_gflops(int repeats) {
  constexpr int64_t n = 2048;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  return peak_gflops(repeats, [&] {
    dmuon::linalg::gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  });
}

struct Row {
  std::string path, algo, mode;
  dmuon::DType dtype = dmuon::DType::f32;
  Timing seconds;                       // median seconds per matrix in `mode`
  std::map<std::string, double> probe;  // batch mode → seconds per matrix of its probe (mode "best")
};

// K same-shape Gaussian inputs and their outputs.
struct Inputs {
  std::vector<std::vector<float>> in, out;
  std::vector<const float*> in_ptrs;
  std::vector<float*> out_ptrs;
  Inputs(int k, Shape s) : in(k), out(k) {
    std::mt19937 rng(1234);
    std::normal_distribution<float> normal;
    for (int i = 0; i < k; ++i) {
      in[i].resize(s.rows * s.cols);
      for (float& x : in[i]) x = normal(rng);
      out[i].resize(s.rows * s.cols);
      in_ptrs.push_back(in[i].data());
      out_ptrs.push_back(out[i].data());
    }
  }
};

// Seconds per matrix of one batched run over the first `k` inputs.
Timing time_per_matrix(Inputs& inputs, size_t k, Shape s, const dmuon::NsOptions& options) {
  const Stopwatch watch;
  dmuon::newton_schulz_batched(std::span(inputs.in_ptrs).first(k), std::span(inputs.out_ptrs).first(k), s.rows, s.cols,
                               options);
  const Timing t = watch.elapsed();
  return {t.wall / k, t.cpu / k};
}

// Per path: with several batch modes, a probe of each on `threads` matrices (one per worker, so
// both modes see the same per-matrix work) picks the faster; the chosen modes then run the whole
// batch `repeats` times, paths interleaved. Probing on a slice keeps `make demo` short.
std::vector<Row> bench_shape(Shape s, const BenchArgs& args, const std::vector<dmuon::DType>& dtypes) {
  Inputs inputs(args.batch, s);
  std::vector<dmuon::NsBatchMode> modes = {dmuon::NsBatchMode::sequential};
  if (args.batch > 1 && args.batch_mode != "sequential") {
    modes = {dmuon::NsBatchMode::concurrent};
    if (args.batch_mode == "best") modes.insert(modes.begin(), dmuon::NsBatchMode::sequential);
  }
  struct Path {
    const char* name;
    dmuon::NsAlgo algo;
    bool symmetric;
    dmuon::DType dtype;
  };
  std::vector<Path> paths = {{"reference", dmuon::NsAlgo::standard, false, dmuon::DType::f32}};
  for (const dmuon::DType dtype : dtypes) {
    paths.push_back({"standard", dmuon::NsAlgo::standard, true, dtype});
    paths.push_back({"gram", dmuon::NsAlgo::gram, true, dtype});
    paths.push_back({"auto", dmuon::NsAlgo::automatic, true, dtype});
  }
  const auto options_for = [](const Path& p, dmuon::NsBatchMode mode) {
    dmuon::NsOptions options;
    options.algo = p.algo;
    options.symmetric = p.symmetric;
    options.batch_mode = mode;
    options.dtype = p.dtype;
    if (p.dtype == dmuon::DType::bf16) options.restarts = {1, 3};  // DESIGN 2.2: half precision
    return options;
  };
  const size_t k = inputs.in.size(), probe_k = std::min<size_t>(k, dmuon::linalg::threads());
  // Untimed: grows the pooled workspaces of every worker to this shape and pages them in.
  for (const Path& p : paths) {
    for (dmuon::NsBatchMode mode : modes) time_per_matrix(inputs, probe_k, s, options_for(p, mode));
  }

  std::vector<Row> rows;
  std::vector<dmuon::NsBatchMode> chosen;
  for (const Path& p : paths) {
    Row row{p.name, dmuon::to_string(dmuon::ns_resolve_algo(p.algo, s.rows, s.cols)), "", p.dtype, {}, {}};
    dmuon::NsBatchMode best_mode = modes[0];
    if (modes.size() > 1) {
      double best = 1e30;
      for (dmuon::NsBatchMode mode : modes) {
        const double t = time_per_matrix(inputs, probe_k, s, options_for(p, mode)).wall;
        row.probe[dmuon::to_string(mode)] = t;
        if (t < best) best = t, best_mode = mode;
      }
    }
    row.mode = dmuon::to_string(best_mode);
    chosen.push_back(best_mode);
    rows.push_back(row);
  }
  // Repeats interleave the paths (reference, standard, gram, auto, reference, ...) so that a change
  // in the machine's load during the run reaches every path alike and the ratios stay comparable.
  const size_t n_paths = std::size(paths);
  std::vector<std::vector<double>> wall(n_paths), cpu(n_paths);
  for (int r = 0; r < args.repeats; ++r) {
    std::fprintf(stderr, "bench ns: %lldx%lld, batch %d, repeat %d of %d\n", static_cast<long long>(s.rows),
                 static_cast<long long>(s.cols), args.batch, r + 1, args.repeats);
    for (size_t i = 0; i < n_paths; ++i) {
      const Timing t = time_per_matrix(inputs, k, s, options_for(paths[i], chosen[i]));
      wall[i].push_back(t.wall);
      cpu[i].push_back(t.cpu);
    }
  }
  for (size_t i = 0; i < n_paths; ++i) rows[i].seconds = {dmuon::median(wall[i]), dmuon::median(cpu[i])};
  return rows;
}

// Split Newton–Schulz against the whole matrix, per shape (--split-heads): median seconds of each over `repeats`
// interleaved runs after an untimed one, wall and CPU.
void run_split_bench(const BenchArgs& args, const std::vector<Shape>& shapes) {
  DMUON_CHECK(!args.device.gpu(), "--split-heads: measured on the CPU only");
  DMUON_CHECK(args.split_heads.size() == shapes.size(), "--split-heads: one head count per --shapes entry (",
              shapes.size(), "), got ", args.split_heads.size());
  DMUON_CHECK(args.split_dims.empty() || args.split_dims.size() == shapes.size(),
              "--split-dims: one dimension (0 rows, 1 columns) per --shapes entry (", shapes.size(), "), got ",
              args.split_dims.size());
  if (args.threads > 0) dmuon::linalg::set_threads(args.threads);
  nlohmann::json out = {{"cpu", dmuon::linalg::cpu_model()},
                        {"blas", dmuon::linalg::blas_description()},
                        {"threads", dmuon::linalg::threads()},
                        {"repeats", args.repeats},
                        {"steps", 5},
                        {"dtype", "float32"},
                        {"splits", nlohmann::json::array()}};
  dmuon::NsOptions options;  // auto algorithm, keller, 5 steps, float32
  for (size_t i = 0; i < shapes.size(); ++i) {
    const Shape s = shapes[i];
    const int64_t heads = args.split_heads[i], dim = args.split_dims.empty() ? 0 : args.split_dims[i];
    DMUON_CHECK(dim == 0 || dim == 1, "--split-dims: 0 (rows) or 1 (columns), got ", dim);
    const int64_t length = dim == 0 ? s.rows : s.cols;
    DMUON_CHECK(heads >= 1 && length % heads == 0, "--split-heads: ", s.rows, "x", s.cols, " has ", length,
                dim == 0 ? " rows" : " columns", ", not a multiple of ", heads);
    // (block_rows, block_cols): each head's block; a row block is contiguous in the matrix, a column block gathered.
    const Shape block = dim == 0 ? Shape{s.rows / heads, s.cols} : Shape{s.rows, s.cols / heads};
    Inputs whole(1, s);
    std::vector<float> gathered(s.rows * s.cols), orthogonal(s.rows * s.cols);
    std::vector<const float*> block_in;
    std::vector<float*> block_out;
    for (int64_t h = 0; h < heads; ++h) {
      float* at = gathered.data() + h * block.rows * block.cols;
      block_in.push_back(dim == 0 ? whole.in[0].data() + h * block.rows * s.cols : at);
      block_out.push_back(dim == 0 ? orthogonal.data() + h * block.rows * s.cols : at);
    }
    const auto run_whole = [&] {
      dmuon::newton_schulz(whole.in[0].data(), whole.out[0].data(), s.rows, s.cols, options);
    };
    const auto run_split = [&] {
      const auto move = [&](bool gather) {  // block h's columns [h·bc, (h+1)·bc) ↔ gathered block h
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t r = 0; r < s.rows; ++r) {
            float* in_block = gathered.data() + (h * s.rows + r) * block.cols;
            float* in_matrix = (gather ? whole.in[0].data() : orthogonal.data()) + r * s.cols + h * block.cols;
            if (gather) std::copy(in_matrix, in_matrix + block.cols, in_block);
            else std::copy(in_block, in_block + block.cols, in_matrix);
          }
      };
      if (dim == 1) move(true);
      dmuon::newton_schulz_batched(block_in, block_out, block.rows, block.cols, options);
      if (dim == 1) move(false);
    };
    run_whole(), run_split();  // untimed: workspaces grown and paged in
    std::vector<double> wall[2], cpu[2];
    for (int r = 0; r < args.repeats; ++r) {
      std::fprintf(stderr, "bench ns: %lldx%lld split %lld, repeat %d of %d\n", static_cast<long long>(s.rows),
                   static_cast<long long>(s.cols), static_cast<long long>(heads), r + 1, args.repeats);
      for (int which = 0; which < 2; ++which) {
        const Stopwatch watch;
        which == 0 ? run_whole() : run_split();
        const Timing t = watch.elapsed();
        wall[which].push_back(t.wall), cpu[which].push_back(t.cpu);
      }
    }
    const double whole_s = dmuon::median(wall[0]), split_s = dmuon::median(wall[1]);
    out["splits"].push_back({{"rows", s.rows},
                             {"cols", s.cols},
                             {"heads", heads},
                             {"split_dim", dim},
                             {"block_rows", block.rows},
                             {"block_cols", block.cols},
                             {"whole_algo", dmuon::to_string(dmuon::ns_resolve_algo(options.algo, s.rows, s.cols))},
                             {"block_algo",
                              dmuon::to_string(dmuon::ns_resolve_algo(options.algo, block.rows, block.cols))},
                             {"whole_seconds", whole_s},
                             {"split_seconds", split_s},
                             {"whole_cpu_seconds", dmuon::median(cpu[0])},
                             {"split_cpu_seconds", dmuon::median(cpu[1])},
                             {"speedup", whole_s / split_s}});
  }
  if (args.json) {
    std::printf("%s\n", out.dump(1).c_str());
    return;
  }
  std::printf("Split Newton-Schulz against the whole matrix: 5 steps, keller, float32, auto algorithm; %s; %s; "
              "%d BLAS threads, median of %d\n\n",
              out["cpu"].get<std::string>().c_str(), out["blas"].get<std::string>().c_str(), out["threads"].get<int>(),
              args.repeats);
  std::printf("%-11s %6s %-7s %-9s %-9s %-9s %10s %10s %8s %10s %10s\n", "shape", "heads", "by", "block", "algo",
              "blk algo", "whole ms", "split ms", "speedup", "whole cpu", "split cpu");
  for (const auto& js : out["splits"]) {
    const std::string shape = std::to_string(js["rows"].get<int64_t>()) + "x" + std::to_string(js["cols"].get<int64_t>());
    const std::string blk =
        std::to_string(js["block_rows"].get<int64_t>()) + "x" + std::to_string(js["block_cols"].get<int64_t>());
    std::printf("%-11s %6lld %-7s %-9s %-9s %-9s %10.2f %10.2f %7.2fx %10.2f %10.2f\n", shape.c_str(),
                static_cast<long long>(js["heads"].get<int64_t>()), js["split_dim"].get<int64_t>() ? "columns" : "rows",
                blk.c_str(), js["whole_algo"].get<std::string>().c_str(), js["block_algo"].get<std::string>().c_str(),
                1e3 * js["whole_seconds"].get<double>(), 1e3 * js["split_seconds"].get<double>(),
                js["speedup"].get<double>(), 1e3 * js["whole_cpu_seconds"].get<double>(),
                1e3 * js["split_cpu_seconds"].get<double>());
  }
}

void run_bench(const BenchArgs& args) {
  DMUON_CHECK(args.batch >= 1, "--batch must be at least 1, got ", args.batch);
  DMUON_CHECK(args.repeats >= 1, "--repeats must be at least 1, got ", args.repeats);
  DMUON_CHECK(args.batch_mode == "best" || args.batch_mode == "sequential" || args.batch_mode == "concurrent",
              "--batch-mode must be best, sequential or concurrent, got '", args.batch_mode, "'");
  const std::vector<Shape> shapes = parse_shapes(args.shapes);
  if (!args.split_heads.empty()) return run_split_bench(args, shapes);
  DMUON_CHECK(args.split_dims.empty(), "--split-dims needs --split-heads");
  if (args.device.gpu()) {  // the same table on a GPU: CUDA-event timings, bf16 iterates by default
    DMUON_CHECK(args.threads == 0 && args.batch_mode == "best", "--threads and --batch-mode are CPU options; a GPU "
                "runs a batch as batched kernels on one stream");
    std::vector<std::pair<int64_t, int64_t>> dims;
    for (const Shape& s : shapes) dims.emplace_back(s.rows, s.cols);
    const auto report = dmuon::bench_ns_on_device(args.device.backend(), dims, args.batch, args.repeats,
                                                  args.device.iterates());
    std::fputs((args.json ? dmuon::device_ns_json(report) : dmuon::device_ns_table(report)).c_str(), stdout);
    std::fflush(stdout);
    const std::string failures = dmuon::device_ns_failures(report);  // every shape still ran and is reported above
    DMUON_CHECK(failures.empty(), "bench ns --device ", args.device.device, ": a shape failed\n", failures);
    return;
  }
  const bool bf16 = dmuon::cpu_backend().supports(dmuon::DType::bf16);
  std::vector<dmuon::DType> dtypes = {dmuon::DType::f32};
  if (args.device.dtype == "bf16") {
    DMUON_CHECK(bf16, "--dtype bf16: ", dmuon::cpu_backend().description(), " computes in float32 only (no oneDNN)");
    dtypes = {dmuon::DType::bf16};
  } else if (args.device.dtype == "auto" && bf16) {
    dtypes.push_back(dmuon::DType::bf16);
  }
  if (args.threads > 0) dmuon::linalg::set_threads(args.threads);
  const int threads = dmuon::linalg::threads();

  std::fprintf(stderr, "bench ns: matrix product peaks (2048^3, %d threads)\n", threads);
  const int peak_repeats = std::max(args.repeats, 3);
  const Timing peak = sgemm_peak_gflops(peak_repeats);
  std::map<std::string, Timing> peaks = {{"openblas_f32", peak}};
  if (bf16) {
    peaks["onednn_f32"] = peak_gflops(peak_repeats, onednn_product_2048(dmuon::DType::f32));
    peaks["onednn_bf16"] = peak_gflops(peak_repeats, onednn_product_2048(dmuon::DType::bf16));
  }
  const auto peak_of = [&](dmuon::DType dtype) { return dtype == dmuon::DType::bf16 ? peaks["onednn_bf16"] : peak; };

  nlohmann::json out = {{"blas", dmuon::linalg::blas_description()},
                        {"cpu", dmuon::linalg::cpu_model()},
                        {"threads", threads},
                        {"batch", args.batch},
                        {"batch_mode", args.batch_mode},
                        {"repeats", args.repeats},
                        {"steps", 5},
                        {"sgemm_peak_gflops", peak.wall},
                        {"sgemm_peak_gflops_cpu", peak.cpu},
                        {"backend", dmuon::cpu_backend().description()},
                        {"peak_gflops", nlohmann::json::object()},
                        {"shapes", nlohmann::json::array()}};
  for (const auto& [name, p] : peaks) out["peak_gflops"][name] = {{"wall", p.wall}, {"cpu", p.cpu}};
  for (const Shape& s : shapes) {
    const std::vector<Row> rows = bench_shape(s, args, dtypes);
    const double flops = dmuon::standard_ns_flops(s.rows, s.cols, 5);
    nlohmann::json js = {{"rows", s.rows}, {"cols", s.cols}, {"paths", nlohmann::json::array()}};
    for (const Row& r : rows) {
      const double gflops = flops / r.seconds.wall / 1e9, gflops_cpu = flops / r.seconds.cpu / 1e9;
      const Timing own = peak_of(r.dtype);
      js["paths"].push_back({{"path", r.path},
                             {"algo", r.algo},
                             {"dtype", dmuon::to_string(r.dtype)},
                             {"batch_mode", r.mode},
                             {"seconds_per_matrix", r.seconds.wall},
                             {"useful_gflops", gflops},
                             {"fraction_of_peak", gflops / own.wall},
                             {"ratio_to_reference", r.seconds.wall / rows[0].seconds.wall},
                             {"cpu_seconds_per_matrix", r.seconds.cpu},
                             {"fraction_of_peak_cpu", gflops_cpu / own.cpu},
                             {"cpu_ratio_to_reference", r.seconds.cpu / rows[0].seconds.cpu},
                             {"probe_seconds_by_mode", r.probe}});
    }
    out["shapes"].push_back(js);
  }

  if (args.json) {
    std::printf("%s\n", out.dump(1).c_str());
    return;
  }
  std::printf("Newton-Schulz, 5 steps, keller; %s; %s\n", out["backend"].get<std::string>().c_str(),
              out["cpu"].get<std::string>().c_str());
  std::printf(
      "%d BLAS threads, batch %d (%s), median of %d; sgemm peak %.1f GFLOP/s wall, %.1f cpu (2048^3, best of %d)\n",
      threads, args.batch, args.batch_mode.c_str(), args.repeats, peak.wall, peak.cpu, std::max(args.repeats, 3));
  for (const auto& [name, p] : peaks) {
    if (name != "openblas_f32") std::printf("%s peak %.1f GFLOP/s wall, %.1f cpu (2048^3)\n", name.c_str(), p.wall, p.cpu);
  }
  std::printf(
      "useful GFLOP/s = plain standard flops (20m^2n + 10m^3) / wall time; cpu = process CPU time / threads;\n"
      "%% peak: of the row's own precision (float32: the sgemm peak; bfloat16: onednn_bf16)\n\n");
  std::printf("%-11s %-10s %-9s %-9s %-10s %10s %8s %8s %7s %10s %8s %7s\n", "shape", "path", "algo", "dtype", "mode",
              "ms/matrix", "GFLOP/s", "% peak", "x ref", "cpu ms", "cpu %pk", "cpu x");
  for (const auto& js : out["shapes"]) {
    const std::string shape =
        std::to_string(js["rows"].get<int64_t>()) + "x" + std::to_string(js["cols"].get<int64_t>());
    for (const auto& p : js["paths"]) {
      std::printf("%-11s %-10s %-9s %-9s %-10s %10.2f %8.1f %7.1f%% %7.3f %10.2f %7.1f%% %7.3f\n", shape.c_str(),
                  p["path"].get<std::string>().c_str(), p["algo"].get<std::string>().c_str(),
                  p["dtype"].get<std::string>().c_str(),
                  p["batch_mode"].get<std::string>().c_str(), 1e3 * p["seconds_per_matrix"].get<double>(),
                  p["useful_gflops"].get<double>(), 100 * p["fraction_of_peak"].get<double>(),
                  p["ratio_to_reference"].get<double>(), 1e3 * p["cpu_seconds_per_matrix"].get<double>(),
                  100 * p["fraction_of_peak_cpu"].get<double>(), p["cpu_ratio_to_reference"].get<double>());
    }
  }
}

dmuon::cli::Registration reg("", [](CLI::App& bench) {
  auto args = std::make_shared<BenchArgs>();
  auto* c = bench.add_subcommand("ns", "Newton-Schulz speed per shape: reference, standard (SYRK), gram, auto");
  c->add_option("--shapes", args->shapes, "comma-separated ROWSxCOLS")->capture_default_str();
  c->add_option("--batch", args->batch, "same-shape matrices per newton_schulz_batched call")
      ->capture_default_str()
      ->check(dmuon::cli::at_least(1));
  c->add_option("--batch-mode", args->batch_mode, "best (time both, report the faster) | sequential | concurrent")
      ->capture_default_str();
  c->add_option("--threads", args->threads, "BLAS threads (0: OpenBLAS's setting)")
      ->capture_default_str()
      ->check(dmuon::cli::thread_count());
  c->add_option("--repeats", args->repeats, "timed runs per row (median reported)")
      ->capture_default_str()
      ->check(dmuon::cli::at_least(1));
  c->add_option("--split-heads", args->split_heads,
                "split Newton-Schulz: per shape, the heads its blocks are (comma-separated, as --shapes); "
                "compares the blocks batched with the whole matrix instead of the paths (none: the paths)")
      ->delimiter(',');
  c->add_option("--split-dims", args->split_dims, "with --split-heads: per shape 0 (rows) or 1 (columns); default 0")
      ->delimiter(',');
  c->add_flag("--json", args->json, "print one JSON object instead of the table");
  args->device.add_to(c);
  c->callback([args] { run_bench(*args); });
});

}  // namespace ns_bench
