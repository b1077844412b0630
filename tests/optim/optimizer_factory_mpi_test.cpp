// make_optimizer_stack (include/dmuon/optimizer_factory.hpp) at every world size: each kind of the kinds table
// (support/optimizer_kinds.hpp) builds in each of its shard modes, and its steps equal its single-process
// definition (dmuon::Muon, or dmuon::AdamW for adamw) on whole tensors; a single-process kind is refused on
// several ranks. A world of one takes the same path as many ranks.
#include "dmuon/optimizer_factory.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "dmuon/error.hpp"
#include "dmuon/plan_across_ranks.hpp"
#include "hook_pass.hpp"
#include "optimizer_kinds.hpp"
#include "test_world.hpp"
#include "toy_model.hpp"

namespace dmuon {
namespace {

using test::world;

// Two units: embeddings; a layer with matrices of three shapes (two alike) and elementwise parameters.
std::vector<ParamSpec> specs() {
  return {{"embed", {9, 4}, ParamRole::elementwise, 0}, {"l.wide", {4, 10}, ParamRole::matrix, 1},
          {"l.tall", {10, 4}, ParamRole::matrix, 1},    {"l.q", {6, 6}, ParamRole::matrix, 1},
          {"l.k", {6, 6}, ParamRole::matrix, 1},        {"l.norm", {5}, ParamRole::elementwise, 1}};
}

OptimizerOptions options(const test::KindRow& k) {
  OptimizerOptions o;
  o.muon.weight_decay = 0.01;
  o.adamw.weight_decay = 0.1;
  if (k.reference == OptimKind::adamw) o.rules = {{"*", OptimGroup::adamw}};
  return o;
}

constexpr int kSteps = 3;

// The single-process definition: whole tensors, one process.
test::ToyModel reference(const test::KindRow& k) {
  test::ToyModel m(specs(), 5);
  std::unique_ptr<Optimizer> opt;
  if (k.reference == OptimKind::adamw)
    opt = std::make_unique<AdamW>(m.refs(), options(k));
  else
    opt = std::make_unique<Muon>(m.refs(), options(k));
  for (int t = 0; t < kSteps; ++t) {
    m.set_grads(t);
    opt->step();
  }
  return m;
}

// Gradients of step t through the hooks: rank 0 writes them, the others zeros, and the reduce sums,
// so every kind sees exactly the reference's gradient.
void backward(shard::ShardedParams& sp, int t, int rank) {
  test::hook_pass(sp, [&](int p, DeviceSpan<float> view) {
    const std::span<float> g = view.host();
    for (size_t i = 0; i < g.size(); ++i) g[i] = rank == 0 ? test::ToyModel::sample_grad(p, i, t) : 0.0f;
  });
}

// The planner's owners, as callers get them.
std::vector<int> planned_owners() {
  PlanOptions plan;
  plan.balancer = Balancer::lpt;
  const auto items = make_plan_items(specs(), world()->size(), relative_flop_batch_time());
  return plan_across_ranks(*world(), specs(), items, plan).owner;
}

OptimizerStackOptions stack_options(const test::KindRow& k) {
  OptimizerStackOptions o;
  o.kind = k.kind;
  o.grad_reduce = ReduceOp::sum;
  o.optimizer = options(k);
  if (optim_kind_info(k.kind).takes_owners) o.owners = planned_owners();
  return o;
}

// ‖x − ref‖ / ‖ref‖ ≤ 1e-5 per tensor: float32 rounding of a few steps through NS (the bound of
// tests/optim/distributed_optim_mpi_test.cpp, whose argument holds here).
void expect_equal_to_reference(const test::KindRow& k, shard::Mode mode) {
  const std::string what = std::string(to_string(k.kind)) + " mode " + std::to_string(int(mode)) + " at " +
                           std::to_string(world()->size()) + " ranks, rank " + std::to_string(world()->rank());
  const test::ToyModel ref = reference(k);
  OptimizerStackOptions o = stack_options(k);
  o.mode = mode;
  OptimizerStack stack = make_optimizer_stack(world(), specs(), o);
  test::ToyModel init(specs(), 5);
  for (size_t p = 0; p < init.values.size(); ++p) stack.params->load_full(static_cast<int>(p), init.values[p]);
  for (int t = 0; t < kSteps; ++t) {
    backward(*stack.params, t, world()->rank());
    ASSERT_TRUE(stack.optimizer->step()) << what;
  }
  for (int u = 0; u < stack.params->num_units(); ++u) {
    stack.params->gather(u);
    stack.params->wait(u);
    for (int p : stack.params->layout(u).params) {
      const auto x = stack.params->param(p).host();
      double d = 0, n = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        d += std::pow(double(x[i]) - ref.values[p][i], 2);
        n += std::pow(double(ref.values[p][i]), 2);
      }
      EXPECT_LE(std::sqrt(d / n), 1e-5) << what << ": parameter " << ref.specs[p].name;
    }
    stack.params->release(u);
  }
}

// The tests' table and the library's agree: every kind, in OptimKind's order, single-process where the table
// runs it on one rank only.
TEST(OptimizerFactory, TheKindsTableHasEveryKind) {
  const auto kinds = optim_kinds();
  const auto& rows = test::optimizer_kinds();
  ASSERT_EQ(rows.size(), kinds.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i].kind, kinds[i].kind) << i;
    EXPECT_EQ(rows[i].max_ranks == 1, kinds[i].single_process) << kinds[i].name;
    EXPECT_FALSE(rows[i].modes.empty()) << kinds[i].name;
  }
}

