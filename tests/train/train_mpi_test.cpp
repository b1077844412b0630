// The training loop over ranks equals the single-process definition: every rank runs the reference
// (Muon or AdamW in a Trainer without a communicator: a world of one, which train_test checks against
// the single-process loop over whole tensors) beside the distributed run on all ranks, and the two
// must agree at every world size.
//
// Tolerances. Ranks compute their slice of the batch and the runtime averages the slices'
// gradients, where one process averages over the whole batch: the same sums in another order, so
// gradients differ by float32 rounding (relative ~1e-7). Five steps of Newton–Schulz and AdamW carry
// that to the parameters: required is a relative Frobenius distance per tensor ≤ 1e-5 and a loss
// difference ≤ 1e-5 relative.
// One exception: the key third of attn.qkv.bias. Adding a constant to every key of a query's row
// leaves the softmax unchanged, so its exact gradient is zero and both runs see only rounding noise,
// which AdamW (m/√v) turns into steps of up to about lr·(1−β1)/√(1−β2) ≈ 3.2·lr. For it the test
// checks that bound instead (5 steps: |b_k| ≤ 16·lr in both runs).
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "dmuon/checkpoint_rotation.hpp"
#include "dmuon/comm.hpp"
#include "dmuon/gpt.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/tune.hpp"
#include "dmuon/trainer.hpp"
#include "optimizer_kinds.hpp"
#include "tiny_training.hpp"

namespace dmuon {
namespace {

// Batch 24: divisible by every world size 1..4 times 2 micro-batches.
TrainOptions tiny(OptimKind optim, int64_t steps) { return test::tiny_training(optim, steps, 2, 24); }

double relative_distance(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

struct Case {
  OptimKind distributed, reference;
  shard::Mode mode;
  int micro_batches;
};

// The distributed run over all ranks and the single-process reference agree over 5 steps: losses,
// validation loss and every parameter tensor. `adjust` edits the distributed run's options.
void expect_equal_to_reference(const Case& c, const std::function<void(TrainOptions&)>& adjust = {}) {
  const std::string what = std::string(to_string(c.distributed)) + " mode " + std::to_string(int(c.mode)) +
                           " M=" + std::to_string(c.micro_batches);
  TrainOptions o = tiny(c.distributed, 5);
  o.shard_mode = c.mode;
  o.micro_batches = c.micro_batches;
  if (adjust) adjust(o);
  Trainer dist(o, comm::world());
  TrainOptions r = tiny(c.reference, 5);
  Trainer ref(r, nullptr);
  // Validation averages the same global batches at every world size.
  EXPECT_NEAR(dist.validation_loss(), ref.validation_loss(), 1e-6 * ref.validation_loss()) << what;
  for (int s = 0; s < 5; ++s) {
    const double a = dist.train_step().train_loss, b = ref.train_step().train_loss;
    EXPECT_NEAR(a, b, 1e-5 * b) << what << " step " << s + 1;
  }
  auto pa = dist.full_params(), pb = ref.full_params();
  const auto specs = gpt_param_specs(o.model);
  const int64_t C = o.model.width;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].name.ends_with("attn.qkv.bias")) {
      for (auto* p : {&pa[i], &pb[i]}) {
        for (int64_t k = C; k < 2 * C; ++k) EXPECT_LE(std::abs((*p)[k]), 16 * o.adamw_lr) << what << " key bias";
        p->erase(p->begin() + C, p->begin() + 2 * C);  // compare the query and value parts below
      }
    }
    EXPECT_LE(relative_distance(pa[i], pb[i]), 1e-5) << what << " " << specs[i].name;
  }
  EXPECT_NEAR(dist.validation_loss(), ref.validation_loss(), 1e-5 * ref.validation_loss()) << what;
}

// A folder every rank sees: rank 0 names it, everyone receives the name.
std::string shared_temp_dir(const std::string& tag) {
  char buf[256] = {};
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) {
    const auto p = std::filesystem::temp_directory_path() / ("dmuon-train-" + tag + "-" + std::to_string(getpid()));
    std::snprintf(buf, sizeof buf, "%s", p.c_str());
  }
  MPI_Bcast(buf, sizeof buf, MPI_CHAR, 0, MPI_COMM_WORLD);
  return buf;
}

// Every kind of the table (support/optimizer_kinds.hpp) that runs at this world size, in z3, equals its
// single-process definition.
class TrainMpiKinds : public ::testing::TestWithParam<test::KindRow> {};

