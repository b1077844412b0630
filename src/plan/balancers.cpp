// Round-robin and LPT balancers, and the Plan built from any assignment.
#include <algorithm>
#include <chrono>
#include <map>
#include <numeric>
#include <tuple>

#include "dmuon/error.hpp"
#include "dmuon/plan.hpp"
#include "io/enum_names.hpp"
#include "milp.hpp"

namespace dmuon {

namespace {
constexpr EnumName<Balancer> kBalancerNames[] = {{Balancer::rr, "rr"}, {Balancer::lpt, "lpt"}, {Balancer::milp, "milp"}};
}  // namespace

std::string to_string(Balancer b) { return std::string(name_of(kBalancerNames, b)); }
Balancer parse_balancer(const std::string& text) { return parse_name(kBalancerNames, "balancer", text); }

namespace {

void check_ranks(int ranks) { DMUON_CHECK(ranks >= 1, "rank count must be at least 1, got ", ranks); }

// Item indices by descending key, ties by ascending ParamSpec index, so every run orders alike.
template <typename Key>
std::vector<int> order_by_descending(const std::vector<PlanItem>& items, Key key) {
  std::vector<int> order(items.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    if (key(items[a]) != key(items[b])) return key(items[a]) > key(items[b]);
    return items[a].param < items[b].param;
  });
  return order;
}

double lower_bound(const std::vector<PlanItem>& items, int ranks) {
  if (items.empty()) return 0;
  std::vector<double> t;
  for (const auto& it : items) t.push_back(it.time_s);
  std::sort(t.begin(), t.end(), std::greater<>());
  double bound = std::max(std::accumulate(t.begin(), t.end(), 0.0) / ranks, t.front());
  if (static_cast<int>(t.size()) > ranks) bound = std::max(bound, t[ranks - 1] + t[ranks]);
  return bound;
}

}  // namespace

int64_t memory_cap_bytes(const std::vector<PlanItem>& items, int ranks, double memory_slack) {
  check_ranks(ranks);
  DMUON_CHECK(memory_slack >= 0, "memory slack must be ≥ 0, got ", memory_slack);
  int64_t total = 0, largest = 0;
  for (const auto& it : items) {
    total += it.bytes;
    largest = std::max(largest, it.bytes);
  }
  const double cap = (1.0 + memory_slack) * static_cast<double>(total) / ranks;
  return std::max(largest, static_cast<int64_t>(cap));
}

std::vector<int> balance_rr(const std::vector<PlanItem>& items, int ranks) {
  check_ranks(ranks);
  // As KellerJordan/Muon: largest parameters first, then dealt out in turn.
  // Under a mesh, each set of candidates deals out its own turns.
  auto order = order_by_descending(items, [](const PlanItem& it) { return it.rows * it.cols; });
  std::vector<int> rank(items.size());
  std::map<std::vector<int>, size_t> turn;
  for (int i : order) {
    const std::vector<int> candidates = candidate_owners(items[i], ranks);
    rank[i] = candidates[turn[candidates]++ % candidates.size()];
  }
  return rank;
}

namespace {

// LPT; with `spread`, a rank also needs room under its unit's ceil(n_u/D) count to be preferred.
std::vector<int> greedy_lpt(const std::vector<PlanItem>& items, int ranks, int64_t memory_cap_bytes, bool spread) {
  check_ranks(ranks);
  std::vector<double> load(ranks, 0.0);
  std::vector<int64_t> bytes(ranks, 0);
  std::map<int, int> unit_size;
  std::map<std::pair<int, int>, int> unit_on_rank;
  for (const auto& it : items) ++unit_size[it.unit];
  std::vector<int> rank(items.size());
  for (int i : order_by_descending(items, [](const PlanItem& it) { return it.time_s; })) {
    const int unit = items[i].unit;
    const int unit_cap = (unit_size[unit] + ranks - 1) / ranks;
    // Of equal loads, the rank holding the most of it: the fewest step() bytes.
    const auto held = [&](int r) { return items[i].held.empty() ? 0 : items[i].held[r]; };
    const auto lighter = [&](int r, int than) {
      return load[r] < load[than] || (load[r] == load[than] && held(r) > held(than));
    };
    int best = -1, best_any = -1;
    for (int r : candidate_owners(items[i], ranks)) {
      if (best_any < 0 || lighter(r, best_any)) best_any = r;
      const bool fits = bytes[r] + items[i].bytes <= memory_cap_bytes &&
                        (!spread || unit_on_rank[{unit, r}] < unit_cap);
      if (fits && (best < 0 || lighter(r, best))) best = r;
    }
    if (best < 0) best = best_any;
    rank[i] = best;
    load[best] += items[i].time_s;
    bytes[best] += items[i].bytes;
    ++unit_on_rank[{unit, best}];
  }
  return rank;
}

}  // namespace

