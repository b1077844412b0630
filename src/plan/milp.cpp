// The MILP balancer: minimise the makespan C over integer counts y[c][r] of items of class c on rank r.
//
// Items with equal (time, bytes, layout[, unit when spreading]) form a class: they are interchangeable, so
// counting them instead of placing each one removes the item symmetry that makes a binary x[i][r]
// model slow (Qwen2.5-7B has 196 matrices but 3 classes under flop costs). A class may go only to its
// candidate owners (under a mesh, the ranks holding its matrices: plan.hpp candidate_owners). Rank symmetry is
// broken by ordering by load the ranks that every class sees alike (all ranks without a mesh layout; under one,
// the ranks holding equal parts of every class), and C starts at the combinatorial lower bound.
//   minimise C
//   Σ_c t_c·y[c][r] ≤ C                  every rank r
//   Σ_r y[c][r] = n_c                    every class c;  y[c][r] = 0 where r is not a candidate of c
//   Σ_c s_c·y[c][r] ≤ memory cap         every rank r
//   Σ_{c in unit u} y[c][r] ≤ ⌈n_u/D⌉    every unit u and rank r (when spreading)
//   Σ_c t_c·(y[c][r] − y[c][r']) ≥ 0     r, r' consecutive in one group of alike ranks
// Times are scaled by the lower bound and bytes by the cap so coefficients are of order 1.
// Then, only where some class's candidates hold different parts of it (an owner there saves step() bytes), a
// second solve keeps C at the first one's and minimises the step() bytes: Σ_c Σ_r (h_c,max − h_c[r])·y[c][r],
// h_c[r] the elements rank r holds of a class-c matrix (an owner receives and sends 2·(R+1)·numel − 2·h[r]
// elements' worth: plan.hpp add_step_bytes). So the bytes never cost NS time: the makespan is the first solve's.
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
  double time = 0;              // scaled
  double bytes = 0;             // scaled
  int unit = -1;                // −1 unless spreading
  std::vector<int64_t> held;    // per rank, elements of one of its matrices (PlanItem::held; empty: no layout)
  std::vector<int> items;       // item indices, ascending ParamSpec index

  bool may_own(int r) const { return held.empty() || held[r] > 0; }
  int64_t held_on(int r) const { return held.empty() ? 0 : held[r]; }
};

std::vector<ItemClass> classify(const std::vector<PlanItem>& items, double time_scale, double bytes_scale,
                                bool by_unit) {
  std::map<std::tuple<double, int64_t, int, std::vector<int64_t>>, int> index;
  std::vector<ItemClass> classes;
  std::vector<int> order(items.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return items[a].param < items[b].param; });
  for (int i : order) {
    const auto& it = items[i];
    auto key = std::make_tuple(it.time_s, it.bytes, by_unit ? it.unit : -1, it.held);
    auto [pos, inserted] = index.try_emplace(key, static_cast<int>(classes.size()));
    if (inserted) classes.push_back({it.time_s / time_scale, it.bytes / bytes_scale, std::get<2>(key), it.held, {}});
    classes[pos->second].items.push_back(i);
  }
  return classes;
}

// Ranks that every class sees alike (equal parts held of each), ascending within a group, groups by first rank:
// permuting the ranks of one group maps a solution to a solution of equal cost.
std::vector<std::vector<int>> alike_ranks(const std::vector<ItemClass>& classes, int ranks) {
  std::map<std::vector<int64_t>, int> group_of;
  std::vector<std::vector<int>> groups;
  for (int r = 0; r < ranks; ++r) {
    std::vector<int64_t> seen;
    for (const auto& cl : classes) seen.push_back(cl.held_on(r));
    auto [pos, inserted] = group_of.try_emplace(seen, static_cast<int>(groups.size()));
    if (inserted) groups.emplace_back();
    groups[pos->second].push_back(r);
  }
  return groups;
}

// Whether some class's candidates hold different parts of it: only then does the owner change step() bytes.
bool owners_differ_in_bytes(const std::vector<ItemClass>& classes, int ranks) {
  for (const auto& cl : classes) {
    int64_t first = -1;
    for (int r = 0; r < ranks; ++r) {
      if (!cl.may_own(r)) continue;
      if (first < 0) first = cl.held_on(r);
      else if (cl.held_on(r) != first) return true;
    }
  }
  return false;
}

struct CbcDeleter {
  void operator()(Cbc_Model* m) const { Cbc_deleteModel(m); }
};

// One CBC model over y[c][r] (column c·ranks + r) and C (the last column). cost_per_y empty: minimise C; else
// minimise Σ cost·y with C ≤ c_upper.
class Solver {
 public:
  Solver(const std::vector<ItemClass>& classes, int ranks, const std::vector<std::vector<int>>& groups,
         const PlanOptions& options)
      : classes_(classes), ranks_(ranks), groups_(groups), options_(options) {
    for (const auto& cl : classes_)
      if (cl.unit >= 0) unit_count_[cl.unit] += static_cast<int>(cl.items.size());
  }

  int columns() const { return static_cast<int>(classes_.size()) * ranks_; }  // the y columns
  int y(int c, int r) const { return c * ranks_ + r; }