TEST_P(TrainMpiKinds, EqualsItsSingleProcessDefinition) {
  const test::KindRow& k = GetParam();
  if (!k.runs_at(comm::world()->size())) GTEST_SKIP() << to_string(k.kind) << " runs on at most " << k.max_ranks << " ranks";
  expect_equal_to_reference({k.kind, k.reference, shard::Mode::z3, 1});
}

INSTANTIATE_TEST_SUITE_P(TrainMpi, TrainMpiKinds, ::testing::ValuesIn(test::optimizer_kinds()), test::kind_name);

TEST(TrainMpi, DMuonWithMicroBatchesInEveryShardModeEqualsSingleProcessMuon) {
  for (shard::Mode m : {shard::Mode::z3, shard::Mode::z2, shard::Mode::replicated})
    expect_equal_to_reference({OptimKind::dmuon, OptimKind::muon, m, 2});
}

// A hand-written tuning cache that picks non-default kernels (standard recurrence with plain sgemm,
// Gram with restarts [1,3], Gram without symmetric products) and unequal batch times: the trainer
// must run with exactly these entries (nothing retuned), plan DMuon's owners from their times, and
// still equal single-process Muon with the default kernel (the kernels differ only by rounding).
TEST(TrainMpi, TunedDMuonFromACacheEqualsSingleProcessMuon) {
  const std::string dir = shared_temp_dir("tuned");
  const std::string cache_path = dir + "/tune.json";
  TrainOptions o = tiny(OptimKind::dmuon, 5);
  const auto specs = gpt_param_specs(o.model);
  int ranks = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  TuneCache cache(current_tune_key(linalg::threads()));
  const auto requests = tune_requests(specs, ranks);
  for (size_t k = 0; k < requests.size(); ++k) {
    TuneEntry e;
    e.rows = requests[k].rows, e.cols = requests[k].cols, e.batch = requests[k].batch;
    e.options.threads = linalg::threads();
    if (k % 3 == 0) e.options.algo = NsAlgo::standard, e.options.symmetric = false;
    if (k % 3 == 1) e.options.algo = NsAlgo::gram, e.options.restarts = {1, 3}, e.options.tiles = 1;
    if (k % 3 == 2) e.options.algo = NsAlgo::gram, e.options.symmetric = false;
    e.seconds = 1e-3 * (1 + 3 * k);  // far from any flop estimate, and unequal per shape
    e.default_seconds = 2 * e.seconds;
    cache.put(e);
  }
  ASSERT_GE(requests.size(), 3u);  // every kind of kernel above is used
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) cache.save(cache_path);
  MPI_Barrier(MPI_COMM_WORLD);

  o.tune = true;
  o.tune_cache = cache_path;
  o.balancer = Balancer::lpt;  // deterministic, so the expected plan can be rebuilt here
  {
    Trainer t(o, comm::world());
    ASSERT_EQ(t.tuned().size(), cache.entries().size());
    for (size_t k = 0; k < t.tuned().size(); ++k) {
      EXPECT_EQ(t.tuned()[k].options, cache.entries()[k].options) << k;
      EXPECT_EQ(t.tuned()[k].seconds, cache.entries()[k].seconds) << k;
    }
    PlanOptions po;
    po.balancer = Balancer::lpt;
    const Plan expected =
        make_plan(specs, make_plan_items(specs, ranks, tuned_batch_time(cache.entries())), ranks, po);
    EXPECT_EQ(t.plan().owner, expected.owner);
    EXPECT_DOUBLE_EQ(t.plan().makespan_s, expected.makespan_s);
  }
  expect_equal_to_reference({OptimKind::dmuon, OptimKind::muon, shard::Mode::z3, 1}, [&](TrainOptions& d) {
    d.tune = true;
    d.tune_cache = cache_path;
  });
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) std::filesystem::remove_all(dir);
}

