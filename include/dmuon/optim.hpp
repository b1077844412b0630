// Optimizers: AdamW for elementwise parameters, Muon (DESIGN.md section 1) for hidden matrices.
//
// Adopting it in a training loop:
//
//   std::vector<dmuon::ParamRef> params = ...;          // spec + pointers to values and gradient
//   dmuon::OptimizerOptions opt;                         // defaults: Muon lr 0.02, AdamW lr 1e-3
//   opt.rules = {{"*.embed.*", dmuon::OptimGroup::adamw}};
//   dmuon::Muon optimizer(params, opt);                  // Newton–Schulz from include/dmuon/ns.hpp
//   for (...) { forward(); backward(); optimizer.set_lr(sched(t), sched_adamw(t)); optimizer.step(); }
//
// Distributed variants (sharded parameters, owner-aligned or gather-then-compute) derive from
// Optimizer and change only where buffers live, how ranks agree, and how Muon's NS is placed.
// Parameters, gradients and the optimizer state live in one Backend's memory (DESIGN 6: host memory on
// the CPU backend, device memory on a GPU); the update runs as that backend's kernels, and the host reads
// two small arrays per update (the gradients' sums of squares and the Newton–Schulz input norms).
//
// The per-tensor update functions below call the same backend kernels as the optimizers (on
// cpu_backend()), so they are not an independent definition: the golden tensors are (tests/data:
// KellerJordan/Muon's and torch.optim.AdamW's outputs, tests/data/README.md), with the float64
// references the tests write themselves; the distributed optimizers are tested against the
// single-process ones.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dmuon/backend.hpp"
#include "dmuon/ns.hpp"
#include "dmuon/params.hpp"
#include "dmuon/update_rules.hpp"

namespace dmuon {

// ---- hyperparameters ----

// torch.optim.AdamW's defaults; dmuon.torch.DMuon's differ (adamw_lr 3e-4, betas (0.9, 0.95)) and the GPT
// trainer's AdamW group runs at 3e-3 (docs/pytorch.md, "Defaults").
struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // decoupled: p ← p·(1 − lr·wd) before the Adam step
};

// s of W ← W·(1 − lr·wd) − lr·s·O for a rows×cols matrix. The default is `original`; dmuon.torch.DMuon's is
// match_rms_adamw (docs/pytorch.md, "Defaults"). docs/optimizers.md names each peer's spelling of each.
enum class MuonScale {
  original,         // sqrt(max(1, rows/cols)) (KellerJordan/Muon)
  match_rms_adamw,  // 0.2·sqrt(max(rows, cols)) (Moonlight)
  spectral,         // sqrt(rows/cols) (torch.optim.Muon's spectral_unclamped, dion's spectral_norm)
  unit_rms,         // sqrt(max(rows, cols)) (Megatron's spectral)
};

enum class MuonVariant {
  muon,     // O = orth(U)
  normuon,  // O = orth(U) normalized per row by a running second moment (rules::NorMuonNormalize)
};

// The Muon options that may differ from matrix to matrix (OptimizerOptions::muon_rules): frozen per matrix when
// the optimizer registers it; matrices of different options never share a Newton–Schulz batch.
struct MuonMatrixOptions {
  NsOptions ns;                             // its Newton–Schulz (steps, coefficients, algorithm, ...)
  MuonScale scale = MuonScale::original;
  double extra_scale_factor = 1.0;          // s ← s·extra_scale_factor (Megatron's extra_scale_factor)
  bool cautious_wd = false;                 // decay only where W·O ≥ 0 (rules::MuonApply)
  MuonVariant variant = MuonVariant::muon;
  double normuon_beta2 = 0.95;              // NorMuon's β2 (state "normuon.v": one value per row; a split by
                                            // columns: one per row and block, (blocks, rows))
  // Split Newton–Schulz (muon_blocks): each block of the matrix orthogonalized, normalized (NorMuon) and scaled on
  // its own, as if it were a parameter of its own (dmuon.torch's split_heads, split_sizes, split_dim).
  int64_t split_heads = 0;             // > 0: that many equal blocks along split_dim (attention heads)
  std::vector<int64_t> split_sizes;    // else, when given: blocks of these lengths along split_dim (fused qkv, gate_up)
  int split_dim = 0;                   // 0: by rows (q/k/v, fused matrices), 1: by columns (o)

