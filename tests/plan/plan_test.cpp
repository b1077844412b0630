// Planner: the balancers against brute force on small instances, the memory bound, the time
// limit, degenerate inputs, and the flop cost model against DESIGN 2.3's table.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>

#include "dmuon/error.hpp"
#include "dmuon/plan.hpp"
#include "dmuon/hardware_profile.hpp"

namespace dmuon {
namespace {

// A model whose parameters are exactly the given items (param i ↔ item i).
struct Instance {
  std::vector<ParamSpec> params;
  std::vector<PlanItem> items;
};

Instance make_instance(const std::vector<double>& times, const std::vector<int64_t>& bytes = {},
                       const std::vector<int>& units = {}) {
  Instance in;
  for (size_t i = 0; i < times.size(); ++i) {
    const int unit = units.empty() ? 0 : units[i];
    const std::string name = std::string("m").append(std::to_string(i));  // not "m" + ...: GCC 12 -Wrestrict
    in.params.push_back({name, {4, 4}, ParamRole::matrix, unit});
    in.items.push_back({static_cast<int>(i), 4, 4, unit, times[i], bytes.empty() ? 64 : bytes[i]});
  }
  return in;
}

std::vector<double> random_times(int n, std::mt19937& rng, int distinct_levels) {
  std::uniform_int_distribution<int> d(1, distinct_levels);
  std::vector<double> t(n);
  for (auto& x : t) x = 1e-3 * d(rng);
  return t;
}

// The best makespan over all D^n assignments that respect the memory cap (∞ when none does).
double brute_force_makespan(const std::vector<PlanItem>& items, int ranks, int64_t cap) {
  const int n = static_cast<int>(items.size());
  std::vector<int> a(n, 0);
  double best = std::numeric_limits<double>::infinity();
  std::function<void(int, std::vector<double>&, std::vector<int64_t>&)> go = [&](int i, std::vector<double>& load,
                                                                                 std::vector<int64_t>& bytes) {
    if (i == n) {
      best = std::min(best, *std::max_element(load.begin(), load.end()));
      return;
    }
    for (int r = 0; r < ranks; ++r) {
      if (bytes[r] + items[i].bytes > cap) continue;
      load[r] += items[i].time_s;
      bytes[r] += items[i].bytes;
      go(i + 1, load, bytes);
      load[r] -= items[i].time_s;
      bytes[r] -= items[i].bytes;
    }
  };
  std::vector<double> load(ranks, 0.0);
  std::vector<int64_t> bytes(ranks, 0);
  go(0, load, bytes);
  return best;
}

PlanOptions milp_options(double time_limit_s = 5.0) {
  PlanOptions o;
  o.balancer = Balancer::milp;
  o.time_limit_s = time_limit_s;
  o.relative_gap = 0;
  return o;
}

// Every rank's figures are what the owner vector says.
void expect_consistent(const Instance& in, const Plan& plan) {
  ASSERT_EQ(plan.owner.size(), in.params.size());
  std::vector<double> load(plan.ranks, 0.0);
  std::vector<int64_t> bytes(plan.ranks, 0);
  for (const auto& it : in.items) {
    const int r = plan.owner[it.param];
    ASSERT_GE(r, 0);
    ASSERT_LT(r, plan.ranks);
    load[r] += it.time_s;
    bytes[r] += it.bytes;
  }
  size_t in_batches = 0;
  for (int r = 0; r < plan.ranks; ++r) {
    EXPECT_NEAR(plan.per_rank[r].time_s, load[r], 1e-12);
    EXPECT_EQ(plan.per_rank[r].bytes, bytes[r]);
    for (const auto& b : plan.per_rank[r].batches) {
      in_batches += b.params.size();
      for (int p : b.params) EXPECT_EQ(plan.owner[p], r);
    }
  }
  EXPECT_EQ(in_batches, in.items.size());
  EXPECT_NEAR(plan.makespan_s, *std::max_element(load.begin(), load.end()), 1e-12);
}

TEST(Plan, MilpIsOptimalOnSmallInstances) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 12; ++trial) {
    const int n = 5 + trial % 4, ranks = 2 + trial % 3;
    // Few distinct levels on odd trials: exercises the grouping of equal items into classes.
    auto in = make_instance(random_times(n, rng, trial % 2 ? 3 : 1000));
    auto o = milp_options();
    o.memory_slack = 10;  // equal sizes: a tight bound could leave no assignment at all
    const Plan plan = make_plan(in.params, in.items, ranks, o);
    expect_consistent(in, plan);
    const double best = brute_force_makespan(in.items, ranks, plan.memory_cap_bytes);
    EXPECT_NEAR(plan.makespan_s, best, 1e-12) << "trial " << trial;
    EXPECT_TRUE(plan.proven_optimal) << "trial " << trial << ": " << plan.note;
    EXPECT_GE(plan.makespan_s, plan.lower_bound_s * (1 - 1e-12));
  }
}