std::vector<int> balance_lpt(const std::vector<PlanItem>& items, int ranks, int64_t memory_cap_bytes) {
  return greedy_lpt(items, ranks, memory_cap_bytes, false);
}

namespace {

// Fills `plan` (owner, per-rank figures, bounds) from an assignment of items to ranks.
void fill_plan(const std::vector<ParamSpec>& params, const std::vector<PlanItem>& items, int ranks,
               const std::vector<int>& assignment, Plan& plan) {
  plan.ranks = ranks;
  plan.owner.assign(params.size(), -1);
  plan.per_rank.assign(ranks, {});
  std::vector<std::map<std::pair<int64_t, int64_t>, PlanBatch>> batches(ranks);
  std::vector<int64_t> sent(ranks, 0), received(ranks, 0);
  for (size_t i = 0; i < items.size(); ++i) {
    const auto& it = items[i];
    const int r = assignment[i];
    plan.owner[it.param] = r;
    plan.per_rank[r].time_s += it.time_s;
    plan.per_rank[r].bytes += it.bytes;
    add_step_bytes(it, r, sent, received);
    auto& batch = batches[r][{it.rows, it.cols}];
    batch.rows = it.rows;
    batch.cols = it.cols;
    batch.params.push_back(it.param);
    batch.time_s += it.time_s;
  }
  plan.makespan_s = 0;
  plan.memory_ok = true;
  for (int r = 0; r < ranks; ++r) {
    plan.per_rank[r].step_sent_bytes = sent[r];
    plan.per_rank[r].step_received_bytes = received[r];
    for (auto& [shape, batch] : batches[r]) {
      std::sort(batch.params.begin(), batch.params.end());
      plan.per_rank[r].batches.push_back(std::move(batch));
    }
    plan.makespan_s = std::max(plan.makespan_s, plan.per_rank[r].time_s);
    if (plan.per_rank[r].bytes > plan.memory_cap_bytes) plan.memory_ok = false;
  }
  plan.lower_bound_s = lower_bound(items, ranks);
  plan.gap_pct = plan.lower_bound_s > 0 ? 100.0 * (plan.makespan_s - plan.lower_bound_s) / plan.lower_bound_s : 0.0;
  // Equal up to rounding of the sums (relative 1e-9): optimal.
  if (plan.makespan_s <= plan.lower_bound_s * (1 + 1e-9)) {
    plan.proven_optimal = true;
    plan.gap_pct = 0;
  }
}

// Whether no rank holds more than ceil(n_u/D) of any unit u's matrices.
bool respects_spread(const std::vector<PlanItem>& items, int ranks, const std::vector<int>& assignment) {
  std::map<int, int> per_unit;
  std::map<std::pair<int, int>, int> per_unit_rank;
  for (size_t i = 0; i < items.size(); ++i) {
    ++per_unit[items[i].unit];
    ++per_unit_rank[{items[i].unit, assignment[i]}];
  }
  for (const auto& [key, n] : per_unit_rank)
    if (n > (per_unit[key.first] + ranks - 1) / ranks) return false;
  return true;
}

void check_items(const std::vector<ParamSpec>& params, const std::vector<PlanItem>& items, int ranks) {
  for (const auto& it : items) {
    DMUON_CHECK(it.param >= 0 && it.param < static_cast<int>(params.size()), "plan item refers to parameter index ",
                it.param, " but the model has ", params.size(), " parameters");
    const std::string& name = params[it.param].name;
    DMUON_CHECK(it.time_s >= 0 && it.bytes >= 0, "plan item for ", name, " has a negative time or size");
    if (it.held.empty()) continue;
    DMUON_CHECK(static_cast<int>(it.held.size()) == ranks && it.replicas >= 1 && ranks % it.replicas == 0,
                "plan item for ", name, " lies on ", it.held.size(), " ranks in ", it.replicas, " replicas, not on ",
                ranks, " ranks in replicas of equal size");
    DMUON_CHECK(std::any_of(it.held.begin(), it.held.end(), [](int64_t n) { return n > 0; }), "plan item for ", name,
                " is held by no rank");
  }
}

}  // namespace