  bool operator==(const MuonMatrixOptions&) const = default;
};

// Muon's hyperparameters: the group's lr, momentum and decay, and the per-matrix options' defaults (the matrices
// that no OptimizerOptions::muon_rules rule names take these).
struct MuonHyper : MuonMatrixOptions {
  double lr = 0.02;
  double momentum = 0.95;  // β of the lerp momentum M ← β·M + (1−β)·G
  bool nesterov = true;
  double weight_decay = 0.0;  // decoupled, with the unscaled lr: W ← W·(1 − lr·wd) − lr·s·O
};

// ---- the per-tensor definitions (host memory, on cpu_backend()'s kernels) ----

// AdamW's per-step constants for update t ≥ 1, rounded to float as torch.optim.AdamW rounds them.
AdamWStepConstants adamw_step_constants(const AdamWHyper& hyper, int64_t t);

// One AdamW step on n values, as torch.optim.AdamW: p ← p·(1−lr·wd); m ← β1·m + (1−β1)·g;
// v ← β2·v + (1−β2)·g²; p ← p − (lr/(1−β1^t))·m / (sqrt(v)/sqrt(1−β2^t) + eps).
// g is grad·grad_scale (grad_scale folds clipping and the micro-batch mean in); t ≥ 1 is the step count.
void adamw_step(std::span<float> p, std::span<const float> grad, float grad_scale, std::span<float> m,
                std::span<float> v, int64_t t, const AdamWHyper& hyper);

// Muon momentum on n values: M ← β·M + (1−β)·g, then U ← nesterov ? (1−β)·g + β·M : M,
// with g = grad·grad_scale. u may alias grad.
void muon_momentum(std::span<const float> grad, float grad_scale, std::span<float> momentum, std::span<float> u,
                   const MuonHyper& hyper);

// s of DESIGN section 1 for a rows×cols matrix.
double muon_scale(int64_t rows, int64_t cols, MuonScale scale);

// The blocks a rows×cols Muon matrix named `name` is orthogonalized in: the whole matrix without a split; the
// split_heads equal blocks or the split_sizes blocks along split_dim, in order. Throws dmuon::Error naming the matrix
// and its shape when the split does not fit it (a length not a multiple of split_heads, sizes of another sum).
std::vector<MatrixBlock> muon_blocks(int64_t rows, int64_t cols, const MuonMatrixOptions& options,
                                     const std::string& name);

// Names as `dmuon train --muon-group` spells them ("original", "match_rms_adamw", "spectral", "unit_rms";
// "muon", "normuon"); parse_* throw dmuon::Error listing the valid names.
std::string to_string(MuonScale scale);
std::string to_string(MuonVariant variant);
MuonScale parse_muon_scale(const std::string& name);
MuonVariant parse_muon_variant(const std::string& name);

// W ← W·(1 − lr·wd) − lr·s·O on n values.
void muon_apply(std::span<float> w, std::span<const float> o, const MuonHyper& hyper, double s);

// ---- the optimizer ----

// A parameter as the optimizer sees it. `values` and `grad` hold the elements [offset, offset+count)
// of the flattened (row-major) tensor: the whole tensor in single-process or replicated use, a
// shard otherwise. They point into the optimizer's backend's memory. The optimizer never owns this
// memory; it must outlive the optimizer. The sharded optimizers (distributed_optim.hpp) leave both null:
// they ask ShardedParams for this rank's piece whenever they touch it.
struct ParamRef {
  ParamSpec spec;
  float* values = nullptr;
  float* grad = nullptr;
  int64_t offset = 0;
  int64_t count = -1;  // -1: spec.numel()
};

