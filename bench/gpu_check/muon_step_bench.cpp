// The device Muon step benchmark (muon_step_bench.hpp).
#include "muon_step_bench.hpp"

#include <cmath>
#include <cstdio>
#include <exception>
#include <random>
#include <sstream>

#include "device_ns_bench.hpp"
#include "dmuon/error.hpp"
#include "dmuon/ns.hpp"
#include "dmuon/statistics.hpp"
#include "dmuon/update_rules.hpp"

namespace dmuon {

namespace {

constexpr float kLr = 0.02f, kMomentum = 0.95f;

// One bucket's device state: weights, gradients and momentum of its matrices, the update stack and the norms.
struct BucketState {
  MuonBucket shape;
  Buffer w, g, m, u, norms;
  std::vector<MatView> stack;  // the matrices of u
  float scale = 1;             // s = sqrt(max(1, rows/cols)) (torch.optim.Muon's default adjustment)

  BucketState(Backend& backend, const MuonBucket& b, std::mt19937& rng) : shape(b) {
    const int64_t size = b.rows * b.cols, n = size * b.count;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> host(static_cast<size_t>(n));
    for (float& x : host) x = 0.02f * normal(rng);
    w = Buffer(backend, DType::f32, n);
    w.upload(host);
    for (float& x : host) x = 1e-3f * normal(rng);
    g = Buffer(backend, DType::f32, n);
    g.upload(host);
    m = Buffer(backend, DType::f32, n);
    backend.fill(m.view(1, n), 0.0f);
    u = Buffer(backend, DType::f32, n);
    norms = Buffer(backend, DType::f32, 2 * b.count);  // b.count doubles: the finiteness check stays on the device
    for (int64_t i = 0; i < b.count; ++i) stack.push_back(u.view(b.rows, b.cols, 1, i * size));
    scale = static_cast<float>(std::sqrt(std::max(1.0, static_cast<double>(b.rows) / b.cols)));
  }
  void momentum(Backend& backend) {
    const size_t n = static_cast<size_t>(u.size());
    backend.run({rules::MuonMomentum{.grad = DeviceSpan(backend, g.f32(), n),
                                     .momentum = DeviceSpan(backend, m.f32(), n),
                                     .u = DeviceSpan(backend, u.f32(), n),
                                     .one_minus_beta = 1.0f - kMomentum,
                                     .beta = kMomentum,
                                     .nesterov = true}});
  }
  void orthogonalize(Backend& backend, const NsOptions& options) {
    newton_schulz_batched(backend, stack, stack, options, {}, reinterpret_cast<double*>(norms.data()));
  }
  void apply(Backend& backend) {
    const int64_t size = shape.rows * shape.cols;
    for (int64_t i = 0; i < shape.count; ++i)
      backend.run({rules::MuonApply{.w = DeviceSpan(backend, w.f32() + i * size, static_cast<size_t>(size)),
                                    .o = DeviceSpan(backend, u.f32() + i * size, static_cast<size_t>(size)),
                                    .neg_lr = -kLr,
                                    .scale = scale}});
  }
};

}  // namespace

std::vector<MuonBucket> parse_buckets(const std::string& list) {
  std::vector<MuonBucket> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t end = std::min(list.find(',', start), list.size());
    const std::string item = list.substr(start, end - start);
    long long r = 0, c = 0, k = 1;
    char tail = 0;
    const int got = std::sscanf(item.c_str(), "%lldx%lld:%lld%c", &r, &c, &k, &tail);
    DMUON_CHECK((got == 2 || got == 3) && r > 0 && c > 0 && k > 0, "--shapes: '", item,
                "' is not ROWSxCOLS or ROWSxCOLS:COUNT");
    out.push_back({r, c, k, 0, {}});
    start = end + 1;
  }
  return out;
}