  // Solves from `start` (a value per y column); returns the best counts (empty when none) and CBC's verdicts.
  struct Outcome {
    std::vector<double> counts;
    bool optimal = false, infeasible = false, time_limit = false;
  };
  Outcome solve(const std::vector<double>& start, const std::vector<double>& cost_per_y, double c_upper) const {
    std::unique_ptr<Cbc_Model, CbcDeleter> model(Cbc_newModel());
    Cbc_Model* m = model.get();
    Cbc_setLogLevel(m, options_.verbose ? 1 : 0);
    if (!options_.verbose) Cbc_setParameter(m, "log", "0");
    // CBC counts CPU seconds unless told otherwise; the limit is a promise about wall-clock time.
    Cbc_setParameter(m, "timeMode", "elapsed");
    Cbc_setMaximumSeconds(m, options_.time_limit_s);
    // No CGL preprocessing: when the time limit ends a solve inside it, CBC 2.10's CglPreProcess::postProcess
    // reads a null pointer (a sanitized `dmuon plan --time-limit 0.2` crashed so under load in CI's run).
    Cbc_setParameter(m, "preprocess", "off");
    Cbc_setAllowableFractionGap(m, options_.relative_gap);
    add_columns(m, cost_per_y, c_upper);
    add_rows(m);
    std::vector<int> idx(columns());
    std::iota(idx.begin(), idx.end(), 0);
    Cbc_setMIPStartI(m, columns(), idx.data(), start.data());
    Cbc_solve(m);
    Outcome out;
    out.infeasible = Cbc_isProvenInfeasible(m) != 0;
    const double* solution = Cbc_bestSolution(m);
    if (out.infeasible || solution == nullptr) return out;
    out.counts.assign(solution, solution + columns());
    out.optimal = Cbc_isProvenOptimal(m) != 0;
    out.time_limit = Cbc_isSecondsLimitReached(m) != 0;
    return out;
  }

  // The scaled makespan of counts.
  double makespan(const std::vector<double>& counts) const {
    double worst = 0;
    for (int r = 0; r < ranks_; ++r) {
      double load = 0;
      for (size_t c = 0; c < classes_.size(); ++c) load += classes_[c].time * std::lround(counts[y(c, r)]);
      worst = std::max(worst, load);
    }
    return worst;
  }

 private:
  void add_columns(Cbc_Model* m, const std::vector<double>& cost_per_y, double c_upper) const {
    for (size_t c = 0; c < classes_.size(); ++c) {
      double ub = static_cast<double>(classes_[c].items.size());
      if (classes_[c].unit >= 0) ub = std::min(ub, std::ceil(double(unit_count_.at(classes_[c].unit)) / ranks_));
      // CBC matches MIP-start values to columns by name, so every column needs a distinct one.
      for (int r = 0; r < ranks_; ++r) {
        const std::string name = "y_" + std::to_string(c) + "_" + std::to_string(r);
        const double cost = cost_per_y.empty() ? 0.0 : cost_per_y[y(static_cast<int>(c), r)];
        Cbc_addCol(m, name.c_str(), 0.0, classes_[c].may_own(r) ? ub : 0.0, cost, 1, 0, nullptr, nullptr);
      }
    }
    // Scaled: C ≥ lower bound = 1.
    Cbc_addCol(m, "C", 1.0, cost_per_y.empty() ? 1e30 : c_upper, cost_per_y.empty() ? 1.0 : 0.0, 0, 0, nullptr,
               nullptr);
  }

  void add_rows(Cbc_Model* m) const {
    const int n_classes = static_cast<int>(classes_.size());
    const int col_c = columns();
    std::vector<int> cols;
    std::vector<double> coefs;
    auto row = [&](char sense, double rhs) {
      Cbc_addRow(m, "", static_cast<int>(cols.size()), cols.data(), coefs.data(), sense, rhs);
      cols.clear();
      coefs.clear();
    };
    for (int r = 0; r < ranks_; ++r) {  // load ≤ C
      for (int c = 0; c < n_classes; ++c) cols.push_back(y(c, r)), coefs.push_back(classes_[c].time);
      cols.push_back(col_c), coefs.push_back(-1.0);
      row('L', 0.0);
    }
    for (int c = 0; c < n_classes; ++c) {  // every item placed
      for (int r = 0; r < ranks_; ++r) cols.push_back(y(c, r)), coefs.push_back(1.0);
      row('E', static_cast<double>(classes_[c].items.size()));
    }
    for (int r = 0; r < ranks_; ++r) {  // memory (scaled cap = 1)
      for (int c = 0; c < n_classes; ++c) cols.push_back(y(c, r)), coefs.push_back(classes_[c].bytes);
      row('L', 1.0);
    }
    if (options_.spread_units) {
      for (const auto& [unit, count] : unit_count_) {
        for (int r = 0; r < ranks_; ++r) {
          for (int c = 0; c < n_classes; ++c)
            if (classes_[c].unit == unit) cols.push_back(y(c, r)), coefs.push_back(1.0);
          row('L', std::ceil(double(count) / ranks_));
        }
      }
    }
    for (const auto& group : groups_) {  // alike ranks ordered by load
      for (size_t k = 0; k + 1 < group.size(); ++k) {
        for (int c = 0; c < n_classes; ++c) {
          cols.push_back(y(c, group[k])), coefs.push_back(classes_[c].time);
          cols.push_back(y(c, group[k + 1])), coefs.push_back(-classes_[c].time);
        }
        row('G', 0.0);
      }
    }
  }

