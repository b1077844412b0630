// The training loop of the GPT example (see include/dmuon/trainer.hpp): batches, the unit-by-unit
// forward and backward through the sharded runtime's hooks, the optimizer, validation, checkpoints.
#include "dmuon/trainer.hpp"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <numbers>
#include <optional>
#include <set>
#include <thread>

#include "dmuon/checkpoint.hpp"
#include "dmuon/checkpoint_rotation.hpp"
#include "dmuon/comm.hpp"
#include "dmuon/data.hpp"
#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/optim.hpp"
#include "dmuon/optimizer_factory.hpp"
#include "dmuon/plan_across_ranks.hpp"
#include "dmuon/shape.hpp"
#include "dmuon/shard.hpp"

namespace dmuon {

double default_lr(OptimKind kind) { return optim_kind_info(kind).default_lr; }  // the kind's row (optimizer_factory.cpp)
double peak_lr(const TrainOptions& o) { return o.lr > 0 ? o.lr : default_lr(o.optim); }

double lr_factor(int64_t step, int64_t total, int64_t warmup, double min_ratio) {
  if (step < warmup) return static_cast<double>(step + 1) / static_cast<double>(warmup);
  const int64_t decay_steps = total - warmup;
  if (decay_steps <= 1) return 1.0;
  const double p = std::min(1.0, static_cast<double>(step - warmup) / static_cast<double>(decay_steps - 1));
  return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + std::cos(std::numbers::pi * p));
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The validation batches are drawn with their own seed so that they never coincide with training draws.
constexpr uint64_t kValSeedSalt = 0x5eed'0f'7a1dULL;

// The options a resumed run must share with the saved one to continue it exactly (the batches and the
// learning rate are functions of the seed, the step and these), as recorded in every checkpoint it writes,
// keyed by their TrainOptions field names (checkpoints written before this named them by their dmuon train
// flags: read_checkpoint_contents reads those under the field names).
CheckpointRun run_record(const TrainOptions& o) {
  const auto text = [](double v) {  // the shortest text that reads back as v
    char buf[32];
    return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
  };
  CheckpointRun run = {{"seed", std::to_string(o.seed)},
                       {"batch", std::to_string(o.batch)},
                       {"micro_batches", std::to_string(o.micro_batches)},
                       {"steps", std::to_string(o.steps)},
                       {"lr", text(peak_lr(o))},
                       {"weight_decay", text(o.weight_decay)},
                       {"warmup", std::to_string(o.warmup)},
                       {"min_lr_ratio", text(o.min_lr_ratio)},
                       {"data", o.data.empty() ? "(the fortunes corpus)"
                                               : std::filesystem::absolute(o.data).lexically_normal().string()}};
  if (o.optim != OptimKind::adamw) run["adamw_lr"] = text(o.adamw_lr);
  if (o.optim != OptimKind::adamw) {
    MuonMatrixOptions defaults;
    defaults.ns = o.ns;
    std::string rules;
    for (const MuonRule& rule : o.muon_group) {
      if (!rules.empty()) rules += ' ';
      rules += to_string(rule, defaults);
    }
    run["muon_group"] = rules.empty() ? "(none)" : rules;
  }
  return run;
}

}  // namespace

struct Trainer::Impl {
  std::shared_ptr<comm::Comm> comm;  // the ranks; a world of one when the Trainer got none
  TextCorpus corpus;
  Gpt model;
  OptimizerStack stack;          // this rank's shards and the optimizer over them
  std::vector<TuneEntry> tuned;  // options.tune: what every rank runs with
  double tune_s = 0;
  Plan plan;                     // dmuon: the owners and their predicted NS loads
  int64_t step = 0;
  int stop = 0;                  // the largest stop_signal code of the last step over ranks
  std::vector<std::string> resume_changes;  // recorded options this run changes (check_resume)

  // A periodic checkpoint whose files a background thread writes while the next step runs.
  struct PendingSave {
    std::unique_ptr<CheckpointWriter> writer;
    std::thread thread;
  };
  std::optional<PendingSave> pending;
  std::string last_checkpoint;

  Impl(const TrainOptions& o, std::shared_ptr<comm::Comm> c) : comm(std::move(c)), model(o.model) {}
  // An unfinished background save is left as debris (step-N.new), which resuming ignores.
  ~Impl() {
    if (pending && pending->thread.joinable()) pending->thread.join();
  }