enum class OptimGroup { muon, adamw };

// Moves parameters between groups by name. `pattern` is a glob over the whole name (`*` any run of
// characters, `?` one character, everything else literal, e.g. "layers.*.mlp.*"), or, with the
// prefix "re:", an ECMAScript regular expression that must match the whole name
// (e.g. "re:layers\\.[0-9]+\\.attn\\..*"). The first matching rule wins; a parameter that no rule
// matches goes to Muon if its role is matrix, to AdamW otherwise. Muon needs ≥ 2 dimensions.
struct GroupRule {
  std::string pattern;
  OptimGroup group = OptimGroup::adamw;
};
bool name_matches(const std::string& pattern, const std::string& name);

// Per-matrix Muon options by name: a Muon matrix whose name `pattern` matches (as GroupRule's) takes `options`;
// the first matching rule wins; a matrix no rule matches takes OptimizerOptions::muon's. A rule that matches no
// Muon matrix is refused (a misspelt pattern would otherwise change nothing).
struct MuonRule {
  std::string pattern;
  MuonMatrixOptions options;
};

// A rule from text "PATTERN:key=value[,key=value...]" (dmuon train's --muon-group), the options not named taken
// from `defaults`. The pattern is everything before the last ':' (a regex may hold ':'). Keys: ns-steps (≥ 1),
// coeffs (keller | you | polar-express), algo (auto | standard | gram), scale (original | match_rms_adamw |
// spectral | unit_rms), extra-scale (> 0), cautious-wd (on | off), variant (muon | normuon), normuon-beta2 ([0, 1)),
// split-heads (≥ 1; 0: no split), split-sizes (lengths joined by '+', e.g. 896+128+128), split-dim (0 | 1).
// Throws dmuon::Error quoting the text and naming the bad key or value.
MuonRule parse_muon_rule(const std::string& text, const MuonMatrixOptions& defaults);
// The rule as parse_muon_rule reads it, naming every key that differs from `defaults` ("attn.*:ns-steps=6").
std::string to_string(const MuonRule& rule, const MuonMatrixOptions& defaults);

enum class NonFinitePolicy {
  error,  // throw dmuon::Error naming the parameter and rank (every rank throws)
  skip,   // every rank skips the step and counts it in skipped_steps()
};

struct OptimizerOptions {
  MuonHyper muon;
  AdamWHyper adamw;
  std::vector<GroupRule> rules;
  std::vector<MuonRule> muon_rules;  // per-matrix Muon options by name (muon's: the default)
  int accumulation_steps = 1;  // step() calls per update; the update uses the mean gradient
  double clip_grad_norm = 0;   // > 0: scale the (mean) gradient so its global L2 norm is at most this
  NonFinitePolicy nonfinite = NonFinitePolicy::error;
};

// What a checkpoint holds for one parameter: its values and each optimizer state buffer, all
// aligned with the parameter's local slice [offset, offset+count).
struct StateSlice {
  std::string param;               // parameter name
  std::string kind;                // "param", "muon.momentum", "normuon.v", "adamw.m", "adamw.v"
  std::vector<int64_t> shape;      // full logical shape of the parameter (normuon.v: {rows}, one value a row)
  int64_t offset = 0;              // first flattened element held here
  float* data = nullptr;           // count values, in the optimizer's backend's memory
  int64_t count = 0;
};

class Optimizer {
 public:
  // Single process: every ParamRef of the Muon group holds its whole tensor. `orth` may be empty
  // when no parameter is in the Muon group. Every pointer of `params` is in `backend`'s memory.
  Optimizer(std::vector<ParamRef> params, OptimizerOptions options, Orthogonalizer orth,
            Backend& backend = cpu_backend());
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Call after each micro-batch's backward. Returns true when the parameters were updated (every
  // accumulation_steps-th call, unless the step was skipped for a non-finite gradient).
  bool step();

