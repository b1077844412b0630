// End-to-end training of the GPT example (gpt.hpp) on byte-level text (data.hpp): the loop behind
// `dmuon train`, in the library so tests drive it directly.
//
// CPU only, by design: the CPU reference and the MPI demonstration of the engine (docs/ARCHITECTURE.md,
// "The C++ trainer's role"). The model computes on the host and the optimizer stack is built without a
// backend (the CPU's, trainer.cpp); training on GPUs is dmuon.torch under FSDP2 (docs/pytorch.md).
//
// One optimizer step = M micro-batches, each a forward over units 0..U-1 and a backward over U-1..0
// driven through the sharded runtime's hooks (shard.hpp: the next unit's gather is in flight while a
// unit computes; a unit's gradient reduce is in flight while the previous unit's backward runs), then
// Optimizer::step(), which accumulates the M reduced gradients and updates on the last one.
// Rank r of D reads its slice of every global batch (data.hpp), so the trajectory does not depend on D.
//
// Optimizers (TrainOptions::optim), built by make_optimizer_stack (optimizer_factory.hpp) for one rank
// or many alike:
//   adamw        AdamW on every parameter, even sharding (FSDP/ZeRO-3 + AdamW: the baseline)
//   muon         single-process Muon (matrices) + AdamW (the rest); world size 1 only
//   muon-gather  Muon by gather-then-compute over even shards (DESIGN 3.2)
//   dmuon        Muon with owner-aligned shards: each matrix updated by its owner alone (DESIGN 3.1)
// Learning rate: linear warmup over `warmup` steps to the peak, then cosine decay to
// min_lr_ratio·peak at the last step; Muon and AdamW groups share the schedule.
//
// Collective: every rank constructs the Trainer and calls the same methods in the same order.
//
// Determinism: the same options, seed and world size give bit-identical losses and parameters run
// after run, and a run resumed from any of its checkpoints continues bit-identically (the batches
// and the learning rate are functions of the seed and the step). Across world sizes the results are
// equal within float32 rounding of the reduction order, not bitwise (docs/RELIABILITY.md).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dmuon/gpt.hpp"
#include "dmuon/ns.hpp"
#include "dmuon/optimizer_factory.hpp"
#include "dmuon/plan.hpp"
#include "dmuon/shard.hpp"
#include "dmuon/tune.hpp"

namespace dmuon {

struct TrainOptions {
  GptConfig model;  // L=4, C=128, NH=4, T=64 by default (867k parameters)
  OptimKind optim = OptimKind::dmuon;
  shard::Mode shard_mode = shard::Mode::z3;  // how the sharded optimizers gather (shard.hpp)
  // dmuon: how matrices get their owners (plan.hpp; rank 0 solves, every rank uses its owners).
  // Costs are Newton–Schulz flop estimates: their ratios, not the device, decide the balance.
  Balancer balancer = Balancer::milp;
  int64_t steps = 300;        // optimizer steps of the whole run (a resumed run continues to it)
  uint64_t seed = 1;          // initialisation and batch order
  int64_t batch = 64;         // B: sequences per global batch (divisible by world·micro_batches); make demo's
  int micro_batches = 1;      // M: gradient accumulation
  double lr = 0;              // peak lr of the main group: Muon's (muon*, dmuon) or AdamW's (adamw);
                              // 0 = default_lr(optim) (peak_lr resolves it)
  double adamw_lr = 3e-3;     // peak lr of the AdamW group in Muon runs
  double weight_decay = 0;    // decoupled, both groups
  int64_t warmup = 20;        // steps of linear warmup
  double min_lr_ratio = 0.1;  // the cosine ends at this fraction of the peak
  int64_t val_every = 50;     // validation every this many steps (and after the last); 0: never
  int64_t val_batches = 8;    // global batches of B sequences from the validation stream
  std::string data;           // text file or folder; empty: the fortunes corpus
  std::string resume;         // checkpoint, or folder of periodic ones (its newest), to start from (optional)
  // Checkpoints (checkpoint_rotation.hpp): save_dir/step-N after step `steps`, and after every
  // save_every-th step (0: only the last), keeping the newest `keep`. A periodic checkpoint's state
  // is copied at its step and its files are written on a background thread during the next step;
  // it is complete (index written, older ones pruned) after that step. Empty save_dir: none.
  std::string save_dir;
  int64_t save_every = 0;
  int keep = 2;
  // Polled by every rank after each step: 0, or a positive code asking to stop (the number of a
  // signal the rank caught, say); when any rank returns one, every rank learns the largest after
  // the same step (stop_requested() below). Optional.
  std::function<int()> stop_signal;
  NsOptions ns;               // Muon's Newton–Schulz (`dmuon bench e2e` runs the plain baseline with it)
  // Per-matrix Muon options by name (OptimizerOptions::muon_rules; `dmuon train --muon-group`, one rule each, the
  // first matching wins). With `tune`, a rule's matrices whose Newton–Schulz differs from `ns` run the untuned
  // engine with the rule's options (ns_orthogonalizer); the others, the tuned kernels.
  std::vector<MuonRule> muon_group;
  // Muon runs: NS kernels from the tuning cache (tune.hpp) over ns's math, and DMuon's owners planned
  // from the tuned batch times (tuned_batch_time: measured load balancing) instead of flop estimates.
  // Rank 0 tunes the shapes the cache lacks while the other ranks wait (tune_across_ranks); every
  // rank then uses its entries. Requests: each Muon shape at the batch one rank runs (dmuon: ceil of
  // count/ranks; muon, muon-gather: the whole count).
  bool tune = false;
  std::string tune_cache;                             // empty: TuneSessionOptions::cache_path's default
  TuneProgressFn tune_progress;                       // rank 0: tuning progress (optional)
  std::function<void(const std::string&)> tune_warn;  // rank 0: TuneSessionOptions::warn (optional)
};

// What one optimizer step measured (the rows of the metrics CSV, metrics_csv.hpp). Times are wall-clock
// seconds, max over ranks (step_s: the whole step; fwd_bwd_s: forward and backward compute; optim_s: the
// optimizer; comm_wait_s: time blocked on communication that did not overlap compute). val_loss is set
// on steps with evaluation.
struct StepMetrics {
  int64_t step = 0;
  double train_loss = 0;
  std::optional<double> val_loss;
  double step_s = 0, fwd_bwd_s = 0, optim_s = 0, comm_wait_s = 0;
};

// The peak learning rate TrainOptions::lr 0 stands for: 0.02 for Muon matrices, 3e-3 for AdamW.
double default_lr(OptimKind kind);
// The main group's peak learning rate the run uses: o.lr, or default_lr(o.optim) when o.lr is 0.
double peak_lr(const TrainOptions& o);

// Multiplier of the peak learning rate for update `step` (0-based) of `total`: (step+1)/warmup during
// warmup, then 0.5·(1+cos(π·p))·(1−min_ratio)+min_ratio with p going 0→1 over the remaining steps.
double lr_factor(int64_t step, int64_t total, int64_t warmup, double min_ratio);

class Trainer {
 public:
  // Loads the corpus, builds the model and optimizer and, with options.resume, loads the checkpoint
  // (checked against the model and optimizer before tuning, so a mismatch costs no tuning time).
  // comm: the ranks to train over; null trains in this process alone (comm::self(), a world of one,
  // through the same code as many ranks). Throws dmuon::Error naming a bad option by its field
  // ("TrainOptions.steps must be at least 1"; `dmuon train` shows its flag instead) or a bad file.
  Trainer(TrainOptions options, std::shared_ptr<comm::Comm> comm);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  const TrainOptions& options() const { return options_; }
  int rank() const;
  int world_size() const;
  int64_t steps_done() const;  // completed optimizer steps (restored by resume)
  bool done() const { return steps_done() >= options_.steps; }