MuonStepReport bench_muon_step(Backend& backend, std::vector<MuonBucket> buckets, int repeats) {
  DMUON_CHECK(repeats >= 1, "repeats must be at least 1, got ", repeats);
  MuonStepReport report;
  report.device = backend.description();
  report.repeats = repeats;
  NsOptions options = device_ns_path_options("auto", DType::bf16);
  std::mt19937 rng(2024);
  std::vector<BucketState> states;
  for (const MuonBucket& b : buckets) {
    states.emplace_back(backend, b, rng);
    report.parameters += b.rows * b.cols * b.count;
  }
  const auto step = [&] {
    for (BucketState& s : states) s.momentum(backend);
    for (BucketState& s : states) s.orthogonalize(backend, options);
    for (BucketState& s : states) s.apply(backend);
  };
  try {
    step();  // untimed: workspaces (freeing what earlier buckets' graphs named), cuBLAS heuristics, CUDA graphs
    step();  // untimed: the graphs the first step's workspace growth left stale, recorded at their final addresses
    for (int i = 0; i < repeats; ++i) report.step_seconds_all.push_back(backend.time_queued(step));
    report.step_seconds = median(report.step_seconds_all);
  } catch (const std::exception& e) {
    report.error = e.what();
    report.step_seconds_all.clear();
  }
  for (BucketState& s : states) {
    MuonBucket b = s.shape;
    try {
      b.ns_seconds = median_seconds_on(backend, 1, repeats, [&] { s.orthogonalize(backend, options); });
    } catch (const std::exception& e) {
      b.error = e.what();
    }
    report.buckets.push_back(b);
  }
  return report;
}

std::string muon_step_failures(const MuonStepReport& r) {
  std::string out;
  if (!r.error.empty()) out += "FAIL bench muon step: " + r.error + "\n";
  for (const MuonBucket& b : r.buckets)
    if (!b.error.empty())
      out += "FAIL bench muon " + std::to_string(b.count) + " x " + std::to_string(b.rows) + "x" +
             std::to_string(b.cols) + ": " + b.error + "\n";
  return out;
}

std::string muon_step_json(const MuonStepReport& r) {
  std::ostringstream os;
  os.precision(9);
  os << "{\"device\": " << json_string(r.device) << ", \"optimizer\": \"dmuon device muon step\", \"repeats\": "
     << r.repeats << ", \"matrices\": ";
  int64_t matrices = 0;
  for (const MuonBucket& b : r.buckets) matrices += b.count;
  os << matrices << ", \"parameters\": " << r.parameters << ", \"step_s_median\": ";
  if (r.error.empty()) {
    os << r.step_seconds;
  } else {
    os << "null, \"error\": " << json_string(r.error);
  }
  os << ", \"step_s\": [";
  for (size_t i = 0; i < r.step_seconds_all.size(); ++i) os << (i ? ", " : "") << r.step_seconds_all[i];
  os << "], \"buckets\": [";
  for (size_t i = 0; i < r.buckets.size(); ++i) {
    const MuonBucket& b = r.buckets[i];
    os << (i ? ", " : "") << "{\"rows\": " << b.rows << ", \"cols\": " << b.cols << ", \"count\": " << b.count
       << ", \"ns_s_median\": " << b.ns_seconds;
    if (!b.error.empty()) os << ", \"error\": " << json_string(b.error);
    os << "}";
  }
  os << "]}\n";
  return os.str();
}

std::string muon_step_table(const MuonStepReport& r) {
  std::ostringstream os;
  os << r.device << "\nMuon step (momentum, batched bf16 Newton-Schulz per shape, apply) on " << r.parameters
     << " parameters: ";
  if (r.error.empty()) {
    os << "median " << 1e3 * r.step_seconds << " ms over " << r.repeats << " steps\n";
  } else {
    os << "FAIL: " << r.error << "\n";
  }
  for (const MuonBucket& b : r.buckets) {
    os << "  " << b.count << " x " << b.rows << "x" << b.cols << ": Newton-Schulz ";
    if (b.error.empty()) {
      os << 1e3 * b.ns_seconds << " ms\n";
    } else {
      os << "FAIL: " << b.error << "\n";
    }
  }
  return os.str();
}

}  // namespace dmuon