std::vector<int> balance_memory(const std::vector<PlanItem>& items, int ranks, std::vector<int> assignment,
                                double time_cap_s, bool spread_units) {
  check_ranks(ranks);
  DMUON_CHECK(assignment.size() == items.size(), "balance_memory: ", assignment.size(), " owners for ", items.size(),
              " items");
  std::vector<double> time(ranks, 0.0);
  std::vector<int64_t> bytes(ranks, 0);
  for (size_t i = 0; i < items.size(); ++i) {
    time[assignment[i]] += items[i].time_s;
    bytes[assignment[i]] += items[i].bytes;
  }
  const auto may_own = [&](size_t i, int r) {
    return items[i].held.empty() || items[i].held[r] > 0;  // candidate_owners' rule
  };
  // Every change strictly lowers (the fullest bytes, how many ranks hold them), so the loop ends; the bound on
  // rounds only guards against a bug.
  for (size_t round = 0; round < 4 * items.size() * static_cast<size_t>(ranks) + 4; ++round) {
    const int full = static_cast<int>(std::max_element(bytes.begin(), bytes.end()) - bytes.begin());
    // The best change: the one whose two ranks end the least full, both below the fullest's bytes now.
    int64_t best_max = bytes[full];
    int best_i = -1, best_j = -1, best_q = -1;
    for (size_t i = 0; i < items.size(); ++i) {
      if (assignment[i] != full) continue;
      for (int q = 0; q < ranks; ++q) {
        if (q == full || !may_own(i, q)) continue;
        // Moving i to q.
        if (time[q] + items[i].time_s <= time_cap_s) {
          const int64_t worst = std::max(bytes[full] - items[i].bytes, bytes[q] + items[i].bytes);
          if (worst < best_max) best_max = worst, best_i = static_cast<int>(i), best_j = -1, best_q = q;
        }
        // Swapping i with a smaller matrix j of q.
        for (size_t j = 0; j < items.size(); ++j) {
          if (assignment[j] != q || items[j].bytes >= items[i].bytes || !may_own(j, full)) continue;
          const double dt = items[i].time_s - items[j].time_s;
          if (time[q] + dt > time_cap_s || time[full] - dt > time_cap_s) continue;
          const int64_t db = items[i].bytes - items[j].bytes;
          const int64_t worst = std::max(bytes[full] - db, bytes[q] + db);
          if (worst < best_max)
            best_max = worst, best_i = static_cast<int>(i), best_j = static_cast<int>(j), best_q = q;
        }
      }
    }
    if (best_i < 0) break;
    std::vector<int> changed = assignment;
    changed[best_i] = best_q;
    if (best_j >= 0) changed[best_j] = full;
    if (spread_units && !respects_spread(items, ranks, changed)) break;
    for (const auto& [i, from, to] : {std::tuple{best_i, full, best_q}, std::tuple{best_j, best_q, full}}) {
      if (i < 0) continue;
      time[from] -= items[i].time_s, time[to] += items[i].time_s;
      bytes[from] -= items[i].bytes, bytes[to] += items[i].bytes;
    }
    assignment = std::move(changed);
  }
  return assignment;
}

