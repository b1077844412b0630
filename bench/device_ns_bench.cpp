// Newton–Schulz speed on a device backend (device_ns_bench.hpp).
#include "device_ns_bench.hpp"

#include <cstdio>
#include <exception>
#include <random>
#include <sstream>

#include "dmuon/error.hpp"
#include "dmuon/statistics.hpp"

namespace dmuon {

namespace {

std::string describe_path(const NsOptions& o) {
  std::ostringstream os;
  os << (o.algo == NsAlgo::gram ? "gram" : o.algo == NsAlgo::standard ? "standard" : "auto");
  if (o.algo == NsAlgo::gram) {
    os << " r[";
    for (size_t i = 0; i < o.restarts.size(); ++i) os << (i ? "," : "") << o.restarts[i];
    os << "]";
  }
  if (o.symmetric)
    os << " sym t" << o.tiles;
  else
    os << " full";
  os << " " << to_string(o.dtype);
  return os.str();
}

// Every path of one shape into shape.paths.
void time_paths(Backend& backend, int batch, int repeats, DType dtype, double peak_gflops, std::mt19937& rng,
                DeviceNsShape& shape) {
  const int64_t rows = shape.rows, cols = shape.cols;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t size = rows * cols;
  std::vector<float> host(static_cast<size_t>(size * batch));
  for (float& x : host) x = normal(rng);
  Buffer in(backend, DType::f32, size * batch), out(backend, DType::f32, size * batch);
  in.upload(host);
  std::vector<MatView> u, o;
  for (int i = 0; i < batch; ++i) {
    u.push_back(in.view(rows, cols, 1, i * size));
    o.push_back(out.view(rows, cols, 1, i * size));
  }
  Buffer norms(backend, DType::f32, 2 * batch);  // batch doubles: the check stays on the device, as in a step
  double* norm_slots = reinterpret_cast<double*>(norms.data());
  const double flops = standard_ns_flops(rows, cols, 5);
  for (const std::string path : {"reference", "standard", "gram", "auto"}) {
    const NsOptions options = device_ns_path_options(path, dtype);
    const double s = median_seconds_on(backend, 2, repeats, [&] {
      newton_schulz_batched(backend, u, o, options, {}, norm_slots);
    }) / batch;
    DeviceNsPath p;
    p.path = path;
    p.algo = describe_path(ns_effective_options(options, rows, cols));
    p.seconds_per_matrix = s;
    p.useful_gflops = flops / s / 1e9;
    p.fraction_of_peak = peak_gflops > 0 ? p.useful_gflops / peak_gflops : 0.0;
    p.ratio_to_reference = shape.paths.empty() ? 1.0 : shape.paths[0].seconds_per_matrix / s;
    shape.paths.push_back(p);
  }
}

}  // namespace

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

NsOptions device_ns_path_options(const std::string& path, DType dtype) {
  NsOptions o;
  o.dtype = dtype;
  o.steps = 5;
  if (dtype == DType::bf16) o.restarts = {1, 3};  // DESIGN 2.2: half precision
  if (path == "reference") {
    o.algo = NsAlgo::standard;
    o.symmetric = false;
  } else if (path == "standard") {
    o.algo = NsAlgo::standard;
  } else if (path == "gram") {
    o.algo = NsAlgo::gram;
  } else {
    DMUON_CHECK(path == "auto", "unknown Newton-Schulz path '", path, "'");
  }
  return o;
}

double median_seconds_on(Backend& backend, int warmup, int repeats, const std::function<void()>& run) {
  DMUON_CHECK(repeats >= 1, "repeats must be at least 1, got ", repeats);
  for (int i = 0; i < warmup; ++i) run();
  std::vector<double> s;
  for (int i = 0; i < repeats; ++i) s.push_back(backend.time_queued(run));
  return median(s);
}

double measure_product_gflops(Backend& backend, DType dtype, int64_t n, int repeats) {
  std::vector<float> host(static_cast<size_t>(n * n));
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& x : host) x = normal(rng);
  Buffer a32(backend, DType::f32, n * n), a(backend, dtype, n * n), c(backend, DType::f32, n * n);
  a32.upload(host);
  backend.convert(a32.view(n, n), a.view(n, n));
  const double s = median_seconds_on(backend, 2, repeats,
                                     [&] { backend.gemm(false, true, 1.0f, a.view(n, n), a.view(n, n), 0.0f, c.view(n, n)); });
  return 2.0 * n * n * n / s / 1e9;
}