// The classic case where greedy LPT is 11/9 of optimal: {5,5,4,4,3,3,3} on 3 ranks.
TEST(Plan, MilpBeatsLptWhereLptIsKnownSuboptimal) {
  auto in = make_instance({5, 5, 4, 4, 3, 3, 3});
  PlanOptions lpt;
  lpt.balancer = Balancer::lpt;
  lpt.memory_slack = 10;
  auto o = milp_options();
  o.memory_slack = 10;
  EXPECT_DOUBLE_EQ(make_plan(in.params, in.items, 3, lpt).makespan_s, 11);
  const Plan plan = make_plan(in.params, in.items, 3, o);
  EXPECT_DOUBLE_EQ(plan.makespan_s, 9);
  EXPECT_FALSE(plan.fell_back);
  EXPECT_TRUE(plan.proven_optimal);
}

TEST(Plan, MilpNeverWorseThanLpt) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 6; ++trial) {
    auto in = make_instance(random_times(30 + 7 * trial, rng, 50));
    const int ranks = 3 + trial;
    PlanOptions lpt;
    lpt.balancer = Balancer::lpt;
    const Plan a = make_plan(in.params, in.items, ranks, lpt);
    const Plan b = make_plan(in.params, in.items, ranks, milp_options(0.3));
    expect_consistent(in, b);
    EXPECT_LE(b.makespan_s, a.makespan_s * (1 + 1e-12)) << "trial " << trial;
    EXPECT_TRUE(b.memory_ok);
  }
}

// Time alone pairs the two big matrices (6 + 6); the memory cap 1.1·230/2 = 126 bytes forbids it.
TEST(Plan, MemoryBoundIsHonoured) {
  auto in = make_instance({3, 3, 2, 2, 2}, {100, 100, 10, 10, 10});
  const int ranks = 2;
  auto o = milp_options();
  o.memory_slack = 0.1;
  const Plan plan = make_plan(in.params, in.items, ranks, o);
  expect_consistent(in, plan);
  EXPECT_EQ(plan.memory_cap_bytes, 126);
  EXPECT_TRUE(plan.memory_ok);
  for (const auto& r : plan.per_rank) EXPECT_LE(r.bytes, plan.memory_cap_bytes);
  EXPECT_DOUBLE_EQ(plan.makespan_s, brute_force_makespan(in.items, ranks, plan.memory_cap_bytes));
  EXPECT_DOUBLE_EQ(plan.makespan_s, 7);
  // Without the bound the optimum is 6: the bound really constrained the answer.
  o.memory_slack = 10;
  EXPECT_DOUBLE_EQ(make_plan(in.params, in.items, ranks, o).makespan_s, 6);
}