Plan make_plan(const std::vector<ParamSpec>& params, const std::vector<PlanItem>& items, int ranks,
               const PlanOptions& options) {
  check_ranks(ranks);
  check_items(params, items, ranks);
  const auto start = std::chrono::steady_clock::now();
  DMUON_CHECK(options.memory_balance >= 0, "memory balance must be ≥ 0, got ", options.memory_balance);
  Plan plan;
  plan.balancer = options.balancer;
  plan.memory_balance = options.memory_balance;
  plan.memory_cap_bytes = memory_cap_bytes(items, ranks, options.memory_slack);
  std::vector<int> assignment;
  bool cbc_optimal = false;
  switch (options.balancer) {
    case Balancer::rr: assignment = balance_rr(items, ranks); break;
    case Balancer::lpt: assignment = balance_lpt(items, ranks, plan.memory_cap_bytes); break;
    case Balancer::milp: {
      auto lpt = greedy_lpt(items, ranks, plan.memory_cap_bytes, options.spread_units);
      auto milp = detail::balance_milp(items, ranks, plan.memory_cap_bytes, lpt, lower_bound(items, ranks), options);
      plan.note = milp.status;
      // Keep CBC's answer only when it exists and is no worse than the LPT start.
      Plan lpt_plan, milp_plan;
      lpt_plan.memory_cap_bytes = milp_plan.memory_cap_bytes = plan.memory_cap_bytes;
      fill_plan(params, items, ranks, lpt, lpt_plan);
      if (!milp.assignment.empty()) fill_plan(params, items, ranks, milp.assignment, milp_plan);
      const bool lpt_valid = lpt_plan.memory_ok && (!options.spread_units || respects_spread(items, ranks, lpt));
      if (milp.assignment.empty() || (milp_plan.makespan_s > lpt_plan.makespan_s * (1 + 1e-9) && lpt_valid)) {
        plan.fell_back = true;
        plan.note = "fell back to LPT: " + (milp.assignment.empty() ? milp.status : "CBC's answer was worse than LPT");
        assignment = std::move(lpt);
      } else {
        assignment = std::move(milp.assignment);
        cbc_optimal = milp.proven_optimal;
      }
      break;
    }
  }
  fill_plan(params, items, ranks, assignment, plan);
  plan.proven_optimal = plan.proven_optimal || cbc_optimal;
  plan.solve_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return options.memory_balance > 0 ? weigh_memory(params, items, ranks, plan, options) : plan;
}

Plan weigh_memory(const std::vector<ParamSpec>& params, const std::vector<PlanItem>& items, int ranks,
                  const Plan& by_time, const PlanOptions& options) {
  DMUON_CHECK(options.memory_balance >= 0, "memory balance must be ≥ 0, got ", options.memory_balance);
  const auto start = std::chrono::steady_clock::now();
  std::vector<int> assignment(items.size());
  for (size_t i = 0; i < items.size(); ++i) assignment[i] = by_time.owner.at(items[i].param);
  Plan plan = by_time;
  plan.memory_balance = options.memory_balance;
  plan.proven_optimal = false;  // fill_plan's: its makespan at the lower bound
  fill_plan(params, items, ranks,
            balance_memory(items, ranks, std::move(assignment), (1 + options.memory_balance) * by_time.makespan_s,
                           options.spread_units),
            plan);
  plan.solve_s = by_time.solve_s + std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return plan;
}

Plan plan_from_owners(const std::vector<ParamSpec>& params, const std::vector<PlanItem>& items, int ranks,
                      const std::vector<int>& owner, const PlanOptions& options) {
  check_ranks(ranks);
  check_items(params, items, ranks);
  DMUON_CHECK(owner.size() == params.size(), "owner vector has ", owner.size(), " entries for ", params.size(),
              " parameters");
  std::vector<int> assignment(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const int r = owner[items[i].param];
    DMUON_CHECK(r >= 0 && r < ranks, "matrix ", params[items[i].param].name, " has owner ", r, " outside 0..",
                ranks - 1);
    DMUON_CHECK(items[i].held.empty() || items[i].held[r] > 0, "matrix ", params[items[i].param].name,
                " has owner ", r, ", which holds none of it");
    assignment[i] = r;
  }
  Plan plan;
  plan.balancer = options.balancer;
  plan.memory_cap_bytes = memory_cap_bytes(items, ranks, options.memory_slack);
  fill_plan(params, items, ranks, assignment, plan);
  return plan;
}

std::vector<int> default_owners(const std::vector<ParamSpec>& params, int ranks) {
  PlanOptions options;
  options.balancer = Balancer::lpt;
  return make_plan(params, make_plan_items(params, ranks, relative_flop_batch_time()), ranks, options)
      .owner;
}

}  // namespace dmuon
