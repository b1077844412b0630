// Per-matrix NS costs for the planner: flop estimates and per-shape batching (DESIGN 2.3, 2.6).
#include <algorithm>
#include <map>
#include <tuple>

#include "dmuon/backend_record.hpp"
#include "dmuon/ns.hpp"
#include "dmuon/error.hpp"
#include "dmuon/plan.hpp"

namespace dmuon {

double ns_flops_estimate(int64_t rows, int64_t cols, int steps) {
  NsOptions o;
  o.steps = steps;
  o.algo = NsAlgo::standard;
  const double standard = total_flops(ns_kernel_calls(rows, cols, 1, o));
  o.algo = NsAlgo::gram;
  return std::min(standard, total_flops(ns_kernel_calls(rows, cols, 1, o)));
}

BatchTimeFn flop_batch_time(const HardwareProfile& device) {
  DMUON_CHECK(device.ns_flops > 0 && device.ns_efficiency > 0 && device.ns_efficiency <= 1, "hardware profile '",
              device.name, "' needs ns_flops > 0 and 0 < ns_efficiency ≤ 1");
  const double rate = device.ns_flops * device.ns_efficiency;
  return [rate](int64_t rows, int64_t cols, int batch) { return batch * ns_flops_estimate(rows, cols) / rate; };
}

BatchTimeFn relative_flop_batch_time() {
  HardwareProfile one_tflops;
  one_tflops.name = "1 TFLOP/s";
  one_tflops.ns_flops = 1e12;
  one_tflops.ns_efficiency = 1;
  return flop_batch_time(one_tflops);
}

BatchTimeFn tuned_batch_time(const std::vector<TuneEntry>& entries) {
  std::map<std::tuple<int64_t, int64_t, int>, double> seconds;
  for (const auto& e : entries) seconds[{e.rows, e.cols, e.batch}] = e.seconds;
  return [seconds](int64_t rows, int64_t cols, int batch) {
    auto it = seconds.find({rows, cols, batch});
    DMUON_CHECK(it != seconds.end(), "no tuned time for shape ", rows, "x", cols, " batch ", batch);
    return it->second;
  };
}

std::vector<PlanItem> make_plan_items(const std::vector<ParamSpec>& params, int ranks, const BatchTimeFn& batch_time,
                                      const std::vector<std::vector<MatrixBlock>>& ns_blocks) {
  DMUON_CHECK(ranks >= 1, "rank count must be at least 1, got ", ranks);
  DMUON_CHECK(ns_blocks.empty() || ns_blocks.size() == params.size(), "ns_blocks has ", ns_blocks.size(),
              " entries for ", params.size(), " parameters");
  // The shapes each matrix's Newton-Schulz runs on: its blocks, else itself.
  const auto shapes_of = [&](size_t i) {
    std::vector<std::pair<int64_t, int64_t>> shapes;
    if (!ns_blocks.empty())
      for (const MatrixBlock& b : ns_blocks[i]) shapes.push_back({b.rows, b.cols});
    if (shapes.empty()) shapes.push_back({params[i].rows(), params[i].cols()});
    return shapes;
  };
  std::map<std::pair<int64_t, int64_t>, int> count;
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].role == ParamRole::matrix)
      for (const auto& shape : shapes_of(i)) ++count[shape];
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
    double time_s = 0;
    for (const auto& shape : shapes_of(i)) time_s += per_item[shape];
    items.push_back({static_cast<int>(i), p.rows(), p.cols(), p.unit, time_s,
                     3 * p.numel() * static_cast<int64_t>(sizeof(float))});
  }
  return items;
}

}  // namespace dmuon
