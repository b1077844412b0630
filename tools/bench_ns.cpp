// `dmuon bench ns`: Newton–Schulz speed per shape (DESIGN 2.5). Measures the machine's sgemm peak
// and, per shape, the `reference` row (plain recurrence, full sgemm: the cost of the public
// reference code) beside `standard` (SYRK), `gram` and `auto`. Useful GFLOP/s is always the plain
// standard flop count over the time, so a path doing fewer flops can pass the peak.
//
// With --batch K > 1 each row runs K same-shape matrices through newton_schulz_batched; with
// --batch-mode best (the default) one run of each mode picks the faster, which is then timed and
// reported with its name (the JSON also gives each mode's first-run time).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "cli.hpp"
#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/ns.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct BenchArgs {
  std::string shapes = "896x4864,4864x896,896x896,128x896,2048x2048";
  std::string batch_mode = "best";
  int batch = 1, threads = 0, repeats = 2;  // 2: `make demo` stays under 2 minutes on 2 cores
  bool json = false;
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

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Best-of-`repeats` GFLOP/s of a 2048³ sgemm with the current BLAS threads.
double sgemm_peak_gflops(int repeats) {
  constexpr int64_t n = 2048;
  std::vector<float> a(n * n, 0.5f), b(n * n, 0.25f), c(n * n);
  double best = 1e30;
  for (int r = 0; r < repeats + 1; ++r) {  // the first run warms up and is not counted
    const auto t0 = Clock::now();
    dmuon::linalg::gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    if (r > 0) best = std::min(best, seconds_since(t0));
  }
  return 2.0 * n * n * n / best / 1e9;
}

struct Row {
  std::string path, algo, mode;
  double seconds = 0;                   // median seconds per matrix in `mode`
  std::map<std::string, double> probe;  // batch mode → seconds per matrix of its first run
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

// Seconds per matrix of one batched run.
double time_per_matrix(Inputs& inputs, Shape s, const dmuon::NsOptions& options) {
  const auto t0 = Clock::now();
  dmuon::newton_schulz_batched(inputs.in_ptrs, inputs.out_ptrs, s.rows, s.cols, options);
  return seconds_since(t0) / inputs.in.size();
}

// Per path: with several batch modes, one timed run of each picks the faster mode (that run counts
// as its first sample); the chosen mode then runs until it has `repeats` samples.
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
  // Untimed: grows the pooled workspaces of every worker to this shape and pages them in.
  for (dmuon::NsBatchMode mode : modes) time_per_matrix(inputs, s, options_for(paths[2], mode));

  std::vector<Row> rows;
  for (const Path& p : paths) {
    std::fprintf(stderr, "bench ns: %lldx%lld %s, batch %d, %d repeats\n", static_cast<long long>(s.rows),
                 static_cast<long long>(s.cols), p.name, args.batch, args.repeats);
    Row row{p.name, dmuon::to_string(dmuon::ns_resolve_algo(p.algo, s.rows, s.cols)), "", 0, {}};
    double best = 1e30;
    dmuon::NsBatchMode chosen = modes[0];
    for (dmuon::NsBatchMode mode : modes) {
      const double t = time_per_matrix(inputs, s, options_for(p, mode));
      row.probe[dmuon::to_string(mode)] = t;
      if (t < best) best = t, chosen = mode;
    }
    std::vector<double> samples = {best};
    while (static_cast<int>(samples.size()) < args.repeats) {
      samples.push_back(time_per_matrix(inputs, s, options_for(p, chosen)));
    }
    row.mode = dmuon::to_string(chosen);
    row.seconds = median(samples);
    rows.push_back(row);
  }
  return rows;
}