TEST(Plan, InfeasibleMemoryBoundFallsBackToLptAndSaysSo) {
  // Three 60-byte matrices on 2 ranks with ε = 0: cap = 90, so two cannot share a rank.
  auto in = make_instance({1, 1, 1}, {60, 60, 60});
  auto o = milp_options();
  o.memory_slack = 0;
  const Plan plan = make_plan(in.params, in.items, 2, o);
  expect_consistent(in, plan);
  EXPECT_TRUE(plan.fell_back);
  EXPECT_THAT(plan.note, ::testing::HasSubstr("LPT"));
  EXPECT_FALSE(plan.memory_ok);  // reported, not hidden
}

TEST(Plan, TimeLimitIsHonoured) {
  std::mt19937 rng(3);
  auto in = make_instance(random_times(120, rng, 100000));
  const Plan plan = make_plan(in.params, in.items, 7, milp_options(0.2));
  expect_consistent(in, plan);
  // Loose: a hang or an ignored limit shows; ordinary scheduling noise does not.
  EXPECT_LT(plan.solve_s, 0.2 + 5.0);
}

TEST(Plan, MoreRanksThanMatrices) {
  auto in = make_instance({3, 1, 2});
  for (Balancer b : {Balancer::rr, Balancer::lpt, Balancer::milp}) {
    PlanOptions o = milp_options();
    o.balancer = b;
    const Plan plan = make_plan(in.params, in.items, 10, o);
    expect_consistent(in, plan);
    EXPECT_DOUBLE_EQ(plan.makespan_s, 3) << to_string(b);
    EXPECT_TRUE(plan.proven_optimal) << to_string(b);
    int owners_used = 0;
    for (const auto& r : plan.per_rank) owners_used += r.batches.empty() ? 0 : 1;
    EXPECT_EQ(owners_used, 3) << to_string(b);
  }
}

TEST(Plan, OneMatrixZeroCostsAndNoMatrices) {
  for (Balancer b : {Balancer::rr, Balancer::lpt, Balancer::milp}) {
    PlanOptions o = milp_options();
    o.balancer = b;
    auto one = make_instance({2.5});
    const Plan p1 = make_plan(one.params, one.items, 4, o);
    EXPECT_DOUBLE_EQ(p1.makespan_s, 2.5);
    EXPECT_EQ(p1.gap_pct, 0);
    auto zero = make_instance({0, 0, 0, 0, 0});
    const Plan p0 = make_plan(zero.params, zero.items, 3, o);
    expect_consistent(zero, p0);
    EXPECT_EQ(p0.makespan_s, 0);
    EXPECT_EQ(p0.gap_pct, 0);
    const std::vector<ParamSpec> adamw_only = {{"norm", {8}, ParamRole::elementwise, 0}};
    const Plan pe = make_plan(adamw_only, {}, 2, o);
    EXPECT_EQ(pe.owner, std::vector<int>{-1});
    EXPECT_EQ(pe.makespan_s, 0);
  }
}

TEST(Plan, BadInputsAreErrors) {
  auto in = make_instance({1, 2});
  EXPECT_THROW(make_plan(in.params, in.items, 0, {}), Error);
  auto bad = in;
  bad.items[1].param = 7;
  EXPECT_THAT([&] { make_plan(bad.params, bad.items, 2, {}); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("parameter index 7")));
  EXPECT_THAT([] { parse_balancer("greedy"); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("unknown balancer 'greedy' (valid: rr, lpt, milp)")));
  for (Balancer b : {Balancer::rr, Balancer::lpt, Balancer::milp}) EXPECT_EQ(parse_balancer(to_string(b)), b);
  EXPECT_THAT([&] { plan_from_owners(in.params, in.items, 2, {0, 5}, {}); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("m1")));
  EXPECT_THROW(plan_from_owners(in.params, in.items, 2, {0}, {}), Error);
}

// Round-robin as KellerJordan/Muon: largest first, dealt out in turn.
TEST(Plan, RoundRobinDealsLargestFirst) {
  std::vector<PlanItem> items = {{0, 2, 2, 0, 1, 0}, {1, 8, 8, 0, 1, 0}, {2, 4, 4, 0, 1, 0}, {3, 8, 8, 0, 1, 0}};
  EXPECT_EQ(balance_rr(items, 2), (std::vector<int>{1, 0, 0, 1}));  // order 1, 3, 2, 0
}