  // Collective: completes the background save, if any (index, swap, pruning to `keep`).
  void finish_save(const TrainOptions& o) {
    if (!pending) return;
    pending->thread.join();
    const std::unique_ptr<CheckpointWriter> writer = std::move(pending->writer);
    pending.reset();
    writer->finish([&] { prune_checkpoints(o.save_dir, o.keep); });
    last_checkpoint = writer->dir();
  }

  // Collective: a checkpoint of the current step into save_dir, written now or in the background.
  void start_save(const TrainOptions& o, bool background) {
    finish_save(o);
    auto writer =
        std::make_unique<CheckpointWriter>(checkpoint_for_step(o.save_dir, step), *stack.optimizer, run_record(o));
    if (background) {
      CheckpointWriter* w = writer.get();
      pending.emplace(PendingSave{std::move(writer), std::thread([w] { w->write(); })});
      return;
    }
    writer->write();
    writer->finish([&] { prune_checkpoints(o.save_dir, o.keep); });
    last_checkpoint = writer->dir();
  }

  int rank() const { return comm->rank(); }
  int world() const { return comm->size(); }
  shard::ShardedParams& sharded() { return *stack.params; }

  // Sums `values` over ranks, in place.
  void sum(std::span<double> values) { comm->all_reduce<double>(values, ReduceOp::sum).wait(); }

  // Binds the parameters of `unit` to the runtime's gathered views (and gradients in backward).
  void bind_unit(int unit, bool grads) {
    for (int p : model.unit_params(unit))
      model.bind(p, sharded().param(p).data(), grads ? sharded().grad(p).data() : nullptr);
  }

  // Forward of the bound batch over every unit; returns the seconds spent computing.
  double forward(bool forward_only) {
    double compute = 0;
    for (int u = 0; u < model.num_units(); ++u) {
      sharded().before_forward(u);
      bind_unit(u, false);
      const auto t0 = Clock::now();
      model.forward_unit(u);
      compute += seconds_since(t0);
      sharded().after_forward(u);
      // A forward-only pass (validation) must not leave units gathered (z2 keeps them for backward).
      if (forward_only && sharded().options().mode == shard::Mode::z2) sharded().release(u);
    }
    return compute;
  }

  double backward() {
    double compute = 0;
    for (int u = model.num_units() - 1; u >= 0; --u) {
      sharded().before_backward(u);
      bind_unit(u, true);
      const auto t0 = Clock::now();
      model.backward_unit(u);
      compute += seconds_since(t0);
      sharded().after_backward(u);
    }
    sharded().finish_backward();
    return compute;
  }

  double comm_wait_total() {
    double s = 0;
    for (int u = 0; u < sharded().num_units(); ++u)
      s += sharded().times(u).gather_wait_s + sharded().times(u).reduce_wait_s;
    return s;
  }
};