  // Runs the next optimizer step. Losses are means over the global batch; times are max over ranks.
  // val_loss is set after steps that are multiples of val_every and after the last step. With
  // save_dir, completes the previous step's background checkpoint and starts this step's if due.
  StepMetrics train_step();
  // Mean loss over val_batches fixed global batches of the validation stream (the same sequences at
  // every world size: each rank evaluates its slice and the sums are combined).
  double validation_loss();
  // Writes a checkpoint of parameters and optimizer state (checkpoint.hpp). Between steps only.
  void save(const std::string& dir);
  // The newest complete checkpoint this run wrote to save_dir (empty before the first).
  const std::string& last_checkpoint() const;
  // The largest code any rank's stop_signal returned during the last step, or 0 (the same on every
  // rank). When non-zero, with save_dir, train_step has written a complete checkpoint of that step.
  int stop_requested() const;
  // With resume: the options the checkpoint's run recorded (checkpoint.hpp's CheckpointRun, keyed by
  // TrainOptions field names) that this run changes, each as "seed 2 (saved: 1)"; the run goes on under
  // the new ones, so it does not continue the saved run exactly. Empty when nothing changed or the
  // checkpoint recorded no options.
  const std::vector<std::string>& resume_changes() const;
  // Every parameter's full value, in gpt_param_specs order, on every rank (collective).
  std::vector<std::vector<float>> full_params();
  // With options.tune: the entries every rank runs with (request order) and the seconds the tuning
  // step took on this rank (rank 0 tuning, or the others waiting for it; cache hits only: milliseconds).
  const std::vector<TuneEntry>& tuned() const;
  double tune_seconds() const;
  // The owner plan DMuon runs with (empty for other optimizers); per-rank time_s is its predicted NS load
  // (seconds when tuned; untuned, relative_flop_batch_time's units of 10^12 flops).
  const Plan& plan() const;
  // What the optimizer runs with and did, to check against plan(): the owner of each parameter that the
  // sharded parameters are laid out by (shard.hpp's owners(): −1 for elementwise; empty for the even
  // layout of adamw and muon-gather), and this rank's last update (Optimizer::Stats: its Newton–Schulz
  // matrices, which for dmuon are the ones it owns).
  const std::vector<int>& owners() const;
  const Optimizer::Stats& last_optimizer_stats() const;

 private:
  struct Impl;
  TrainOptions options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dmuon
