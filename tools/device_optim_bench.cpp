// The single-device optimizer step benchmark (device_optim_bench.hpp).
#include "device_optim_bench.hpp"

#include <cmath>
#include <memory>
#include <random>

#include "dmuon/device_timing.hpp"
#include "dmuon/error.hpp"
#include "dmuon/statistics.hpp"
#include "dmuon/ns.hpp"
#include "dmuon/optim.hpp"

namespace dmuon {

namespace {

std::vector<float> gaussian(int64_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = normal(rng);
  return v;
}

}  // namespace

std::vector<DeviceStepResult> bench_optimizer_on_device(Backend& backend, const std::vector<ParamSpec>& params,
                                                        const std::vector<std::string>& optimizers, int steps,
                                                        DType ns_dtype) {
  DMUON_CHECK(steps >= 1, "--steps must be at least 1, got ", steps);
  int64_t total = 0;
  for (const ParamSpec& p : params) total += p.numel();
  std::vector<DeviceStepResult> results;
  for (const std::string& name : optimizers) {
    DMUON_CHECK(name == "adamw" || name == "muon", "on one device, --optim takes adamw and muon, got '", name, "'");
    Buffer values(backend, DType::f32, total), grads(backend, DType::f32, total);
    values.upload(gaussian(total, 1, 0.02f));
    grads.upload(gaussian(total, 2, 1e-3f));
    std::vector<ParamRef> refs;
    int64_t offset = 0;
    for (const ParamSpec& p : params) {
      refs.push_back({p, values.f32() + offset, grads.f32() + offset, 0, -1});
      offset += p.numel();
    }
    std::unique_ptr<Optimizer> opt;
    if (name == "adamw") {
      opt = std::make_unique<AdamW>(refs, OptimizerOptions{}, backend);
    } else {
      NsOptions ns;
      ns.dtype = ns_dtype;
      if (ns_dtype == DType::bf16) ns.restarts = {1, 3};  // DESIGN 2.2: half precision
      opt = std::make_unique<Muon>(refs, OptimizerOptions{}, ns_orthogonalizer(ns), backend);
    }
    opt->step();  // warm-up: state buffers, workspaces, cuBLAS heuristics
    DeviceStepResult r;
    r.optimizer = name;
    for (int s = 0; s < steps; ++s) r.step_s.push_back(time_on(backend, [&] { opt->step(); }));
    r.step_s_median = median(r.step_s);
    r.ns_s = opt->last_stats().ns_s;
    std::vector<float> host(static_cast<size_t>(total));
    values.download(host);
    double sq = 0;
    for (float x : host) sq += static_cast<double>(x) * x;
    r.weight_norm = std::sqrt(sq);
    results.push_back(r);
  }
  return results;
}

}  // namespace dmuon