  // Learning rates for the next updates (a schedule lives in the training loop).
  void set_lr(double muon_lr, double adamw_lr);

  // What this rank did in the last update (benchmarks compare it with the owner plan's prediction).
  struct Stats {
    double ns_s = 0;          // wall seconds in the Orthogonalizer (Newton–Schulz), all batches together, until
                              // their results are complete on the device
    int64_t ns_matrices = 0;  // matrices it orthogonalized (DMuon: the ones this rank owns)
  };
  const Stats& last_stats() const { return stats_; }

  const OptimizerOptions& options() const { return options_; }
  OptimGroup group_of(const std::string& name) const;  // throws for an unknown name
  // The options a Muon matrix was registered with (its rule's, else options().muon's); throws for a name that is
  // not a Muon matrix of this optimizer.
  const MuonMatrixOptions& muon_options_of(const std::string& name) const;
  int64_t updates() const { return updates_; }             // updates applied (AdamW's t)
  int64_t skipped_steps() const { return skipped_; }       // updates skipped (non-finite gradient)
  double last_grad_norm() const { return last_grad_norm_; }  // global norm of the last mean gradient

  // Checkpoint access (see include/dmuon/checkpoint.hpp).
  std::vector<StateSlice> state_slices();
  void set_counters(int64_t updates, int64_t skipped);
  bool accumulating() const { return micro_ != 0; }  // between micro-batches of one update
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  Backend& backend() const { return *backend_; }
  // Sums values element-wise across the optimizer's ranks (single process: leaves them). Collective:
  // every rank calls it in the same order.
  virtual void sum_across_ranks(std::span<double> values);

 protected:
  // One parameter's state, each buffer `count` values in the backend's memory (allocated once).
  struct Slot {
    int index = 0;  // in the parameter list (registry order)
    ParamRef ref;
    OptimGroup group;
    Buffer momentum;     // Muon
    int muon_options = -1;  // Muon: its options, muon_options_[muon_options]
    Buffer variance;     // NorMuon: the whole matrix's v, one value a row (a column split: per block, block-major),
                         // where this rank holds a piece
    Buffer m, v;         // AdamW
    Buffer accumulated;  // sum of micro-batch gradients (accumulation_steps > 1)
  };

  // A Muon matrix this rank orthogonalizes: U (then O, in place) as a whole rows×cols matrix, and
  // the slot whose local slice [offset, offset+count) of it this rank applies (null: none here).
  struct MuonMatrix {
    Slot* slot = nullptr;
    const ParamSpec* spec = nullptr;
    Buffer full;      // (rows, cols), allocated once
    int options = 0;  // muon_options_[options]
    // Set by plan_muon: the blocks its Newton–Schulz runs on (muon_blocks; one: the whole matrix), a column split's
    // blocks gathered one after another (rows·cols values; empty for a row split or none), and the runs of the
    // flattened matrix that take one scale s(block)·extra_scale_factor, in order, adjacent equal ones merged.
    std::vector<MatrixBlock> blocks = {};
    Buffer gathered = {};
    struct ScaleRun {
      int64_t begin = 0, end = 0;  // [begin, end) of the flattened rows×cols matrix
      float scale = 0;
    };
    std::vector<ScaleRun> scale_runs = {};
  };
  // The Muon matrices this rank orthogonalizes, asked once (at the first update). Single process:
  // each Muon slot that holds its whole matrix. Distributed variants gather (or own) them.
  virtual std::vector<MuonMatrix> muon_matrices();
  // For this update: momentum on every local slice with gradient g·grad_scale, then every MuonMatrix's
  // U in its `full` buffer. Single process: momentum straight into `full`.
  virtual void prepare_muon_inputs(float grad_scale, std::span<MuonMatrix> matrices);
  // Where slot s's values and gradient are now (ref.count values each, in the backend's memory). Single
  // process: ref.values and ref.grad, which never move. The sharded optimizers ask ShardedParams, whose
  // buffers may move between steps.
  virtual float* values_of(const Slot& s) const;
  virtual const float* grad_of(const Slot& s) const;

