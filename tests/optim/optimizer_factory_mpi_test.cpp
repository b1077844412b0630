// make_optimizer_stack (include/dmuon/optimizer_factory.hpp) at every world size: each kind builds, and
// its steps equal the single-process definition (dmuon::Muon, or dmuon::AdamW for adamw) on whole
// tensors. A world of one takes the same path as many ranks.
#include "dmuon/optimizer_factory.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "dmuon/error.hpp"
#include "dmuon/plan_across_ranks.hpp"
#include "hook_pass.hpp"
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

OptimizerOptions options(OptimKind kind) {
  OptimizerOptions o;
  o.muon.weight_decay = 0.01;
  o.adamw.weight_decay = 0.1;
  if (kind == OptimKind::adamw) o.rules = {{"*", OptimGroup::adamw}};
  return o;
}

constexpr int kSteps = 3;

// The single-process definition: whole tensors, one process.
test::ToyModel reference(OptimKind kind) {
  test::ToyModel m(specs(), 5);
  std::unique_ptr<Optimizer> opt;
  if (kind == OptimKind::adamw)
    opt = std::make_unique<AdamW>(m.refs(), options(kind));
  else
    opt = std::make_unique<Muon>(m.refs(), options(kind));
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

OptimizerStackOptions stack_options(OptimKind kind) {
  OptimizerStackOptions o;
  o.kind = kind;
  o.grad_reduce = ReduceOp::sum;
  o.optimizer = options(kind);
  if (kind == OptimKind::dmuon) {  // owners from the planner, as callers get them
    PlanOptions plan;
    plan.balancer = Balancer::lpt;
    const auto items = make_plan_items(specs(), world()->size(), relative_flop_batch_time());
    o.owners = plan_across_ranks(*world(), specs(), items, plan).owner;
  }
  return o;
}

// ‖x − ref‖ / ‖ref‖ ≤ 1e-5 per tensor: float32 rounding of a few steps through NS (the bound of
// tests/optim/distributed_optim_mpi_test.cpp, whose argument holds here).
void expect_equal_to_reference(OptimKind kind, shard::Mode mode) {
  const std::string what = std::string(to_string(kind)) + " mode " + std::to_string(int(mode)) + " at " +
                           std::to_string(world()->size()) + " ranks, rank " + std::to_string(world()->rank());
  const test::ToyModel ref = reference(kind);
  OptimizerStackOptions o = stack_options(kind);
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

TEST(OptimizerFactory, EachKindEqualsItsSingleProcessDefinition) {
  for (OptimKind kind : {OptimKind::adamw, OptimKind::muon_gather, OptimKind::dmuon})
    for (shard::Mode mode : {shard::Mode::z3, shard::Mode::z2, shard::Mode::replicated})
      expect_equal_to_reference(kind, mode);
}

TEST(OptimizerFactory, MuonIsOneRankAlone) {
  if (world()->size() == 1) {
    expect_equal_to_reference(OptimKind::muon, shard::Mode::z3);
    return;
  }
  try {
    make_optimizer_stack(world(), specs(), stack_options(OptimKind::muon));
    ADD_FAILURE() << "muon built on " << world()->size() << " ranks";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("OptimizerStackOptions.kind muon is single-process"), std::string::npos) << e.what();
  }
  // Every rank can still take a world of one of its own.
  OptimizerStack alone = make_optimizer_stack(comm::self(), specs(), stack_options(OptimKind::muon));
  EXPECT_EQ(alone.params->options().layout, shard::Layout::owner_aligned);
}

TEST(OptimizerFactory, OwnersOnlyForDMuon) {
  OptimizerStackOptions o = stack_options(OptimKind::dmuon);
  o.owners.pop_back();
  EXPECT_THROW(make_optimizer_stack(world(), specs(), o), Error);
  const std::vector<int> owners = stack_options(OptimKind::dmuon).owners;
  for (OptimKind kind : {OptimKind::adamw, OptimKind::muon_gather}) {
    o = stack_options(kind);
    o.owners = owners;
    EXPECT_THROW(make_optimizer_stack(world(), specs(), o), Error) << to_string(kind);
  }
}

}  // namespace
}  // namespace dmuon
