// Per-matrix NS costs for the planner: flop estimates and per-shape batching (DESIGN 2.3, 2.6).
#include <algorithm>
#include <map>

#include "dmuon/backend_record.hpp"
#include "dmuon/error.hpp"
#include "dmuon/plan.hpp"

namespace dmuon {

namespace {
// Peak rates are the vendors' dense figures; efficiencies are what NS's GEMM/SYRK mix reaches
// on large shapes (cpu-dev: measured, DESIGN 5; GPUs: assumed, to be replaced by a GPU tune).
const std::vector<DeviceProfile>& profiles() {
  static const std::vector<DeviceProfile> table = {
      {"cpu-dev", 240e9, 0.8},       // 2 EPYC cores, OpenBLAS sgemm about 240 GFLOP/s
      {"a100-tf32", 156e12, 0.6},    // A100 SXM TF32 tensor cores
      {"h100-tf32", 494.7e12, 0.6},  // H100 SXM TF32 tensor cores (dense)
      {"h100-fp32", 66.9e12, 0.8},   // H100 SXM CUDA-core fp32
      {"h200-tf32", 494.7e12, 0.65}, // H200: H100's compute, more memory bandwidth
  };
  return table;
}
}  // namespace

DeviceProfile device_profile(const std::string& name) {
  for (const auto& p : profiles())
    if (p.name == name) return p;
  std::string known;
  for (const auto& n : device_profile_names()) known += (known.empty() ? "" : ", ") + n;
  DMUON_FAIL("unknown device profile '", name, "' (known: ", known, ")");
}

std::vector<std::string> device_profile_names() {
  std::vector<std::string> names;
  for (const auto& p : profiles()) names.push_back(p.name);
  return names;
}

double ns_flops_estimate(int64_t rows, int64_t cols, int steps) {
  NsOptions o;
  o.steps = steps;
  o.algo = NsAlgo::standard;
  const double standard = total_flops(ns_kernel_calls(rows, cols, 1, o));
  o.algo = NsAlgo::gram;
  return std::min(standard, total_flops(ns_kernel_calls(rows, cols, 1, o)));
}

BatchTimeFn flop_batch_time(const DeviceProfile& device) {
  DMUON_CHECK(device.peak_flops > 0 && device.efficiency > 0 && device.efficiency <= 1, "device profile '",
              device.name, "' needs peak_flops > 0 and 0 < efficiency ≤ 1");
  const double rate = device.peak_flops * device.efficiency;
  return [rate](int64_t rows, int64_t cols, int batch) { return batch * ns_flops_estimate(rows, cols) / rate; };
}

std::vector<PlanItem> make_plan_items(const std::vector<ParamSpec>& params, int ranks, const BatchTimeFn& batch_time) {
  DMUON_CHECK(ranks >= 1, "rank count must be at least 1, got ", ranks);
  std::map<std::pair<int64_t, int64_t>, int> count;
  for (const auto& p : params)
    if (p.role == ParamRole::matrix) ++count[{p.rows(), p.cols()}];
  std::map<std::pair<int64_t, int64_t>, double> per_item;
  for (const auto& [shape, n] : count) {
    const int batch = (n + ranks - 1) / ranks;
    const double t = batch_time(shape.first, shape.second, batch);
    DMUON_CHECK(t >= 0, "negative predicted time ", t, " s for shape ", shape.first, "x", shape.second, " batch ", batch);
    per_item[shape] = t / batch;
  }
  std::vector<PlanItem> items;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& p = params[i];
    if (p.role != ParamRole::matrix) continue;
    items.push_back({static_cast<int>(i), p.rows(), p.cols(), p.unit, per_item[{p.rows(), p.cols()}],
                     3 * p.numel() * static_cast<int64_t>(sizeof(float))});
  }
  return items;
}

}  // namespace dmuon