DeviceNsReport bench_ns_on_device(Backend& backend, const std::vector<std::pair<int64_t, int64_t>>& shapes, int batch,
                                  int repeats, DType dtype, const ProductPeakFn& peak) {
  DMUON_CHECK(batch >= 1, "batch must be at least 1, got ", batch);
  DeviceNsReport report;
  report.device = backend.description();
  report.dtype = to_string(dtype);
  report.batch = batch;
  report.repeats = repeats;
  try {
    report.peak_gflops = peak ? peak(backend, dtype) : measure_product_gflops(backend, dtype);
  } catch (const std::exception& e) {
    report.peak_error = e.what();
  }
  std::mt19937 rng(1234);
  for (const auto& [rows, cols] : shapes) {
    DeviceNsShape shape{rows, cols, {}, {}};
    try {
      time_paths(backend, batch, repeats, dtype, report.peak_gflops, rng, shape);
    } catch (const std::exception& e) {
      shape.error = e.what();
    }
    report.shapes.push_back(shape);
  }
  return report;
}

std::string device_ns_failures(const DeviceNsReport& r) {
  std::string out;
  if (!r.peak_error.empty()) out += "FAIL bench ns product peak: " + r.peak_error + "\n";
  for (const auto& s : r.shapes)
    if (!s.error.empty())
      out += "FAIL bench ns " + std::to_string(s.rows) + "x" + std::to_string(s.cols) + ": " + s.error + "\n";
  return out;
}


std::string device_ns_json(const DeviceNsReport& r) {
  std::ostringstream os;
  os.precision(9);
  os << "{\"device\": " << json_string(r.device) << ", \"dtype\": " << json_string(r.dtype)
     << ", \"peak_gflops\": " << r.peak_gflops;
  if (!r.peak_error.empty()) os << ", \"peak_error\": " << json_string(r.peak_error);
  os << ", \"batch\": " << r.batch << ", \"repeats\": " << r.repeats
     << ", \"shapes\": [";
  for (size_t i = 0; i < r.shapes.size(); ++i) {
    const auto& s = r.shapes[i];
    os << (i ? ", " : "") << "{\"rows\": " << s.rows << ", \"cols\": " << s.cols;
    if (!s.error.empty()) os << ", \"error\": " << json_string(s.error);
    os << ", \"paths\": [";
    for (size_t j = 0; j < s.paths.size(); ++j) {
      const auto& p = s.paths[j];
      os << (j ? ", " : "") << "{\"path\": " << json_string(p.path) << ", \"algo\": " << json_string(p.algo)
         << ", \"seconds_per_matrix\": " << p.seconds_per_matrix << ", \"useful_gflops\": " << p.useful_gflops
         << ", \"fraction_of_peak\": " << p.fraction_of_peak << ", \"ratio_to_reference\": " << p.ratio_to_reference
         << "}";
    }
    os << "]}";
  }
  os << "]}\n";
  return os.str();
}

std::string device_ns_table(const DeviceNsReport& r) {
  std::ostringstream os;
  char line[256];
  std::snprintf(line, sizeof line, "Newton-Schulz, 5 steps, keller, %s iterates, batch %d; %s\n", r.dtype.c_str(),
                r.batch, r.device.c_str());
  os << line;
  std::snprintf(line, sizeof line, "product peak (8192^3 gemm, %s): %.1f TFLOP/s\n", r.dtype.c_str(),
                r.peak_gflops / 1e3);
  os << (r.peak_error.empty() ? std::string(line) : "product peak FAIL: " + r.peak_error + "\n");
  std::snprintf(line, sizeof line, "%-12s %-10s %-28s %12s %10s %8s %8s\n", "shape", "path", "config", "ms/matrix",
                "TFLOP/s", "of peak", "vs ref");
  os << line;
  for (const auto& s : r.shapes) {
    const std::string shape = std::to_string(s.rows) + "x" + std::to_string(s.cols);
    if (!s.error.empty()) os << shape << " FAIL: " << s.error << "\n";
    for (const auto& p : s.paths) {
      std::snprintf(line, sizeof line, "%-12s %-10s %-28s %12.4f %10.1f %7.0f%% %7.2fx\n", shape.c_str(),
                    p.path.c_str(), p.algo.c_str(), 1e3 * p.seconds_per_matrix, p.useful_gflops / 1e3,
                    100 * p.fraction_of_peak, p.ratio_to_reference);
      os << line;
    }
  }
  return os.str();
}

}  // namespace dmuon
