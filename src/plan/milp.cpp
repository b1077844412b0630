// The MILP balancer: minimise the makespan C over integer counts y[c][r] of items of class c on rank r.
//
// Items with equal (time, bytes[, unit when spreading]) form a class: they are interchangeable, so
// counting them instead of placing each one removes the item symmetry that makes a binary x[i][r]
// model slow (Qwen2.5-7B has 196 matrices but 3 classes under flop costs). Rank symmetry is broken
// by ordering the ranks by load (load_r ≥ load_{r+1}), and C starts at the combinatorial lower bound.
//   minimise C
//   Σ_c t_c·y[c][r] ≤ C                  every rank r
//   Σ_r y[c][r] = n_c                    every class c
//   Σ_c s_c·y[c][r] ≤ memory cap         every rank r
//   Σ_{c in unit u} y[c][r] ≤ ⌈n_u/D⌉    every unit u and rank r (when spreading)
//   Σ_c t_c·(y[c][r] − y[c][r+1]) ≥ 0    r = 0..D−2
// Times are scaled by the lower bound and bytes by the cap so coefficients are of order 1.
#include "milp.hpp"

#include <Cbc_C_Interface.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <tuple>

#include "dmuon/error.hpp"

namespace dmuon::detail {

namespace {

struct ItemClass {
  double time = 0;            // scaled
  double bytes = 0;           // scaled
  int unit = -1;              // −1 unless spreading
  std::vector<int> items;     // item indices, ascending ParamSpec index
};

std::vector<ItemClass> classify(const std::vector<PlanItem>& items, double time_scale, double bytes_scale,
                                bool by_unit) {
  std::map<std::tuple<double, int64_t, int>, int> index;
  std::vector<ItemClass> classes;
  std::vector<int> order(items.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return items[a].param < items[b].param; });
  for (int i : order) {
    const auto& it = items[i];
    auto key = std::make_tuple(it.time_s, it.bytes, by_unit ? it.unit : -1);
    auto [pos, inserted] = index.try_emplace(key, static_cast<int>(classes.size()));
    if (inserted) classes.push_back({it.time_s / time_scale, it.bytes / bytes_scale, std::get<2>(key), {}});
    classes[pos->second].items.push_back(i);
  }
  return classes;
}

struct CbcDeleter {
  void operator()(Cbc_Model* m) const { Cbc_deleteModel(m); }
};

}  // namespace