TEST(Plan, SpreadPutsOneUnitOnDistinctOwners) {
  // Two units of 4 equal matrices on 4 ranks: at most one matrix of a unit per rank.
  auto in = make_instance({1, 1, 1, 1, 1, 1, 1, 1}, {}, {0, 0, 0, 0, 1, 1, 1, 1});
  auto o = milp_options();
  o.spread_units = true;
  const Plan plan = make_plan(in.params, in.items, 4, o);
  expect_consistent(in, plan);
  for (int unit = 0; unit < 2; ++unit) {
    std::vector<int> per_rank(4, 0);
    for (const auto& it : in.items)
      if (it.unit == unit) ++per_rank[plan.owner[it.param]];
    EXPECT_EQ(*std::max_element(per_rank.begin(), per_rank.end()), 1) << "unit " << unit;
  }
  EXPECT_DOUBLE_EQ(plan.makespan_s, 2);
}

TEST(Plan, PlanFromOwnersReproducesThePlan) {
  std::mt19937 rng(5);
  auto in = make_instance(random_times(40, rng, 20));
  const Plan a = make_plan(in.params, in.items, 5, milp_options(0.3));
  const Plan b = plan_from_owners(in.params, in.items, 5, a.owner, milp_options());
  EXPECT_EQ(a.owner, b.owner);
  EXPECT_EQ(a.makespan_s, b.makespan_s);
  for (int r = 0; r < 5; ++r) EXPECT_EQ(a.per_rank[r].bytes, b.per_rank[r].bytes);
}

// Worked by hand on 2 ranks. LPT on times 5, 1, 4, 3, 2: 5→0; 4→1; 3→1 (4 < 5); 2→0 (5 < 7); 1→0 (7 = 7,
// the lower rank). RR deals the largest first (sizes 4, 64, 16, 64, 1; equal sizes by parameter index):
// params 1, 3, 2, 0, 4 get ranks 0, 1, 0, 1, 0.
TEST(Plan, LptAndRrGiveTheirHandWorkedAssignments) {
  const auto in = make_instance({5, 1, 4, 3, 2});
  EXPECT_EQ(balance_lpt(in.items, 2, memory_cap_bytes(in.items, 2, 0.25)), (std::vector<int>{0, 0, 1, 1, 0}));
  std::vector<PlanItem> sized;
  const int64_t sides[] = {2, 8, 4, 8, 1};
  for (int i = 0; i < 5; ++i) sized.push_back({i, sides[i], sides[i], 0, 1.0, 64});
  EXPECT_EQ(balance_rr(sized, 2), (std::vector<int>{1, 0, 0, 1, 0}));
}

// default_owners: LPT on flop costs (d 6x6 > a 4x8 = b 8x4 > c 2x2 > e 1x1), longest
// first onto the least-loaded rank with memory room, ties to the lowest rank, elementwise −1. Memory:
// 12 bytes per element; at 2 ranks the cap is 1.25·1260/2 = 787 bytes.
TEST(Plan, DefaultOwnersAreLptOnFlopCosts) {
  auto m = [](std::string name, int64_t r, int64_t c, int unit) {
    return ParamSpec{std::move(name), {r, c}, ParamRole::matrix, unit};
  };
  const std::vector<ParamSpec> specs = {m("a", 4, 8, 0), m("b", 8, 4, 0), {"n", {3}, ParamRole::elementwise, 0},
                                        m("c", 2, 2, 1), m("d", 6, 6, 1), m("e", 1, 1, 1)};
  ASSERT_GT(ns_flops_estimate(6, 6), ns_flops_estimate(4, 8));
  ASSERT_EQ(ns_flops_estimate(4, 8), ns_flops_estimate(8, 4));
  ASSERT_GT(ns_flops_estimate(4, 8), ns_flops_estimate(2, 2));
  ASSERT_GT(ns_flops_estimate(2, 2), ns_flops_estimate(1, 1));
  // d→0 (4320 flops); a→1 (1664); b→1 (3328 < 4320); c→0: rank 1 would hold 768 + 48 bytes > cap;
  // e→1 (3328 < 4480, 780 bytes).
  EXPECT_EQ(default_owners(specs, 2), (std::vector<int>{1, 1, -1, 0, 0, 1}));
  // More ranks than matrices: each matrix alone, ranks 5.. own nothing.
  EXPECT_EQ(default_owners(specs, 8), (std::vector<int>{1, 2, -1, 3, 0, 4}));
  EXPECT_EQ(default_owners(specs, 1), (std::vector<int>{0, 0, -1, 0, 0, 0}));
}