namespace {

OptimizerOptions optimizer_options(const TrainOptions& o) {
  OptimizerOptions opt;
  opt.accumulation_steps = o.micro_batches;
  const double lr = peak_lr(o);
  if (o.optim == OptimKind::adamw) {
    opt.rules = {{"*", OptimGroup::adamw}};
    opt.adamw.lr = lr;
  } else {
    opt.muon.lr = lr;
    opt.adamw.lr = o.adamw_lr;
  }
  opt.muon.ns = o.ns;
  opt.muon_rules = o.muon_group;
  opt.muon.weight_decay = o.weight_decay;
  opt.adamw.weight_decay = o.weight_decay;
  return opt;
}

// Messages name the fields (TrainOptions.steps); dmuon train shows its flags in their place.
void validate(const TrainOptions& o, int world) {
  validate(o.model);
  DMUON_CHECK(o.steps >= 1, "TrainOptions.steps must be at least 1, got ", o.steps);
  DMUON_CHECK(o.micro_batches >= 1, "TrainOptions.micro_batches must be at least 1, got ", o.micro_batches);
  DMUON_CHECK(o.batch >= 1 && o.batch % (int64_t(world) * o.micro_batches) == 0, "TrainOptions.batch ", o.batch,
              " must be a positive multiple of ranks x TrainOptions.micro_batches = ", world, " x ", o.micro_batches);
  // Written so that NaN fails too; inf is rejected explicitly.
  DMUON_CHECK(std::isfinite(o.lr) && o.lr >= 0, "TrainOptions.lr must be finite and at least 0 (0: the default), got ",
              o.lr);
  DMUON_CHECK(std::isfinite(o.adamw_lr) && o.adamw_lr > 0, "TrainOptions.adamw_lr must be finite and positive, got ",
              o.adamw_lr);
  DMUON_CHECK(std::isfinite(o.weight_decay) && o.weight_decay >= 0,
              "TrainOptions.weight_decay must be finite and at least 0, got ", o.weight_decay);
  DMUON_CHECK(o.warmup >= 0, "TrainOptions.warmup must be at least 0, got ", o.warmup);
  DMUON_CHECK(o.muon_group.empty() || o.optim != OptimKind::adamw, "TrainOptions.muon_group sets options of Muon "
              "matrices, and TrainOptions.optim adamw has none (", o.muon_group.size(), " rule(s) given)");
  DMUON_CHECK(o.min_lr_ratio >= 0 && o.min_lr_ratio <= 1, "TrainOptions.min_lr_ratio must be in [0, 1], got ",
              o.min_lr_ratio);
  DMUON_CHECK(o.val_every >= 0, "TrainOptions.val_every must be at least 0, got ", o.val_every);
  DMUON_CHECK(o.val_batches >= 1, "TrainOptions.val_batches must be at least 1, got ", o.val_batches);
  DMUON_CHECK(o.save_every >= 0, "TrainOptions.save_every must be at least 0, got ", o.save_every);
  DMUON_CHECK(o.save_every == 0 || !o.save_dir.empty(), "TrainOptions.save_every needs TrainOptions.save_dir");
  DMUON_CHECK(o.keep >= 1, "TrainOptions.keep must be at least 1, got ", o.keep);
}

// Before any tuning or allocation: the checkpoint to resume from holds every parameter of this model
// with its shape and the state its optimizer group keeps (Muon matrices: momentum; AdamW: m and v),
// nothing else, and is not past --steps. load_checkpoint checks the data itself later. Returns the
// recorded options this run changes ("seed 2 (saved: 1)").
std::vector<std::string> check_resume(const std::string& checkpoint, const TrainOptions& o,
                                      const std::vector<ParamSpec>& specs) {
  const CheckpointContents saved = read_checkpoint_contents(checkpoint);
  DMUON_CHECK(saved.steps() <= o.steps, "checkpoint ", checkpoint, " is at step ", saved.steps(),
              ", past TrainOptions.steps ", o.steps);
  std::set<std::string> names;
  for (const ParamSpec& spec : specs) {
    names.insert(spec.name);
    const auto it = saved.params.find(spec.name);
    DMUON_CHECK(it != saved.params.end(), "checkpoint ", checkpoint, " lacks parameter '", spec.name,
                "' (saved from another model?)");
    DMUON_CHECK(it->second.shape == spec.shape, "checkpoint ", checkpoint, " holds parameter '", spec.name,
                "' with shape ", shape_text(it->second.shape), ", this model's is ", shape_text(spec.shape),
                " (saved with other TrainOptions.model.width, TrainOptions.model.heads or TrainOptions.model.context?)");
    const bool muon = o.optim != OptimKind::adamw && spec.role == ParamRole::matrix;
    for (const char* kind : muon ? std::vector<const char*>{"param", "muon.momentum"}
                                 : std::vector<const char*>{"param", "adamw.m", "adamw.v"}) {
      DMUON_CHECK(it->second.kinds.count(kind), "checkpoint ", checkpoint, " has no ", kind, " for parameter '",
                  spec.name, "' (saved by another TrainOptions.optim? this run: ", to_string(o.optim), ")");
    }
  }
  for (const auto& [name, param] : saved.params)
    DMUON_CHECK(names.count(name), "checkpoint ", checkpoint, " holds parameter '", name,
                "', which this model does not have (saved from another model?)");
  std::vector<std::string> changes;
  for (const auto& [option, value] : run_record(o)) {
    const auto it = saved.run.find(option);
    if (it != saved.run.end() && it->second != value)
      changes.push_back(option + " " + value + " (saved: " + it->second + ")");
  }
  return changes;
}

}  // namespace