MilpResult balance_milp(const std::vector<PlanItem>& items, int ranks, int64_t memory_cap_bytes,
                        const std::vector<int>& warm_start, double lower_bound_s, const PlanOptions& options) {
  MilpResult result;
  if (items.empty()) {
    result.proven_optimal = true;
    result.status = "no matrices";
    return result;
  }
  DMUON_CHECK(options.time_limit_s > 0, "MILP time limit must be positive, got ", options.time_limit_s, " s");
  if (lower_bound_s <= 0) {  // every item costs nothing: any assignment is optimal
    result.assignment = warm_start;
    result.proven_optimal = true;
    result.status = "all items cost zero";
    return result;
  }
  const double time_scale = lower_bound_s;
  const double bytes_scale = std::max<double>(1.0, static_cast<double>(memory_cap_bytes));
  auto classes = classify(items, time_scale, bytes_scale, options.spread_units);
  const int n_classes = static_cast<int>(classes.size());
  auto y = [&](int c, int r) { return c * ranks + r; };
  const int col_c = n_classes * ranks;

  std::unique_ptr<Cbc_Model, CbcDeleter> model(Cbc_newModel());
  Cbc_Model* m = model.get();
  Cbc_setLogLevel(m, options.verbose ? 1 : 0);
  if (!options.verbose) Cbc_setParameter(m, "log", "0");
  // CBC counts CPU seconds unless told otherwise; the limit is a promise about wall-clock time.
  Cbc_setParameter(m, "timeMode", "elapsed");
  Cbc_setMaximumSeconds(m, options.time_limit_s);
  Cbc_setAllowableFractionGap(m, options.relative_gap);

  std::map<int, int> unit_count;
  for (const auto& cl : classes)
    if (cl.unit >= 0) unit_count[cl.unit] += static_cast<int>(cl.items.size());
  for (int c = 0; c < n_classes; ++c) {
    double ub = static_cast<double>(classes[c].items.size());
    if (classes[c].unit >= 0) ub = std::min(ub, std::ceil(double(unit_count[classes[c].unit]) / ranks));
    // CBC matches MIP-start values to columns by name, so every column needs a distinct one.
    for (int r = 0; r < ranks; ++r) {
      const std::string name = "y_" + std::to_string(c) + "_" + std::to_string(r);
      Cbc_addCol(m, name.c_str(), 0.0, ub, 0.0, 1, 0, nullptr, nullptr);
    }
  }
  Cbc_addCol(m, "C", 1.0, 1e30, 1.0, 0, 0, nullptr, nullptr);  // scaled: C ≥ lower bound = 1

  std::vector<int> cols;
  std::vector<double> coefs;
  auto row = [&](char sense, double rhs) {
    Cbc_addRow(m, "", static_cast<int>(cols.size()), cols.data(), coefs.data(), sense, rhs);
    cols.clear();
    coefs.clear();
  };
  for (int r = 0; r < ranks; ++r) {  // load ≤ C
    for (int c = 0; c < n_classes; ++c) cols.push_back(y(c, r)), coefs.push_back(classes[c].time);
    cols.push_back(col_c), coefs.push_back(-1.0);
    row('L', 0.0);
  }
  for (int c = 0; c < n_classes; ++c) {  // every item placed
    for (int r = 0; r < ranks; ++r) cols.push_back(y(c, r)), coefs.push_back(1.0);
    row('E', static_cast<double>(classes[c].items.size()));
  }
  for (int r = 0; r < ranks; ++r) {  // memory (scaled cap = 1)
    for (int c = 0; c < n_classes; ++c) cols.push_back(y(c, r)), coefs.push_back(classes[c].bytes);
    row('L', 1.0);
  }
  if (options.spread_units) {
    for (const auto& [unit, count] : unit_count) {
      for (int r = 0; r < ranks; ++r) {
        for (int c = 0; c < n_classes; ++c)
          if (classes[c].unit == unit) cols.push_back(y(c, r)), coefs.push_back(1.0);
        row('L', std::ceil(double(count) / ranks));
      }
    }
  }
  for (int r = 0; r + 1 < ranks; ++r) {  // ranks ordered by load
    for (int c = 0; c < n_classes; ++c) {
      cols.push_back(y(c, r)), coefs.push_back(classes[c].time);
      cols.push_back(y(c, r + 1)), coefs.push_back(-classes[c].time);
    }
    row('G', 0.0);
  }

  // Warm start: the given assignment with ranks relabelled by descending load (ties by rank).
  {
    std::vector<int> class_of(items.size());
    for (int c = 0; c < n_classes; ++c)
      for (int i : classes[c].items) class_of[i] = c;
    std::vector<double> load(ranks, 0.0);
    for (size_t i = 0; i < items.size(); ++i) load[warm_start[i]] += classes[class_of[i]].time;
    std::vector<int> by_load(ranks);
    std::iota(by_load.begin(), by_load.end(), 0);
    std::stable_sort(by_load.begin(), by_load.end(), [&](int a, int b) { return load[a] > load[b]; });
    std::vector<int> relabel(ranks);
    for (int k = 0; k < ranks; ++k) relabel[by_load[k]] = k;
    std::vector<double> start(col_c, 0.0);
    for (size_t i = 0; i < items.size(); ++i) start[y(class_of[i], relabel[warm_start[i]])] += 1.0;
    std::vector<int> idx(col_c);
    std::iota(idx.begin(), idx.end(), 0);
    Cbc_setMIPStartI(m, col_c, idx.data(), start.data());
  }

  Cbc_solve(m);
  const double* solution = Cbc_bestSolution(m);
  if (Cbc_isProvenInfeasible(m)) {
    result.status = "CBC: no assignment meets the memory bound" + std::string(options.spread_units ? " and spread" : "");
    return result;
  }
  if (solution == nullptr) {
    result.status = "CBC found no solution within " + std::to_string(options.time_limit_s) + " s";
    return result;
  }
  result.assignment.assign(items.size(), -1);
  for (int c = 0; c < n_classes; ++c) {
    size_t next = 0;
    for (int r = 0; r < ranks; ++r) {
      const long count = std::lround(solution[y(c, r)]);
      for (long k = 0; k < count && next < classes[c].items.size(); ++k) result.assignment[classes[c].items[next++]] = r;
    }
    if (next != classes[c].items.size()) {  // rounding left the solution inconsistent: do not trust it
      result.assignment.clear();
      result.status = "CBC returned an inconsistent solution";
      return result;
    }
  }
  result.proven_optimal = Cbc_isProvenOptimal(m) != 0;
  result.status = result.proven_optimal ? "CBC: optimal"
                                        : (Cbc_isSecondsLimitReached(m) ? "CBC: stopped at the time limit"
                                                                        : "CBC: stopped before proving optimality");
  return result;
}

}  // namespace dmuon::detail