void run_bench(const BenchArgs& args) {
  DMUON_CHECK(args.batch >= 1, "--batch must be at least 1, got ", args.batch);
  DMUON_CHECK(args.repeats >= 1, "--repeats must be at least 1, got ", args.repeats);
  DMUON_CHECK(args.batch_mode == "best" || args.batch_mode == "sequential" || args.batch_mode == "concurrent",
              "--batch-mode must be best, sequential or concurrent, got '", args.batch_mode, "'");
  const std::vector<Shape> shapes = parse_shapes(args.shapes);
  if (args.threads > 0) dmuon::linalg::set_threads(args.threads);
  const int threads = dmuon::linalg::threads();

  std::fprintf(stderr, "bench ns: sgemm peak (2048^3, %d threads)\n", threads);
  const double peak = sgemm_peak_gflops(std::max(args.repeats, 3));

  nlohmann::json out = {{"blas", dmuon::linalg::blas_description()},
                        {"cpu", dmuon::linalg::cpu_model()},
                        {"threads", threads},
                        {"batch", args.batch},
                        {"batch_mode", args.batch_mode},
                        {"repeats", args.repeats},
                        {"steps", 5},
                        {"sgemm_peak_gflops", peak},
                        {"shapes", nlohmann::json::array()}};
  for (const Shape& s : shapes) {
    const std::vector<Row> rows = bench_shape(s, args);
    const double flops = dmuon::standard_ns_flops(s.rows, s.cols, 5);
    nlohmann::json js = {{"rows", s.rows}, {"cols", s.cols}, {"paths", nlohmann::json::array()}};
    for (const Row& r : rows) {
      const double gflops = flops / r.seconds / 1e9;
      js["paths"].push_back({{"path", r.path},
                             {"algo", r.algo},
                             {"batch_mode", r.mode},
                             {"seconds_per_matrix", r.seconds},
                             {"useful_gflops", gflops},
                             {"fraction_of_peak", gflops / peak},
                             {"ratio_to_reference", r.seconds / rows[0].seconds},
                             {"first_run_seconds_by_mode", r.probe}});
    }
    out["shapes"].push_back(js);
  }

  if (args.json) {
    std::printf("%s\n", out.dump(1).c_str());
    return;
  }
  std::printf("Newton-Schulz, 5 steps, keller, float32; %s; %s\n", out["blas"].get<std::string>().c_str(),
              out["cpu"].get<std::string>().c_str());
  std::printf("%d BLAS threads, batch %d (%s), median of %d; sgemm peak %.1f GFLOP/s (2048^3, best of %d)\n", threads,
              args.batch, args.batch_mode.c_str(), args.repeats, peak, std::max(args.repeats, 3));
  std::printf("useful GFLOP/s = plain standard flops (20m^2n + 10m^3) / time\n\n");
  std::printf("%-11s %-10s %-9s %-10s %12s %10s %8s %7s\n", "shape", "path", "algo", "mode", "ms/matrix", "GFLOP/s",
              "% peak", "x ref");
  for (const auto& js : out["shapes"]) {
    const std::string shape =
        std::to_string(js["rows"].get<int64_t>()) + "x" + std::to_string(js["cols"].get<int64_t>());
    for (const auto& p : js["paths"]) {
      std::printf("%-11s %-10s %-9s %-10s %12.2f %10.1f %7.1f%% %7.3f\n", shape.c_str(),
                  p["path"].get<std::string>().c_str(), p["algo"].get<std::string>().c_str(),
                  p["batch_mode"].get<std::string>().c_str(), 1e3 * p["seconds_per_matrix"].get<double>(),
                  p["useful_gflops"].get<double>(), 100 * p["fraction_of_peak"].get<double>(),
                  p["ratio_to_reference"].get<double>());
    }
  }
}

dmuon::cli::Registration reg("bench", [](CLI::App& bench) {
  auto args = std::make_shared<BenchArgs>();
  auto* c = bench.add_subcommand("ns", "Newton-Schulz speed per shape: reference, standard (SYRK), gram, auto");
  c->add_option("--shapes", args->shapes, "comma-separated ROWSxCOLS")->capture_default_str();
  c->add_option("--batch", args->batch, "same-shape matrices per newton_schulz_batched call")->capture_default_str();
  c->add_option("--batch-mode", args->batch_mode, "best (time both, report the faster) | sequential | concurrent")
      ->capture_default_str();
  c->add_option("--threads", args->threads, "BLAS threads (0: OpenBLAS's setting)")->capture_default_str();
  c->add_option("--repeats", args->repeats, "timed runs per row (median reported)")->capture_default_str();
  c->add_flag("--json", args->json, "print one JSON object instead of the table");
  c->callback([args] { run_bench(*args); });
});

}  // namespace