  const std::vector<ItemClass>& classes_;
  int ranks_;
  const std::vector<std::vector<int>>& groups_;
  const PlanOptions& options_;
  std::map<int, int> unit_count_;  // matrices per unit (classes by unit only when spreading)
};

// The warm start: the given assignment with each group's ranks relabelled by descending load (ties by rank), as
// counts per y column.
std::vector<double> warm_counts(const std::vector<ItemClass>& classes, const Solver& solver, int ranks,
                                const std::vector<std::vector<int>>& groups, const std::vector<int>& warm_start) {
  std::vector<int> class_of(warm_start.size());
  for (size_t c = 0; c < classes.size(); ++c)
    for (int i : classes[c].items) class_of[i] = static_cast<int>(c);
  std::vector<double> load(ranks, 0.0);
  for (size_t i = 0; i < warm_start.size(); ++i) load[warm_start[i]] += classes[class_of[i]].time;
  std::vector<int> relabel(ranks);
  for (const auto& group : groups) {
    std::vector<int> by_load = group;
    std::stable_sort(by_load.begin(), by_load.end(), [&](int a, int b) { return load[a] > load[b]; });
    for (size_t k = 0; k < group.size(); ++k) relabel[by_load[k]] = group[k];
  }
  std::vector<double> start(solver.columns(), 0.0);
  for (size_t i = 0; i < warm_start.size(); ++i) start[solver.y(class_of[i], relabel[warm_start[i]])] += 1.0;
  return start;
}

// Per y column: the elements an owner of class c at rank r does not hold that its best candidate holds, scaled to
// at most 1 (the second solve's objective).
std::vector<double> missing_elements(const std::vector<ItemClass>& classes, const Solver& solver, int ranks) {
  std::vector<double> cost(solver.columns(), 0.0);
  int64_t scale = 1;
  for (const auto& cl : classes)
    for (int r = 0; r < ranks; ++r) scale = std::max(scale, cl.held_on(r));
  for (size_t c = 0; c < classes.size(); ++c) {
    int64_t most = 0;
    for (int r = 0; r < ranks; ++r) most = std::max(most, classes[c].held_on(r));
    for (int r = 0; r < ranks; ++r)
      cost[solver.y(static_cast<int>(c), r)] = static_cast<double>(most - classes[c].held_on(r)) / scale;
  }
  return cost;
}

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
  const auto classes = classify(items, time_scale, bytes_scale, options.spread_units);
  const auto groups = alike_ranks(classes, ranks);
  const Solver solver(classes, ranks, groups, options);

  Solver::Outcome best = solver.solve(warm_counts(classes, solver, ranks, groups, warm_start), {}, 0.0);
  if (best.infeasible) {
    result.status = "CBC: no assignment meets the memory bound" + std::string(options.spread_units ? " and spread" : "");
    return result;
  }
  if (best.counts.empty()) {
    result.status = "CBC found no solution within " + std::to_string(options.time_limit_s) + " s";
    return result;
  }
  result.proven_optimal = best.optimal;
  result.status = best.optimal ? "CBC: optimal"
                               : (best.time_limit ? "CBC: stopped at the time limit"
                                                  : "CBC: stopped before proving optimality");
  if (owners_differ_in_bytes(classes, ranks)) {  // the same makespan, fewer step() bytes
    for (double& count : best.counts) count = static_cast<double>(std::lround(count));
    const double makespan = solver.makespan(best.counts);
    Solver::Outcome fewer = solver.solve(best.counts, missing_elements(classes, solver, ranks), makespan * (1 + 1e-9));
    if (!fewer.counts.empty() && solver.makespan(fewer.counts) <= makespan * (1 + 1e-9)) {
      best.counts = std::move(fewer.counts);
      result.status += fewer.optimal ? "; step() bytes: fewest at this makespan" : "; step() bytes: fewer at this makespan";
    } else {
      result.status += "; step() bytes: not reduced within the time limit";
    }
  }

  result.assignment.assign(items.size(), -1);
  for (size_t c = 0; c < classes.size(); ++c) {
    size_t next = 0;
    for (int r = 0; r < ranks; ++r) {
      const long count = std::lround(best.counts[solver.y(static_cast<int>(c), r)]);
      for (long k = 0; k < count && next < classes[c].items.size(); ++k) result.assignment[classes[c].items[next++]] = r;
    }
    if (next != classes[c].items.size()) {  // rounding left the solution inconsistent: do not trust it
      result.assignment.clear();
      result.status = "CBC returned an inconsistent solution";
      return result;
    }
  }
  return result;
}

}  // namespace dmuon::detail