Trainer::Trainer(TrainOptions options, std::shared_ptr<comm::Comm> comm) : options_(std::move(options)) {
  if (!comm) comm = comm::self();
  validate(options_, comm->size());
  impl_ = std::make_unique<Impl>(options_, std::move(comm));
  Impl& m = *impl_;
  m.corpus = load_text_corpus(options_.data);
  const int64_t T = options_.model.context;
  // A sequence reads T+1 bytes (inputs and the targets shifted by one): each split needs at least that.
  const std::string source = options_.data.empty() ? default_corpus_dir() : options_.data;
  DMUON_CHECK(int64_t(m.corpus.train.size()) >= T + 1, "the training part of '", source, "' has ",
              m.corpus.train.size(), " bytes, fewer than a sequence of TrainOptions.model.context ", T, " + 1");
  DMUON_CHECK(int64_t(m.corpus.val.size()) >= T + 1, "the validation part of '", source, "' has ",
              m.corpus.val.size(), " bytes, fewer than a sequence of TrainOptions.model.context ", T, " + 1");

  const std::vector<ParamSpec>& specs = m.model.params();
  OptimizerStackOptions stack;
  stack.kind = options_.optim;
  stack.mode = options_.shard_mode;
  stack.optimizer = optimizer_options(options_);
  // The checkpoint itself, or the newest complete one in a --save folder.
  const std::string resume = options_.resume.empty() ? "" : newest_checkpoint(options_.resume);
  if (!resume.empty()) m.resume_changes = check_resume(resume, options_, specs);
  // The NS every Muon optimizer runs: tuned kernels (rank 0 tunes, every rank gets its entries) or opt.muon.ns.
  if (options_.tune && options_.optim != OptimKind::adamw) {
    const auto t0 = Clock::now();
    TuneSessionOptions session;
    session.cache_path = options_.tune_cache;
    session.threads = linalg::threads();
    session.progress = options_.tune_progress;
    session.warn = options_.tune_warn;
    // The batch one rank orthogonalizes per shape: its owned share (dmuon) or every matrix.
    const auto requests =
        tune_requests(specs, options_.optim == OptimKind::dmuon ? m.world() : 1, muon_blocks(specs, stack.optimizer));
    m.tuned = tune_across_ranks(*m.comm, requests, session);
    m.tune_s = seconds_since(t0);
    stack.orth = tuned_orthogonalizer(m.tuned, stack.optimizer.muon.ns);
  }
  if (options_.optim == OptimKind::dmuon) {
    PlanOptions plan_options;
    plan_options.balancer = options_.balancer;
    // Measured costs when tuned (DESIGN's measured load balancing); else flop estimates, whose
    // ratios, not the device, decide the balance.
    const BatchTimeFn cost = options_.tune ? tuned_batch_time(m.tuned) : relative_flop_batch_time();
    m.plan = plan_across_ranks(*m.comm, specs,
                               make_plan_items(specs, m.world(), cost, muon_blocks(specs, stack.optimizer)),
                               plan_options);
    stack.owners = m.plan.owner;
  }
  m.stack = make_optimizer_stack(m.comm, specs, stack);
  std::vector<float> init;
  for (size_t i = 0; i < specs.size(); ++i) {
    init.resize(specs[i].numel());
    gpt_init_param(options_.model, specs[i], options_.seed, init.data());
    m.sharded().load_full(static_cast<int>(i), init);
  }
  if (!resume.empty()) {
    load_checkpoint(resume, *m.stack.optimizer);
    m.step = m.stack.optimizer->updates() + m.stack.optimizer->skipped_steps();
  }
}

Trainer::~Trainer() = default;

int Trainer::rank() const { return impl_->rank(); }
int Trainer::world_size() const { return impl_->world(); }
int64_t Trainer::steps_done() const { return impl_->step; }
const std::vector<TuneEntry>& Trainer::tuned() const { return impl_->tuned; }
double Trainer::tune_seconds() const { return impl_->tune_s; }
const Plan& Trainer::plan() const { return impl_->plan; }
const std::vector<int>& Trainer::owners() const { return impl_->stack.params->owners(); }
const Optimizer::Stats& Trainer::last_optimizer_stats() const { return impl_->stack.optimizer->last_stats(); }
const std::string& Trainer::last_checkpoint() const { return impl_->last_checkpoint; }
int Trainer::stop_requested() const { return impl_->stop; }
const std::vector<std::string>& Trainer::resume_changes() const { return impl_->resume_changes; }

