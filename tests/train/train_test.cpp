// The training loop in one process: the learning-rate schedule, bad options and too-short data splits
// as errors naming them, that a tiny model learns, that a world of one equals the single-process loop
// written out, that the same seed gives the same run bit for bit, that a run resumed from an explicit,
// periodic or signal-triggered checkpoint reproduces the uninterrupted one bit for bit, and that the
// per-run summary is right.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "dmuon/atomic_file.hpp"
#include "dmuon/checkpoint.hpp"
#include "dmuon/checksum.hpp"
#include "dmuon/checkpoint_rotation.hpp"
#include "dmuon/comm.hpp"
#include "dmuon/data.hpp"
#include "dmuon/optim.hpp"
#include "dmuon/trainer.hpp"
#include "optimizer_kinds.hpp"
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
  std::string valid;  // "adamw, muon, muon-gather, dmuon": every kind of the table (support/optimizer_kinds.hpp)
  for (const test::KindRow& k : test::optimizer_kinds()) valid += (valid.empty() ? "" : ", ") + std::string(to_string(k.kind));
  EXPECT_THAT([] { parse_optim_kind("sgd"); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("unknown optimizer 'sgd' (valid: " + valid + ")")));
  EXPECT_THROW(shard::parse_mode("z1"), Error);
  for (shard::Mode m : {shard::Mode::z3, shard::Mode::z2, shard::Mode::replicated})
    EXPECT_EQ(shard::parse_mode(shard::to_string(m)), m);
  o = tiny(OptimKind::dmuon, 2);
  EXPECT_NO_THROW(Trainer(o, nullptr));  // a world of one runs every kind, dmuon included
}

