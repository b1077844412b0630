// The training loop in one process: the learning-rate schedule, that a tiny model learns, that a
// resumed run reproduces the uninterrupted one bit for bit, and that the per-run summary is right.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "dmuon/comm.hpp"
#include "dmuon/trainer.hpp"
#include "tiny_training.hpp"
#include "test_data.hpp"

namespace dmuon {
namespace {

TrainOptions tiny(OptimKind optim, int64_t steps) { return test::tiny_training(optim, steps, 1, 8); }

TEST(LrSchedule, WarmsUpLinearlyThenFollowsTheCosineDownToTheFloor) {
  const int64_t total = 100, warmup = 10;
  for (int64_t s = 0; s < warmup; ++s) EXPECT_DOUBLE_EQ(lr_factor(s, total, warmup, 0.1), (s + 1) / 10.0);
  EXPECT_DOUBLE_EQ(lr_factor(warmup, total, warmup, 0.1), 1.0);
  EXPECT_NEAR(lr_factor(total - 1, total, warmup, 0.1), 0.1, 1e-12);
  // Halfway through the decay the cosine is at the midpoint between peak and floor.
  const int64_t decay = total - warmup, mid = warmup + (decay - 1) / 2;
  const double p = double(mid - warmup) / double(decay - 1);
  EXPECT_NEAR(lr_factor(mid, total, warmup, 0.1), 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * p)), 1e-12);
  for (int64_t s = warmup; s + 1 < total; ++s)
    EXPECT_GE(lr_factor(s, total, warmup, 0.1), lr_factor(s + 1, total, warmup, 0.1)) << "step " << s;
  EXPECT_DOUBLE_EQ(lr_factor(0, 1, 0, 0.1), 1.0);  // a single step with no warmup trains at the peak
}

TEST(Train, BadOptionsAreErrorsNamingTheOption) {
  TrainOptions o = tiny(OptimKind::muon, 2);
  o.batch = 7;
  o.micro_batches = 2;
  EXPECT_THROW(Trainer(o, nullptr), Error);
  EXPECT_THROW(parse_optim_kind("sgd"), Error);
  EXPECT_THROW(parse_shard_mode("z1"), Error);
  o = tiny(OptimKind::dmuon, 2);
  EXPECT_THROW(Trainer(o, nullptr), Error);  // dmuon needs a communicator
}

// From the GPT-2 initialisation the byte-level loss starts at about ln 256 = 5.55; within 40 steps
// both optimizers bring the training and validation losses down by more than a nat (measured: the
// last 5 training losses average about 3.8, validation 3.9).
TEST(Train, LossFallsOnATinyModelWithinAFewSteps) {
  for (OptimKind k : {OptimKind::muon, OptimKind::adamw}) {
    Trainer t(tiny(k, 40), nullptr);
    const double val_before = t.validation_loss();
    std::vector<double> loss;
    while (!t.done()) loss.push_back(t.train_step().train_loss);
    double last5 = 0;
    for (size_t i = loss.size() - 5; i < loss.size(); ++i) last5 += loss[i] / 5;
    EXPECT_NEAR(loss.front(), std::log(256.0), 0.1) << to_string(k);
    EXPECT_LT(last5, loss.front() - 1.0) << to_string(k);
    EXPECT_LT(t.validation_loss(), val_before - 1.0) << to_string(k);
  }
}

// Stopping after 3 steps, saving, and resuming in a fresh Trainer gives the same losses and
// parameters, bit for bit, as running 6 steps without interruption (the batches depend on the step
// only, the schedule on the step only, and the checkpoint restores parameters and optimizer state).
TEST(Train, ResumeReproducesTheUninterruptedRunBitForBit) {
  test::TempDir dir;
  for (OptimKind k : {OptimKind::muon, OptimKind::adamw}) {
    TrainOptions o = tiny(k, 6);
    o.micro_batches = 2;
    Trainer whole(o, nullptr);
    std::vector<double> expected;
    while (!whole.done()) expected.push_back(whole.train_step().train_loss);

    const std::string ckpt = dir.file(std::string(to_string(k)));
    {
      TrainOptions first = o;
      Trainer t(first, nullptr);
      for (int s = 0; s < 3; ++s) EXPECT_EQ(t.train_step().train_loss, expected[s]);
      t.save(ckpt);
    }
    TrainOptions rest = o;
    rest.resume = ckpt;
    Trainer t(rest, nullptr);
    EXPECT_EQ(t.steps_done(), 3);
    for (int s = 3; s < 6; ++s) EXPECT_EQ(t.train_step().train_loss, expected[s]) << to_string(k) << " step " << s + 1;
    EXPECT_EQ(t.full_params(), whole.full_params()) << to_string(k);
  }
}

TEST(Train, StepMetricsAreFilledAndValidationRunsOnSchedule) {
  TrainOptions o = tiny(OptimKind::muon, 5);
  o.val_every = 2;
  Trainer t(o, nullptr);
  std::vector<StepMetrics> rows;
  while (!t.done()) rows.push_back(t.train_step());
  ASSERT_EQ(rows.size(), 5u);
  for (const StepMetrics& r : rows) {
    EXPECT_EQ(r.val_loss.has_value(), r.step == 2 || r.step == 4 || r.step == 5) << "step " << r.step;
    EXPECT_GT(r.step_s, 0);
    EXPECT_GT(r.fwd_bwd_s, 0);
    EXPECT_GT(r.optim_s, 0);
    EXPECT_LE(r.fwd_bwd_s + r.optim_s, r.step_s);
    EXPECT_EQ(r.comm_wait_s, 0);  // no communicator
  }
  EXPECT_EQ(*rows.back().val_loss, t.validation_loss());  // evaluation does not change the model
}

}  // namespace
}  // namespace dmuon