StepMetrics Trainer::train_step() {
  Impl& m = *impl_;
  const TrainOptions& o = options_;
  DMUON_CHECK(m.step < o.steps, "train_step: all ", o.steps, " steps are done");
  const double f = lr_factor(m.step, o.steps, o.warmup, o.min_lr_ratio);
  const double peak = peak_lr(o);
  if (o.optim == OptimKind::adamw)
    m.stack.optimizer->set_lr(0, peak * f);
  else
    m.stack.optimizer->set_lr(peak * f, o.adamw_lr * f);

  const int64_t T = o.model.context;
  const double comm_before = m.comm_wait_total();
  double fwd_bwd = 0, optim = 0, loss_sum = 0;
  const auto t_step = Clock::now();
  for (int micro = 0; micro < o.micro_batches; ++micro) {
    const TokenBatch b =
        sample_batch(m.corpus.train, o.batch, T, o.seed, m.step, {m.rank(), m.world(), micro, o.micro_batches});
    m.model.set_batch(b.inputs.data(), b.targets.data(), b.rows, T);
    fwd_bwd += m.forward(false);
    loss_sum += m.model.loss();
    fwd_bwd += m.backward();
    const auto t_opt = Clock::now();
    m.stack.optimizer->step();
    optim += seconds_since(t_opt);
  }
  StepMetrics r;
  r.step = ++m.step;
  // What every rank reports travels in one all-gather: the times and the stop code are max-reduced (any
  // rank's signal stops every rank after this step), the losses summed, here, the same on every rank. Each
  // rank's loss is a sum of float32 losses: their sum in double is exact (unless they differ by more than
  // 2^29 in magnitude), so it equals the all-reduce's, whatever the order.
  const int stop_here = o.stop_signal ? std::max(0, o.stop_signal()) : 0;
  constexpr int kFields = 6;  // step, fwd_bwd, optim, comm wait, stop code (max); loss (sum)
  const double mine[kFields] = {seconds_since(t_step), fwd_bwd, optim, m.comm_wait_total() - comm_before,
                                double(stop_here), loss_sum};
  std::vector<double> all(kFields * m.world());
  m.comm->all_gather<double>(mine, all).wait();
  double max[kFields - 1] = {}, loss = 0;
  for (int q = 0; q < m.world(); ++q) {
    for (int k = 0; k < kFields - 1; ++k) max[k] = std::max(max[k], all[q * kFields + k]);
    loss += all[q * kFields + kFields - 1];
  }
  r.step_s = max[0], r.fwd_bwd_s = max[1], r.optim_s = max[2], r.comm_wait_s = max[3];
  m.stop = static_cast<int>(max[4]);
  r.train_loss = loss / (o.micro_batches * m.world());
  if ((o.val_every > 0 && r.step % o.val_every == 0) || r.step == o.steps) r.val_loss = validation_loss();
  if (!o.save_dir.empty()) {
    m.finish_save(o);  // the previous step's, written while this step ran
    const bool last = r.step == o.steps;
    if (last || m.stop || (o.save_every > 0 && r.step % o.save_every == 0)) m.start_save(o, !(last || m.stop));
  }
  return r;
}

double Trainer::validation_loss() {
  Impl& m = *impl_;
  const TrainOptions& o = options_;
  const int64_t T = o.model.context;
  // The same rows per forward as training (one micro-batch), so activations are not resized.
  double sum[1] = {0};
  for (int64_t k = 0; k < o.val_batches; ++k) {
    for (int micro = 0; micro < o.micro_batches; ++micro) {
      const TokenBatch b = sample_batch(m.corpus.val, o.batch, T, o.seed ^ kValSeedSalt, k,
                                        {m.rank(), m.world(), micro, o.micro_batches});
      m.model.set_batch(b.inputs.data(), b.targets.data(), b.rows, T);
      m.forward(true);
      sum[0] += static_cast<double>(m.model.loss()) * static_cast<double>(b.rows);
    }
  }
  m.sum(sum);
  return sum[0] / static_cast<double>(o.val_batches * o.batch);
}

void Trainer::save(const std::string& dir) {
  impl_->finish_save(options_);
  save_checkpoint(dir, *impl_->stack.optimizer, run_record(options_));
}

std::vector<std::vector<float>> Trainer::full_params() {
  Impl& m = *impl_;
  const auto& specs = m.model.params();
  std::vector<std::vector<float>> out(specs.size());
  for (int u = 0; u < m.sharded().num_units(); ++u) {  // between steps every unit is released
    m.sharded().gather(u);
    m.sharded().wait(u);
    for (int p : m.model.unit_params(u)) {
      out[p] = m.sharded().param(p).to_host();
    }
    m.sharded().release(u);
  }
  return out;
}

}  // namespace dmuon