class EachKind : public ::testing::TestWithParam<test::KindRow> {};

TEST_P(EachKind, NameRoundTrips) {
  const OptimKind kind = GetParam().kind;
  EXPECT_EQ(parse_optim_kind(to_string(kind)), kind);
  EXPECT_EQ(to_string(kind), optim_kind_info(kind).name);
  EXPECT_EQ(optim_kind_info(kind).kind, kind);
}

TEST_P(EachKind, EqualsItsSingleProcessDefinitionInEachShardMode) {
  const test::KindRow& k = GetParam();
  if (k.runs_at(world()->size())) {
    for (shard::Mode mode : k.modes) expect_equal_to_reference(k, mode);
    return;
  }
  try {
    make_optimizer_stack(world(), specs(), stack_options(k));
    ADD_FAILURE() << to_string(k.kind) << " built on " << world()->size() << " ranks";
  } catch (const Error& e) {
    const std::string want = "OptimizerStackOptions.kind " + std::string(to_string(k.kind)) + " is single-process";
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
  // Every rank can still take a world of one of its own.
  OptimizerStack alone = make_optimizer_stack(comm::self(), specs(), stack_options(k));
  EXPECT_EQ(alone.params->options().layout,
            optim_kind_info(k.kind).owner_aligned ? shard::Layout::owner_aligned : shard::Layout::even);
}

// A kind that places owners needs one per parameter; the others refuse owners.
TEST_P(EachKind, OwnersOnlyWhereTheKindPlacesThem) {
  const test::KindRow& k = GetParam();
  if (!k.runs_at(world()->size())) GTEST_SKIP() << "refused at " << world()->size() << " ranks (above)";
  OptimizerStackOptions o = stack_options(k);
  if (optim_kind_info(k.kind).takes_owners) {
    o.owners.pop_back();
  } else {
    o.owners = planned_owners();
  }
  EXPECT_THROW(make_optimizer_stack(world(), specs(), o), Error) << to_string(k.kind);
}

INSTANTIATE_TEST_SUITE_P(OptimizerFactory, EachKind, ::testing::ValuesIn(test::optimizer_kinds()), test::kind_name);

}  // namespace
}  // namespace dmuon