// The error of `set` on tiny AdamW options; "" when the Trainer accepts them.
template <typename Set>
std::string construction_error(Set set) {
  TrainOptions o = tiny(OptimKind::adamw, 1);
  set(o);
  try {
    Trainer t(o, nullptr);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Train, EachBadNumberIsAnErrorNamingItsOption) {
  using ::testing::HasSubstr;
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THAT(construction_error([](TrainOptions& o) { o.weight_decay = -5; }), HasSubstr("TrainOptions.weight_decay "));
  EXPECT_THAT(construction_error([&](TrainOptions& o) { o.weight_decay = nan; }), HasSubstr("TrainOptions.weight_decay "));
  EXPECT_THAT(construction_error([&](TrainOptions& o) { o.weight_decay = inf; }), HasSubstr("TrainOptions.weight_decay "));
  EXPECT_THAT(construction_error([&](TrainOptions& o) { o.lr = inf; }), HasSubstr("TrainOptions.lr "));
  EXPECT_THAT(construction_error([&](TrainOptions& o) { o.adamw_lr = 0; }), HasSubstr("TrainOptions.adamw_lr "));
  EXPECT_THAT(construction_error([](TrainOptions& o) { o.warmup = -1; }), HasSubstr("TrainOptions.warmup "));
  EXPECT_THAT(construction_error([](TrainOptions& o) { o.min_lr_ratio = 1.5; }), HasSubstr("TrainOptions.min_lr_ratio "));
  EXPECT_THAT(construction_error([](TrainOptions& o) { o.val_every = -1; }), HasSubstr("TrainOptions.val_every "));
  EXPECT_THAT(construction_error([](TrainOptions& o) { o.val_batches = 0; }), HasSubstr("TrainOptions.val_batches "));
  EXPECT_THAT(construction_error([](TrainOptions& o) { o.model.layers = 0; }),
              HasSubstr("GptConfig.layers must be positive, got 0"));
  EXPECT_THAT(construction_error([](TrainOptions& o) { o.model.heads = 3; }), HasSubstr("GptConfig.heads 3"));
}

// Splits of a corpus file: the training part ends at the last newline before 90% of the file.
TEST(Train, EachSplitNeedsOneSequenceOfContextPlusOneBytes) {
  using ::testing::HasSubstr;
  test::TempDir dir;
  const int64_t T = tiny(OptimKind::adamw, 1).model.context;
  // Training part "a\n" (2 bytes): too short for a sequence, an error at construction naming the file.
  const std::string short_train = dir.file("short_train.txt");
  std::ofstream(short_train) << "a\n" << std::string(100, 'x');
  const std::string e = construction_error([&](TrainOptions& o) { o.data = short_train; });
  EXPECT_THAT(e, HasSubstr("training part of '" + short_train + "' has 2 bytes"));
  // Validation part of exactly T+1 bytes: one sequence fits, so training and validation run.
  const std::string exact_val = dir.file("exact_val.txt");
  std::ofstream(exact_val) << std::string(150, 'x') << "\n" << std::string(T, 'y') << "\n";
  EXPECT_EQ(construction_error([&](TrainOptions& o) { o.data = exact_val; }), "");
  TrainOptions o = tiny(OptimKind::adamw, 1);
  o.data = exact_val;
  Trainer t(o, nullptr);
  t.train_step();
  EXPECT_TRUE(std::isfinite(t.validation_loss()));
  // One byte less is an error naming the validation part.
  const std::string short_val = dir.file("short_val.txt");
  std::ofstream(short_val) << std::string(150, 'x') << "\n" << std::string(T - 1, 'y') << "\n";
  EXPECT_THAT(construction_error([&](TrainOptions& o) { o.data = short_val; }),
              HasSubstr("validation part of '" + short_val + "' has " + std::to_string(T) + " bytes"));
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

// The single-process definition of a Muon run, written out: whole tensors in GptBuffers, dmuon::Muon,
// the Trainer's batches (sample_batch of rank 0 of 1) and schedule. Returns the training losses and
// leaves the parameters in `buffers`.
std::vector<double> single_process_muon_run(const TrainOptions& o, GptBuffers& buffers, Gpt& model) {
  const std::vector<ParamSpec>& specs = model.params();
  buffers.init(o.model, specs, o.seed);
  buffers.bind_to(model);
  std::vector<ParamRef> refs;
  for (size_t i = 0; i < specs.size(); ++i) refs.push_back({specs[i], buffers.value(i), buffers.grad(i)});
  OptimizerOptions opt;
  opt.accumulation_steps = o.micro_batches;
  opt.muon.ns = o.ns;
  Muon muon(refs, opt);
  const TextCorpus corpus = load_text_corpus(o.data);
  const double peak = default_lr(OptimKind::muon);
  std::vector<double> losses;
  for (int64_t step = 0; step < o.steps; ++step) {
    const double f = lr_factor(step, o.steps, o.warmup, o.min_lr_ratio);
    muon.set_lr(peak * f, o.adamw_lr * f);
    double loss = 0;
    for (int micro = 0; micro < o.micro_batches; ++micro) {
      const TokenBatch b =
          sample_batch(corpus.train, o.batch, o.model.context, o.seed, step, {0, 1, micro, o.micro_batches});
      buffers.zero_grads();
      model.set_batch(b.inputs.data(), b.targets.data(), b.rows, o.model.context);
      for (int u = 0; u < model.num_units(); ++u) model.forward_unit(u);
      loss += model.loss();
      for (int u = model.num_units() - 1; u >= 0; --u) model.backward_unit(u);
      muon.step();
    }
    losses.push_back(loss / o.micro_batches);
  }
  return losses;
}

// A Trainer without a communicator runs on a world of one through the sharded hooks and the optimizer
// factory, like many ranks; it equals the single-process loop. The same operations in the same order
// (a reduce over one rank copies), so the difference is at most float32 rounding of reordered sums:
// the tolerance of tests/train/train_mpi_test.cpp.
TEST(Train, AWorldOfOneEqualsTheSingleProcessLoop) {
  TrainOptions o = tiny(OptimKind::muon, 4);
  o.micro_batches = 2;
  Trainer trainer(o, nullptr);
  Gpt model(o.model);
  GptBuffers buffers(model);
  const std::vector<double> expected = single_process_muon_run(o, buffers, model);
  for (int64_t s = 0; s < o.steps; ++s)
    EXPECT_NEAR(trainer.train_step().train_loss, expected[s], 1e-5 * expected[s]) << "step " << s + 1;
  const auto params = trainer.full_params();
  const auto& specs = model.params();
  for (size_t i = 0; i < specs.size(); ++i) {
    double diff = 0, norm = 0;
    for (int64_t k = 0; k < specs[i].numel(); ++k) {
      const double ref = buffers.value(static_cast<int>(i))[k];
      diff += (params[i][k] - ref) * (params[i][k] - ref);
      norm += ref * ref;
    }
    EXPECT_LE(std::sqrt(diff / std::max(norm, 1e-30)), 1e-5) << specs[i].name;
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
    EXPECT_EQ(t.resume_changes(), std::vector<std::string>{}) << to_string(k);
    for (int s = 3; s < 6; ++s) EXPECT_EQ(t.train_step().train_loss, expected[s]) << to_string(k) << " step " << s + 1;
    EXPECT_EQ(t.full_params(), whole.full_params()) << to_string(k);
  }
}

// Trains one step of `o` and saves it to `path`; returns path.
std::string checkpoint_after_one_step(const TrainOptions& o, const std::string& path) {
  Trainer t(o, nullptr);
  t.train_step();
  t.save(path);
  return path;
}

// A checkpoint records the options that decide an exact continuation; resuming with others names each
// change (dmuon train prints them as one warning) and goes on under the new options.
TEST(Train, ResumingWithOtherOptionsNamesEachChange) {
  test::TempDir dir;
  const TrainOptions o = tiny(OptimKind::muon, 4);
  const std::string ckpt = checkpoint_after_one_step(o, dir.file("ck"));
  const CheckpointRun saved = read_checkpoint_contents(ckpt).run;
  EXPECT_EQ(saved.at("seed"), std::to_string(o.seed));
  EXPECT_EQ(saved.at("lr"), "0.02");  // the default Muon lr, as the run used it
  TrainOptions other = o;
  other.resume = ckpt;
  other.seed = o.seed + 1;
  other.steps = 6;
  other.lr = 0.05;
  Trainer t(other, nullptr);
  EXPECT_EQ(t.resume_changes(), (std::vector<std::string>{"lr 0.05 (saved: 0.02)",
                                                          "seed " + std::to_string(o.seed + 1) + " (saved: " +
                                                              std::to_string(o.seed) + ")",
                                                          "steps 6 (saved: 4)"}));
  EXPECT_EQ(t.steps_done(), 1);
}

// Checkpoints written before the run records were keyed by field names recorded them under dmuon train's
// flags ("--micro-batches"): they still load, read under the field names, and resuming with the same
// options reports no change.
TEST(Train, AnOldCheckpointWithFlagKeyedRunRecordStillResumes) {
  test::TempDir dir;
  const TrainOptions o = tiny(OptimKind::muon, 4);
  const std::string ckpt = checkpoint_after_one_step(o, dir.file("ck"));
  // Rewrite the record as the older writer did, with the index's checksum over the new values.
  const std::string index_path = ckpt + "/index.json";
  nlohmann::json index = nlohmann::json::parse(std::ifstream(index_path));
  nlohmann::json old_run = nlohmann::json::object();
  for (const auto& [field, value] : index.at("run").items()) {
    std::string flag = "--" + field;
    std::replace(flag.begin(), flag.end(), '_', '-');
    old_run[flag] = value;
  }
  ASSERT_TRUE(old_run.contains("--micro-batches"));
  ASSERT_TRUE(old_run.contains("--min-lr-ratio"));
  index["run"] = old_run;
  index.erase("index_fnv1a64");
  index["index_fnv1a64"] = fnv1a64_hex(index.dump());
  write_file_atomically(index_path, index.dump(1));

  const CheckpointRun saved = read_checkpoint_contents(ckpt).run;
  EXPECT_EQ(saved.at("micro_batches"), std::to_string(o.micro_batches));
  EXPECT_EQ(saved.at("min_lr_ratio"), "0.1");
  EXPECT_EQ(saved.count("--seed"), 0u);
  TrainOptions rest = o;
  rest.resume = ckpt;
  Trainer resumed(rest, nullptr);
  EXPECT_EQ(resumed.steps_done(), 1);
  EXPECT_EQ(resumed.resume_changes(), std::vector<std::string>{});
  rest.seed = o.seed + 1;
  Trainer changed(rest, nullptr);
  EXPECT_EQ(changed.resume_changes(), (std::vector<std::string>{"seed " + std::to_string(o.seed + 1) + " (saved: " +
                                                                std::to_string(o.seed) + ")"}));
}

// Determinism: the same options and seed give the same losses and parameters, bit for bit, run after
// run (no state outside the options: no clock, no thread-count-dependent reduction order).
TEST(Train, TheSameSeedTwiceGivesBitIdenticalLossesAndParameters) {
  for (OptimKind k : {OptimKind::muon, OptimKind::adamw}) {
    std::vector<double> losses[2];
    std::vector<std::vector<float>> params[2];
    for (int run = 0; run < 2; ++run) {
      Trainer t(tiny(k, 4), nullptr);
      while (!t.done()) losses[run].push_back(t.train_step().train_loss);
      params[run] = t.full_params();
    }
    EXPECT_EQ(losses[0], losses[1]) << to_string(k);
    EXPECT_EQ(params[0], params[1]) << to_string(k);
  }
}

// save_every: checkpoints written in the background of the next step, the newest `keep` kept; a
// run resumed from any of them continues bit for bit (batches and learning rate included).
TEST(Train, PeriodicCheckpointsResumeBitForBit) {
  test::TempDir dir;
  TrainOptions o = tiny(OptimKind::muon, 7);
  o.save_dir = dir.file("ck");
  o.save_every = 2;
  o.keep = 3;
  Trainer whole(o, nullptr);
  std::vector<double> expected;
  std::vector<std::string> completed;
  while (!whole.done()) {
    expected.push_back(whole.train_step().train_loss);
    completed.push_back(whole.last_checkpoint());
  }
  // Step 2's checkpoint is written while step 3 runs and complete after it; step 7 (the last) at once.
  EXPECT_EQ(completed[1], "");
  EXPECT_EQ(completed[2], checkpoint_for_step(o.save_dir, 2));
  EXPECT_EQ(completed[6], checkpoint_for_step(o.save_dir, 7));
  EXPECT_FALSE(std::filesystem::exists(checkpoint_for_step(o.save_dir, 2)));  // keep 3: 4, 6, 7
  for (int64_t from : {4, 6}) {
    TrainOptions rest = tiny(OptimKind::muon, 7);
    rest.resume = checkpoint_for_step(o.save_dir, from);
    Trainer t(rest, nullptr);
    ASSERT_EQ(t.steps_done(), from);
    for (int64_t s = from; s < 7; ++s) EXPECT_EQ(t.train_step().train_loss, expected[s]) << "step " << s + 1;
    EXPECT_EQ(t.full_params(), whole.full_params()) << "resumed from step " << from;
  }
}

// stop_signal (what `dmuon train` connects to SIGTERM): the step in progress finishes, a checkpoint
// of it is complete before train_step returns, and resuming from the folder continues bit for bit.
TEST(Train, AStopSignalEndsTheStepWithACheckpointThatResumesBitForBit) {
  test::TempDir dir;
  TrainOptions o = tiny(OptimKind::adamw, 6);
  Trainer whole(o, nullptr);
  std::vector<double> expected;
  while (!whole.done()) expected.push_back(whole.train_step().train_loss);

  TrainOptions stopped = o;
  stopped.save_dir = dir.path();
  stopped.save_every = 2;
  int polls = 0;
  stopped.stop_signal = [&polls] { return ++polls == 3; };  // the signal arrives during step 3
  {
    Trainer t(stopped, nullptr);
    while (!t.done() && !t.stop_requested()) t.train_step();
    EXPECT_EQ(t.steps_done(), 3);
    EXPECT_EQ(t.last_checkpoint(), checkpoint_for_step(dir.path(), 3));
  }
  TrainOptions rest = o;
  rest.resume = dir.path();
  Trainer t(rest, nullptr);
  ASSERT_EQ(t.steps_done(), 3);
  for (int s = 3; s < 6; ++s) EXPECT_EQ(t.train_step().train_loss, expected[s]) << "step " << s + 1;
  EXPECT_EQ(t.full_params(), whole.full_params());
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