// DMuon runs with the planner's owners: the sharded parameters are laid out by them and each rank
// orthogonalizes exactly its planned share in every step. Exactness alone cannot see this (the weights
// do not depend on which rank computes them), so owners overridden after planning would pass every test
// above. Deterministic balancers, so the expected plan is rebuilt here; with 8 matrices (2 layers × 4)
// every rank of up to 4 has a share.
TEST(TrainMpi, DMuonRunsWithThePlannedOwnersAndEachRankItsShare) {
  int ranks = 0, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  for (const Balancer balancer : {Balancer::rr, Balancer::lpt}) {
    const std::string what = "balancer " + std::string(to_string(balancer));
    TrainOptions o = tiny(OptimKind::dmuon, 2);
    o.balancer = balancer;
    const auto specs = gpt_param_specs(o.model);
    PlanOptions po;
    po.balancer = balancer;
    const Plan expected = make_plan(specs, make_plan_items(specs, ranks, relative_flop_batch_time()), ranks, po);
    const int64_t share = std::count(expected.owner.begin(), expected.owner.end(), rank);
    ASSERT_EQ(std::count_if(expected.owner.begin(), expected.owner.end(), [](int r) { return r >= 0; }), 8) << what;
    EXPECT_GE(share, 1) << what << ": rank " << rank << " owns no matrix, so its share tests nothing";
    Trainer t(o, comm::world());
    EXPECT_EQ(t.plan().owner, expected.owner) << what;
    EXPECT_EQ(t.owners(), expected.owner) << what;
    for (int s = 0; s < 2; ++s) {
      t.train_step();
      EXPECT_EQ(t.last_optimizer_stats().ns_matrices, share) << what << " step " << s + 1 << " on rank " << rank;
    }
  }
}

TEST(TrainMpi, ResumeReproducesTheUninterruptedRunBitForBit) {
  const std::string dir = shared_temp_dir("resume");
  TrainOptions o = tiny(OptimKind::dmuon, 6);
  std::vector<double> expected;
  {
    Trainer whole(o, comm::world());
    while (!whole.done()) expected.push_back(whole.train_step().train_loss);
  }
  {
    Trainer first(o, comm::world());
    for (int s = 0; s < 3; ++s) EXPECT_EQ(first.train_step().train_loss, expected[s]);
    first.save(dir);
  }
  TrainOptions rest = o;
  rest.resume = dir;
  Trainer t(rest, comm::world());
  EXPECT_EQ(t.steps_done(), 3);
  for (int s = 3; s < 6; ++s) EXPECT_EQ(t.train_step().train_loss, expected[s]) << "step " << s + 1;
  MPI_Barrier(MPI_COMM_WORLD);
  if (t.rank() == 0) std::filesystem::remove_all(dir);
}

// Determinism at every world size: the same run twice gives bit-identical losses and parameters
// (the reductions' order is fixed by the world size, not by timing).
TEST(TrainMpi, TheSameSeedTwiceGivesBitIdenticalLossesAndParameters) {
  for (OptimKind k : {OptimKind::dmuon, OptimKind::adamw}) {
    std::vector<double> losses[2];
    std::vector<std::vector<float>> params[2];
    for (int run = 0; run < 2; ++run) {
      TrainOptions o = tiny(k, 3);
      o.micro_batches = 2;
      Trainer t(o, comm::world());
      while (!t.done()) losses[run].push_back(t.train_step().train_loss);
      params[run] = t.full_params();
    }
    EXPECT_EQ(losses[0], losses[1]) << to_string(k);
    EXPECT_EQ(params[0], params[1]) << to_string(k);
  }
}

// A stop signal seen by the last rank alone stops every rank after the same step, with a complete
// checkpoint (written in the background of step 3, finished at the stop) that resumes bit for bit.
TEST(TrainMpi, AStopSignalOnOneRankStopsEveryRankAfterTheSameStepWithACheckpoint) {
  const std::string dir = shared_temp_dir("stop");
  const TrainOptions o = tiny(OptimKind::dmuon, 6);
  std::vector<double> expected;
  std::vector<std::vector<float>> params;
  {
    Trainer whole(o, comm::world());
    while (!whole.done()) expected.push_back(whole.train_step().train_loss);
    params = whole.full_params();
  }
  const bool last_rank = comm::world()->rank() == comm::world()->size() - 1;
  TrainOptions stopped = o;
  stopped.save_dir = dir;
  stopped.save_every = 2;
  int polls = 0;
  stopped.stop_signal = [&] { return last_rank && ++polls == 4; };
  {
    Trainer t(stopped, comm::world());
    while (!t.done() && !t.stop_requested()) t.train_step();
    EXPECT_EQ(t.steps_done(), 4);
    EXPECT_EQ(t.last_checkpoint(), checkpoint_for_step(dir, 4));
  }
  TrainOptions rest = o;
  rest.resume = dir;
  Trainer t(rest, comm::world());
  ASSERT_EQ(t.steps_done(), 4);
  for (int s = 4; s < 6; ++s) EXPECT_EQ(t.train_step().train_loss, expected[s]) << "step " << s + 1;
  EXPECT_EQ(t.full_params(), params);
  MPI_Barrier(MPI_COMM_WORLD);
  if (t.rank() == 0) std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dmuon