  const float* effective_grad(const Slot& s) const;
  // Momentum of slot s with g·grad_scale, U into u (count values).
  void momentum_into(Slot& s, float grad_scale, float* u);
  std::vector<Slot>& slots() { return slots_; }
  int rank_ = 0;
  int world_size_ = 1;

 private:
  // Same-shape Muon matrices and blocks of split matrices of one Newton–Schulz setting, orthogonalized in one
  // Orthogonalizer call (DESIGN 2.6).
  struct ShapeBatch {
    int64_t rows = 0, cols = 0;
    int orth = 0;                    // orths_[orth]
    std::vector<MatView> views;      // each matrix's or block's U, contiguous (in full, or gathered)
    std::vector<std::string> names;  // for errors: "name", or "name:rows 0+64" for a block
    size_t first_norm = 0;           // its views' slots in ns_norms_
  };
  // Σ g² of every slot (device), read once; throws or skips on a non-finite gradient. Returns false to skip.
  bool gradient_norm(float mean_scale);
  void update_adamw(float grad_scale);
  // Momentum and U, a column split's blocks gathered, NS in batches of same-shape matrices and blocks of equal
  // Newton–Schulz settings, the blocks put back, one read of the NS input norms, NorMuon's normalization where asked
  // (per block), W ← W·(1 − lr·wd) − lr·s·O (s per block).
  void update_muon(float grad_scale);
  // muon_ and batches_, built at the first update.
  void plan_muon();

  OptimizerOptions options_;
  Backend* backend_;
  // The distinct options of the Muon matrices (the default first), and the Orthogonalizer of each: the one the
  // optimizer was given for options_.muon.ns, else ns_orthogonalizer of its ns.
  std::vector<MuonMatrixOptions> muon_options_;
  std::vector<Orthogonalizer> orths_;
  std::vector<Slot> slots_;
  std::vector<MuonMatrix> muon_;
  std::vector<ShapeBatch> batches_;
  bool muon_planned_ = false;
  // Device doubles, two float32 slots each: per-slot Σ g², per-Muon-matrix ‖U‖_F; and their host copies.
  Buffer grad_sums_, ns_norms_;
  std::vector<double> host_sums_, host_norms_;
  int micro_ = 0;
  int64_t updates_ = 0;
  int64_t skipped_ = 0;
  double last_grad_norm_ = 0;
  Stats stats_;
};

// Single-process Muon (matrices) + AdamW (the rest), Newton–Schulz from include/dmuon/ns.hpp with
// options.muon.ns (fixed at construction), or from `orth`.
class Muon : public Optimizer {
 public:
  Muon(std::vector<ParamRef> params, OptimizerOptions options);
  Muon(std::vector<ParamRef> params, OptimizerOptions options, Orthogonalizer orth, Backend& backend = cpu_backend());
};

// Per parameter of `params`: the blocks its Newton–Schulz runs on (muon_blocks with its OptimizerOptions::muon_rules
// rule's options, else options.muon's) for a Muon matrix (options.rules), none for the others: what make_plan_items
// costs split matrices by. Throws as muon_blocks for a split that does not fit.
std::vector<std::vector<MatrixBlock>> muon_blocks(const std::vector<ParamSpec>& params, const OptimizerOptions& options);

// `options` with a single rule that sends every parameter to AdamW.
OptimizerOptions all_adamw(OptimizerOptions options);

// AdamW for every parameter, whatever its role; shard-local, so ParamRefs may hold any slices.
class AdamW : public Optimizer {
 public:
  AdamW(std::vector<ParamRef> params, OptimizerOptions options, Backend& backend = cpu_backend());
};

}  // namespace dmuon
