// `dmuon bench ns`: Newton–Schulz speed per shape (DESIGN 2.5). Measures the machine's sgemm peak
// and, per shape, the `reference` row (plain recurrence, full sgemm: the cost of the public
// reference code) beside `standard` (SYRK), `gram` and `auto`. Useful GFLOP/s is always the plain
// standard flop count over the time, so a path doing fewer flops can pass the peak.
//
// With --batch K > 1 each row runs K same-shape matrices through newton_schulz_batched; with
// --batch-mode best (the default) a probe of each mode picks the faster, which is then timed and
// reported with its name (the JSON also gives each mode's probe time).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cli_kit/cli.hpp"
#include "cli_kit/device_args.hpp"
#include "device_ns_bench.hpp"
#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/ns.hpp"
#include "dmuon/statistics.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct BenchArgs {
  std::string shapes = "896x4864,4864x896,896x896,128x896,2048x2048";
  std::string batch_mode = "best";
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

// Best-of-`repeats` GFLOP/s of a 2048³ sgemm with the current BLAS threads (wall and cpu).
Timing sgemm_peak_gflops(int repeats) {
  constexpr int64_t n = 2048;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  Timing best{1e30, 1e30};
  for (int r = 0; r < repeats + 1; ++r) {  // the first run warms up and is not counted
    const Stopwatch watch;
    dmuon::linalg::gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    const Timing t = watch.elapsed();
    if (r > 0) best = {std::min(best.wall, t.wall), std::min(best.cpu, t.cpu)};
  }
  const double flops = 2.0 * n * n * n;
  return {flops / best.wall / 1e9, flops / best.cpu / 1e9};
}

struct Row {
  std::string path, algo, mode;
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
std::vector<Row> bench_shape(Shape s, const BenchArgs& args) {
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
  };
  const Path paths[] = {{"reference", dmuon::NsAlgo::standard, false},
                        {"standard", dmuon::NsAlgo::standard, true},
                        {"gram", dmuon::NsAlgo::gram, true},
                        {"auto", dmuon::NsAlgo::automatic, true}};
  const auto options_for = [](const Path& p, dmuon::NsBatchMode mode) {
    dmuon::NsOptions options;
    options.algo = p.algo;
    options.symmetric = p.symmetric;
    options.batch_mode = mode;
    return options;
  };
  const size_t k = inputs.in.size(), probe_k = std::min<size_t>(k, dmuon::linalg::threads());
  // Untimed: grows the pooled workspaces of every worker to this shape and pages them in.
  for (dmuon::NsBatchMode mode : modes) time_per_matrix(inputs, probe_k, s, options_for(paths[2], mode));

  std::vector<Row> rows;
  std::vector<dmuon::NsBatchMode> chosen;
  for (const Path& p : paths) {
    Row row{p.name, dmuon::to_string(dmuon::ns_resolve_algo(p.algo, s.rows, s.cols)), "", {}, {}};
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

void run_bench(const BenchArgs& args) {
  DMUON_CHECK(args.batch >= 1, "--batch must be at least 1, got ", args.batch);
  DMUON_CHECK(args.repeats >= 1, "--repeats must be at least 1, got ", args.repeats);
  DMUON_CHECK(args.batch_mode == "best" || args.batch_mode == "sequential" || args.batch_mode == "concurrent",
              "--batch-mode must be best, sequential or concurrent, got '", args.batch_mode, "'");
  const std::vector<Shape> shapes = parse_shapes(args.shapes);
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
  DMUON_CHECK(args.device.iterates() == dmuon::DType::f32, "--dtype bf16 needs --device cuda");
  if (args.threads > 0) dmuon::linalg::set_threads(args.threads);
  const int threads = dmuon::linalg::threads();

  std::fprintf(stderr, "bench ns: sgemm peak (2048^3, %d threads)\n", threads);
  const Timing peak = sgemm_peak_gflops(std::max(args.repeats, 3));

  nlohmann::json out = {{"blas", dmuon::linalg::blas_description()},
                        {"cpu", dmuon::linalg::cpu_model()},
                        {"threads", threads},
                        {"batch", args.batch},
                        {"batch_mode", args.batch_mode},
                        {"repeats", args.repeats},
                        {"steps", 5},
                        {"sgemm_peak_gflops", peak.wall},
                        {"sgemm_peak_gflops_cpu", peak.cpu},
                        {"shapes", nlohmann::json::array()}};
  for (const Shape& s : shapes) {
    const std::vector<Row> rows = bench_shape(s, args);
    const double flops = dmuon::standard_ns_flops(s.rows, s.cols, 5);
    nlohmann::json js = {{"rows", s.rows}, {"cols", s.cols}, {"paths", nlohmann::json::array()}};
    for (const Row& r : rows) {
      const double gflops = flops / r.seconds.wall / 1e9, gflops_cpu = flops / r.seconds.cpu / 1e9;
      js["paths"].push_back({{"path", r.path},
                             {"algo", r.algo},
                             {"batch_mode", r.mode},
                             {"seconds_per_matrix", r.seconds.wall},
                             {"useful_gflops", gflops},
                             {"fraction_of_peak", gflops / peak.wall},
                             {"ratio_to_reference", r.seconds.wall / rows[0].seconds.wall},
                             {"cpu_seconds_per_matrix", r.seconds.cpu},
                             {"fraction_of_peak_cpu", gflops_cpu / peak.cpu},
                             {"cpu_ratio_to_reference", r.seconds.cpu / rows[0].seconds.cpu},
                             {"probe_seconds_by_mode", r.probe}});
    }
    out["shapes"].push_back(js);
  }

  if (args.json) {
    std::printf("%s\n", out.dump(1).c_str());
    return;
  }
  std::printf("Newton-Schulz, 5 steps, keller, float32; %s; %s\n", out["blas"].get<std::string>().c_str(),
              out["cpu"].get<std::string>().c_str());
  std::printf(
      "%d BLAS threads, batch %d (%s), median of %d; sgemm peak %.1f GFLOP/s wall, %.1f cpu (2048^3, best of %d)\n",
      threads, args.batch, args.batch_mode.c_str(), args.repeats, peak.wall, peak.cpu, std::max(args.repeats, 3));
  std::printf(
      "useful GFLOP/s = plain standard flops (20m^2n + 10m^3) / wall time; cpu = process CPU time / threads\n\n");
  std::printf("%-11s %-10s %-9s %-10s %10s %8s %8s %7s %10s %8s %7s\n", "shape", "path", "algo", "mode", "ms/matrix",
              "GFLOP/s", "% peak", "x ref", "cpu ms", "cpu %pk", "cpu x");
  for (const auto& js : out["shapes"]) {
    const std::string shape =
        std::to_string(js["rows"].get<int64_t>()) + "x" + std::to_string(js["cols"].get<int64_t>());
    for (const auto& p : js["paths"]) {
      std::printf("%-11s %-10s %-9s %-10s %10.2f %8.1f %7.1f%% %7.3f %10.2f %7.1f%% %7.3f\n", shape.c_str(),
                  p["path"].get<std::string>().c_str(), p["algo"].get<std::string>().c_str(),
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
  c->add_flag("--json", args->json, "print one JSON object instead of the table");
  args->device.add_to(c);
  c->callback([args] { run_bench(*args); });
});

}  // namespace