// DESIGN 2.3's table, in units of m³ for 5 steps: min(standard sym, Gram restart [2] sym). The estimate counts
// what the engine executes (SYRK's diagonal, 8 tiles of the upper triangle rather than exactly half), so it
// lies a few percent above the idealised table; tests/ns/ns_record_test.cpp checks the exact closed forms.
TEST(CostModel, FlopsMatchDesignTable) {
  const int64_t m = 512;
  const double m3 = double(m) * m * m;
  const struct {
    int64_t rows, cols;
    double table;
  } rows[] = {{m, m, 20}, {m, 2 * m, 26}, {4 * m, m, 38}, {m, 8 * m, 62}};
  for (const auto& r : rows) {
    EXPECT_GE(ns_flops_estimate(r.rows, r.cols) / m3, r.table) << r.rows << "x" << r.cols;
    EXPECT_LE(ns_flops_estimate(r.rows, r.cols) / m3, 1.12 * r.table) << r.rows << "x" << r.cols;
  }
  EXPECT_EQ(ns_flops_estimate(4 * m, m), ns_flops_estimate(m, 4 * m));  // transposed: same cost
}

TEST(CostModel, ItemsTakeTheirShareOfTheExpectedBatch) {
  std::vector<ParamSpec> params = {{"a", {8, 16}, ParamRole::matrix, 1},
                                   {"b", {8, 16}, ParamRole::matrix, 2},
                                   {"c", {8, 16}, ParamRole::matrix, 3},
                                   {"n", {8}, ParamRole::elementwise, 1},
                                   {"d", {4, 4}, ParamRole::matrix, 1}};
  // A made-up sublinear batch cost: 1 + batch (s).
  auto items = make_plan_items(params, 2, [](int64_t, int64_t, int batch) { return 1.0 + batch; });
  ASSERT_EQ(items.size(), 4u);
  EXPECT_EQ(items[0].param, 0);
  EXPECT_EQ(items[3].param, 4);
  EXPECT_DOUBLE_EQ(items[0].time_s, 3.0 / 2);  // 3 of this shape on 2 ranks: batch 2
  EXPECT_DOUBLE_EQ(items[3].time_s, 2.0);      // alone: batch 1
  EXPECT_EQ(items[0].bytes, 3 * 8 * 16 * 4);
  EXPECT_EQ(items[2].unit, 3);
}

// The planner's flop costs run at a hardware profile's NS rate (ns_flops · ns_efficiency), read by the one
// loader the simulator uses (hardware_profile.hpp), not from a second table or parser.
TEST(Plan, FlopCostsRunAtTheHardwareProfilesNsRate) {
  for (const char* name : {"a800", "h200"}) {
    const HardwareProfile hw = load_hardware_profile(name);
    const double rate = hw.ns_flops * hw.ns_efficiency;
    EXPECT_DOUBLE_EQ(flop_batch_time(hw)(64, 128, 3), 3 * ns_flops_estimate(64, 128) / rate) << name;
  }
  EXPECT_THAT([] { load_hardware_profile("tpu"); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("no hardware profile 'tpu'")));
}

}  // namespace
}  // namespace dmuon
