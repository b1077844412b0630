// The optimizer step shared by every variant: micro-batch accumulation, the global gradient norm
// (clipping and the non-finite check, agreed across ranks), AdamW on elementwise parameters, and
// Muon on matrices (single process here; distributed variants override muon_matrices and
// prepare_muon_inputs). Every loop over values is a backend kernel; the host reads two small arrays
// per update and allocates nothing after the first.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <set>
#include <tuple>

#include "dmuon/error.hpp"
#include "dmuon/optim.hpp"
#include "dmuon/rank_agreement.hpp"
#include "dmuon/update_rules.hpp"

namespace dmuon {

namespace {
// The columns of NorMuon's v (block-major: column b's rows contiguous): one per block of a matrix split by columns,
// whose blocks each normalize with a v of their own per row; one for a matrix split by rows, or not split.
int64_t variance_width(const std::vector<MatrixBlock>& blocks, const MuonMatrixOptions& o) {
  return o.split_dim == 1 && blocks.size() > 1 ? static_cast<int64_t>(blocks.size()) : 1;
}

OptimGroup assign_group(const std::vector<GroupRule>& rules, const ParamSpec& spec) {
  for (const GroupRule& rule : rules) {
    if (name_matches(rule.pattern, spec.name)) return rule.group;
  }
  return spec.role == ParamRole::matrix ? OptimGroup::muon : OptimGroup::adamw;
}

// Muon matrix options the optimizer can run, checked once where the optimizer registers them.
void check_muon_options(const MuonMatrixOptions& o, const std::string& where) {
  DMUON_CHECK(o.ns.steps >= 1, where, ": ns steps must be ≥ 1, got ", o.ns.steps);
  DMUON_CHECK(std::isfinite(o.extra_scale_factor) && o.extra_scale_factor > 0, where,
              ": extra_scale_factor must be finite and > 0, got ", o.extra_scale_factor);
  DMUON_CHECK(o.normuon_beta2 >= 0 && o.normuon_beta2 < 1, where, ": normuon_beta2 must be in [0, 1), got ",
              o.normuon_beta2);
  DMUON_CHECK(o.split_heads >= 0, where, ": split_heads must be ≥ 1 (0: no split), got ", o.split_heads);
  DMUON_CHECK(o.split_heads == 0 || o.split_sizes.empty(), where,
              ": split_heads and split_sizes are two ways of one split: set one");
  DMUON_CHECK(o.split_sizes.empty() || o.split_sizes.size() >= 2, where, ": split_sizes needs two or more lengths");
  for (int64_t size : o.split_sizes) DMUON_CHECK(size >= 1, where, ": split_sizes must be ≥ 1, got ", size);
  DMUON_CHECK(o.split_dim == 0 || o.split_dim == 1, where, ": split_dim must be 0 (rows) or 1 (columns), got ",
              o.split_dim);
}

// The options of a Muon matrix: its first matching rule's, else the defaults.
const MuonMatrixOptions& options_for(const OptimizerOptions& o, const std::string& name) {
  for (const MuonRule& rule : o.muon_rules) {
    if (name_matches(rule.pattern, name)) return rule.options;
  }
  return o.muon;
}

// A zeroed state buffer of n float32 values.
Buffer zeros(Backend& backend, int64_t n) {
  Buffer b(backend, DType::f32, n);
  if (n > 0) backend.fill(b.view(1, n), 0.0f);
  return b;
}

// n doubles in backend memory, as 2n float32 slots (Buffer holds float types only).
Buffer doubles(Backend& backend, size_t n) { return Buffer(backend, DType::f32, static_cast<int64_t>(2 * n)); }
double* as_doubles(const Buffer& b) { return reinterpret_cast<double*>(b.data()); }
}  // namespace

Optimizer::Optimizer(std::vector<ParamRef> params, OptimizerOptions options, Orthogonalizer orth, Backend& backend)
    : options_(std::move(options)), backend_(&backend) {
  DMUON_CHECK(options_.accumulation_steps >= 1, "accumulation_steps must be ≥ 1, got ", options_.accumulation_steps);
  DMUON_CHECK(options_.clip_grad_norm >= 0, "clip_grad_norm must be ≥ 0 (0: off), got ", options_.clip_grad_norm);
  const MuonHyper& mu = options_.muon;
  const AdamWHyper& ad = options_.adamw;
  DMUON_CHECK(mu.momentum >= 0 && mu.momentum < 1, "Muon momentum must be in [0, 1), got ", mu.momentum);
  DMUON_CHECK(ad.beta1 >= 0 && ad.beta1 < 1 && ad.beta2 >= 0 && ad.beta2 < 1, "AdamW betas must be in [0, 1), got (",
              ad.beta1, ", ", ad.beta2, ")");
  DMUON_CHECK(ad.eps > 0, "AdamW eps must be > 0, got ", ad.eps);
  check_muon_options(mu, "OptimizerOptions.muon");
  muon_options_ = {mu};
  orths_.push_back(std::move(orth));
  std::vector<bool> rule_used(options_.muon_rules.size(), false);
  std::set<std::string> names;
  for (ParamRef& p : params) {
    const int64_t numel = p.spec.numel();
    if (p.count < 0) p.count = numel;
    DMUON_CHECK(names.insert(p.spec.name).second, "parameter '", p.spec.name, "' is registered twice");
    DMUON_CHECK(p.offset >= 0 && p.offset + p.count <= numel, "parameter '", p.spec.name, "': local slice [",
                p.offset, ", ", p.offset + p.count, ") lies outside its ", numel, " elements");
    Slot s;
    s.index = static_cast<int>(slots_.size());
    s.ref = p;
    s.group = assign_group(options_.rules, p.spec);
    if (s.group == OptimGroup::muon) {
      DMUON_CHECK(p.spec.shape.size() >= 2, "parameter '", p.spec.name, "' has ", p.spec.shape.size(),
                  " dimension(s); Muon needs a matrix (move it to AdamW with a GroupRule)");
      DMUON_CHECK(orths_[0], "parameter '", p.spec.name,
                  "' is in the Muon group but the optimizer has no Orthogonalizer");
      s.momentum = zeros(backend, p.count);
      const MuonMatrixOptions& mo = options_for(options_, p.spec.name);
      for (size_t r = 0; r < options_.muon_rules.size(); ++r)
        if (&mo == &options_.muon_rules[r].options) rule_used[r] = true;
      const auto known = std::find(muon_options_.begin(), muon_options_.end(), mo);
      s.muon_options = static_cast<int>(known - muon_options_.begin());
      if (known == muon_options_.end()) {
        check_muon_options(mo, "parameter '" + p.spec.name + "'");
        muon_options_.push_back(mo);
        orths_.push_back(mo.ns == mu.ns ? orths_[0] : ns_orthogonalizer(mo.ns));
      }
      // a split that does not fit: refused here
      const int64_t width = variance_width(muon_blocks(p.spec.rows(), p.spec.cols(), mo, p.spec.name), mo);
      // The whole matrix's rows wherever a piece of it is: the normalization needs every row's moment.
      if (mo.variant == MuonVariant::normuon && p.count > 0) s.variance = zeros(backend, width * p.spec.rows());
    } else {
      s.m = zeros(backend, p.count);
      s.v = zeros(backend, p.count);
    }
    if (options_.accumulation_steps > 1) s.accumulated = zeros(backend, p.count);
    slots_.push_back(std::move(s));
  }
  for (size_t r = 0; r < rule_used.size(); ++r) {
    DMUON_CHECK(rule_used[r], "Muon rule '", options_.muon_rules[r].pattern,
                "' matches no Muon matrix (an earlier rule may take its matrices, or the pattern is misspelt)");
  }
  grad_sums_ = doubles(backend, slots_.size());
  host_sums_.resize(slots_.size());
}

const MuonMatrixOptions& Optimizer::muon_options_of(const std::string& name) const {
  for (const Slot& s : slots_) {
    if (s.ref.spec.name == name && s.group == OptimGroup::muon) return muon_options_[s.muon_options];
  }
  DMUON_FAIL("no Muon matrix named '", name, "' is registered with the optimizer");
}

OptimGroup Optimizer::group_of(const std::string& name) const {
  for (const Slot& s : slots_) {
    if (s.ref.spec.name == name) return s.group;
  }
  DMUON_FAIL("no parameter named '", name, "' is registered with the optimizer");
}

void Optimizer::set_lr(double muon_lr, double adamw_lr) {
  DMUON_CHECK(muon_lr >= 0 && adamw_lr >= 0, "learning rates must be ≥ 0, got ", muon_lr, " and ", adamw_lr);
  options_.muon.lr = muon_lr;
  options_.adamw.lr = adamw_lr;
}

void Optimizer::set_counters(int64_t updates, int64_t skipped) {
  DMUON_CHECK(updates >= 0 && skipped >= 0, "optimizer counters must be ≥ 0, got ", updates, " and ", skipped);
  updates_ = updates;
  skipped_ = skipped;
  micro_ = 0;
}

const float* Optimizer::effective_grad(const Slot& s) const {
  return options_.accumulation_steps > 1 ? s.accumulated.f32() : grad_of(s);
}

std::vector<std::vector<MatrixBlock>> muon_blocks(const std::vector<ParamSpec>& params, const OptimizerOptions& options) {
  std::vector<std::vector<MatrixBlock>> out(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& p = params[i];
    if (assign_group(options.rules, p) == OptimGroup::muon) out[i] = muon_blocks(p.rows(), p.cols(), options_for(options, p.name), p.name);
  }
  return out;
}

OptimizerOptions all_adamw(OptimizerOptions options) {
  options.rules = {{"*", OptimGroup::adamw}};
  return options;
}

AdamW::AdamW(std::vector<ParamRef> params, OptimizerOptions options, Backend& backend)
    : Optimizer(std::move(params), all_adamw(std::move(options)), Orthogonalizer{}, backend) {}

void Optimizer::sum_across_ranks(std::span<double>) {}
float* Optimizer::values_of(const Slot& s) const { return s.ref.values; }
const float* Optimizer::grad_of(const Slot& s) const { return s.ref.grad; }

bool Optimizer::step() {
  for (const Slot& s : slots_) {
    DMUON_CHECK(s.ref.count == 0 || (values_of(s) && grad_of(s)), "parameter '", s.ref.spec.name, "' on rank ",
                rank_, " has no values or gradient buffer");
  }
  const int k = options_.accumulation_steps;
  ++micro_;
  if (k > 1) {
    for (Slot& s : slots_) {
      const int64_t n = s.ref.count;
      backend_->run({rules::Accumulate{.acc = DeviceSpan(*backend_, s.accumulated.f32(), n),
                                       .grad = DeviceSpan(*backend_, grad_of(s), n),
                                       .first = micro_ == 1}});
    }
    if (micro_ < k) return false;
  }
  micro_ = 0;
  const float mean_scale = 1.0f / static_cast<float>(k);
  if (!gradient_norm(mean_scale)) return false;
  float scale = mean_scale;
  if (options_.clip_grad_norm > 0 && last_grad_norm_ > options_.clip_grad_norm) {
    // As torch.nn.utils.clip_grad_norm_: multiply by max_norm / (norm + 1e-6).
    scale = static_cast<float>(mean_scale * (options_.clip_grad_norm / (last_grad_norm_ + 1e-6)));
  }
  ++updates_;
  update_adamw(scale);
  update_muon(scale);
  return true;
}

bool Optimizer::gradient_norm(float mean_scale) {
  double* sums = as_doubles(grad_sums_);
  for (size_t i = 0; i < slots_.size(); ++i) {
    backend_->run({rules::SumOfSquares{.grad = DeviceSpan(*backend_, effective_grad(slots_[i]), slots_[i].ref.count),
                                       .grad_scale = mean_scale,
                                       .sum = sums + i}});
  }
  backend_->copy_to_host(host_sums_.data(), sums, host_sums_.size() * sizeof(double));
  // totals = {Σ g², parameters with a non-finite gradient}, summed over ranks so all decide alike.
  double totals[2] = {0, 0};
  const std::string* bad = nullptr;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (!std::isfinite(host_sums_[i])) {
      totals[1] += 1;
      if (!bad) bad = &slots_[i].ref.spec.name;
    } else {
      totals[0] += host_sums_[i];
    }
  }
  sum_across_ranks(totals);
  if (totals[1] > 0) {
    if (options_.nonfinite == NonFinitePolicy::skip) {
      ++skipped_;
      return false;
    }
    const std::exception_ptr mine = comm::capture_failure(
        [&] {
          DMUON_CHECK(!bad, "non-finite gradient in parameter '", bad ? *bad : "", "' on rank ", rank_, " at update ",
                      updates_ + 1);
        },
        "the non-finite gradient check");
    comm::throw_if_any_failed(mine, totals[1], rank_,
                              "non-finite gradient on another rank at update " + std::to_string(updates_ + 1) +
                                  " (that rank's error names the parameter)");
  }
  last_grad_norm_ = std::sqrt(totals[0]);
  return true;
}

void Optimizer::update_adamw(float grad_scale) {
  const AdamWStepConstants k = adamw_step_constants(options_.adamw, updates_);
  for (Slot& s : slots_) {
    if (s.group != OptimGroup::adamw || s.ref.count == 0) continue;
    const int64_t n = s.ref.count;
    backend_->run({rules::AdamWStep{.p = DeviceSpan(*backend_, values_of(s), n),
                                    .grad = DeviceSpan(*backend_, effective_grad(s), n),
                                    .m = DeviceSpan(*backend_, s.m.f32(), n),
                                    .v = DeviceSpan(*backend_, s.v.f32(), n),
                                    .k = k,
                                    .grad_scale = grad_scale}});
  }
}

void Optimizer::momentum_into(Slot& s, float grad_scale, float* u) {
  const MuonHyper& mu = options_.muon;
  const int64_t n = s.ref.count;
  backend_->run({rules::MuonMomentum{.grad = DeviceSpan(*backend_, effective_grad(s), n),
                                     .momentum = DeviceSpan(*backend_, s.momentum.f32(), n),
                                     .u = DeviceSpan(*backend_, u, n),
                                     .one_minus_beta = static_cast<float>(1.0 - mu.momentum),
                                     .beta = static_cast<float>(mu.momentum),
                                     .nesterov = mu.nesterov,
                                     .grad_scale = grad_scale}});
}

std::vector<Optimizer::MuonMatrix> Optimizer::muon_matrices() {
  std::vector<MuonMatrix> out;
  for (Slot& s : slots_) {
    if (s.group != OptimGroup::muon || s.ref.count == 0) continue;
    const int64_t n = s.ref.spec.numel();
    DMUON_CHECK(s.ref.count == n, "parameter '", s.ref.spec.name, "' holds ", s.ref.count, " of ", n,
                " elements on rank ", rank_, "; this optimizer needs whole Muon matrices");
    out.push_back({&s, &s.ref.spec, Buffer(*backend_, DType::f32, n), s.muon_options});
  }
  return out;
}

void Optimizer::prepare_muon_inputs(float grad_scale, std::span<MuonMatrix> matrices) {
  for (MuonMatrix& m : matrices) momentum_into(*m.slot, grad_scale, m.full.f32());
}

void Optimizer::plan_muon() {
  muon_ = muon_matrices();
  // One Orthogonalizer per Newton–Schulz setting: options that differ elsewhere (scale, split, ...) share it.
  std::vector<int> orth_of(muon_options_.size());
  for (size_t i = 0; i < muon_options_.size(); ++i) {
    orth_of[i] = static_cast<int>(i);
    for (size_t j = 0; j < i; ++j) {
      if (muon_options_[j].ns == muon_options_[i].ns) {
        orth_of[i] = static_cast<int>(j);
        break;
      }
    }
  }
  std::map<std::tuple<int64_t, int64_t, int>, ShapeBatch> by_shape;
  for (MuonMatrix& m : muon_) {
    const MuonMatrixOptions& mo = muon_options_[m.options];
    const int64_t rows = m.spec->rows(), cols = m.spec->cols();
    m.blocks = muon_blocks(rows, cols, mo, m.spec->name);
    const bool split = m.blocks.size() > 1;
    const bool by_columns = split && mo.split_dim == 1;
    if (by_columns) m.gathered = Buffer(*backend_, DType::f32, rows * cols);
    int64_t gathered_at = 0;
    for (const MatrixBlock& blk : m.blocks) {
      ShapeBatch& b = by_shape[{blk.rows, blk.cols, orth_of[m.options]}];
      b.rows = blk.rows, b.cols = blk.cols, b.orth = orth_of[m.options];
      // (blk.rows, blk.cols): a row block is contiguous in full; a column block is gathered contiguous.
      float* u = by_columns ? m.gathered.f32() + gathered_at : m.full.f32() + blk.row0 * cols;
      gathered_at += blk.rows * blk.cols;
      b.views.push_back(f32_view(backend_->device(), u, blk.rows, blk.cols));
      b.names.push_back(!split ? m.spec->name
                               : m.spec->name + (by_columns ? ":cols " + std::to_string(blk.col0)
                                                            : ":rows " + std::to_string(blk.row0)) +
                                     "+" + std::to_string(by_columns ? blk.cols : blk.rows));
      // The block's elements of the flattened matrix, as runs of one scale: a row block is one run, a column
      // block one run per row; adjacent runs of equal scale merge (a split into equal blocks: one run).
      const float scale = static_cast<float>(muon_scale(blk.rows, blk.cols, mo.scale) * mo.extra_scale_factor);
      for (int64_t r = blk.row0; r < blk.row0 + blk.rows; r += by_columns ? 1 : blk.rows) {
        const int64_t begin = r * cols + blk.col0;
        const int64_t end = by_columns ? begin + blk.cols : (blk.row0 + blk.rows) * cols;
        m.scale_runs.push_back({begin, end, scale});
      }
    }
    std::sort(m.scale_runs.begin(), m.scale_runs.end(),
              [](const MuonMatrix::ScaleRun& a, const MuonMatrix::ScaleRun& b) { return a.begin < b.begin; });
    std::vector<MuonMatrix::ScaleRun> merged;
    for (const MuonMatrix::ScaleRun& run : m.scale_runs) {
      if (!merged.empty() && merged.back().end == run.begin && merged.back().scale == run.scale) {
        merged.back().end = run.end;
      } else {
        merged.push_back(run);
      }
    }
    m.scale_runs = std::move(merged);
  }
  size_t at = 0;
  for (auto& [shape, batch] : by_shape) {
    batch.first_norm = at;
    at += batch.views.size();
    batches_.push_back(std::move(batch));
  }
  ns_norms_ = doubles(*backend_, at);
  host_norms_.resize(at);
  muon_planned_ = true;
}

namespace {
// A column block [0, rows) × [col0, col0+cols) of a row-major matrix with `ld` columns, as a strided view.
MatView column_block(Backend& backend, float* matrix, int64_t ld, const MatrixBlock& blk) {
  MatView v = f32_view(backend.device(), matrix + blk.col0, blk.rows, blk.cols);
  v.ld = ld;
  return v;
}
}  // namespace

void Optimizer::update_muon(float grad_scale) {
  if (!muon_planned_) plan_muon();
  prepare_muon_inputs(grad_scale, muon_);
  stats_ = {};
  // A column split's blocks, one after another in `gathered` (each contiguous for the Newton–Schulz).
  const auto move_column_blocks = [&](bool gather) {
    for (MuonMatrix& m : muon_) {
      if (m.gathered.size() == 0) continue;
      const int64_t cols = m.spec->cols();
      int64_t at = 0;
      for (const MatrixBlock& blk : m.blocks) {
        const MatView in_full = column_block(*backend_, m.full.f32(), cols, blk);
        const MatView in_gathered = f32_view(backend_->device(), m.gathered.f32() + at, blk.rows, blk.cols);
        backend_->convert(gather ? in_full : in_gathered, gather ? in_gathered : in_full);
        at += blk.rows * blk.cols;
      }
    }
  };
  const auto normalize = [&](DeviceSpan<float> o, DeviceSpan<float> v, int64_t rows, int64_t cols,
                             const MuonMatrixOptions& mo) {
    backend_->run({rules::NorMuonNormalize{
        .o = o, .v = v, .rows = rows, .cols = cols, .one_minus_beta2 = static_cast<float>(1.0 - mo.normuon_beta2)}});
  };
  // NorMuon's normalization of a matrix split by columns: each block, gathered contiguous, with its own v (block b's
  // rows at b·rows); a matrix split by rows, or not split, is normalized after the blocks are back (below).
  const auto normalize_column_blocks = [&] {
    for (MuonMatrix& m : muon_) {
      const MuonMatrixOptions& mo = muon_options_[m.options];
      if (m.gathered.size() == 0 || !m.slot || mo.variant != MuonVariant::normuon) continue;
      const int64_t rows = m.spec->rows();
      int64_t at = 0;
      for (size_t b = 0; b < m.blocks.size(); ++b) {
        const MatrixBlock& blk = m.blocks[b];
        normalize(DeviceSpan(*backend_, m.gathered.f32() + at, blk.rows * blk.cols),
                  DeviceSpan(*backend_, m.slot->variance.f32() + static_cast<int64_t>(b) * rows, blk.rows), blk.rows,
                  blk.cols, mo);
        at += blk.rows * blk.cols;
      }
    }
  };
  double* norms = as_doubles(ns_norms_);
  const auto t0 = std::chrono::steady_clock::now();
  move_column_blocks(true);
  for (const ShapeBatch& b : batches_) orths_[b.orth](*backend_, b.views, b.views, b.names, norms + b.first_norm);
  normalize_column_blocks();
  move_column_blocks(false);
  stats_.ns_matrices = static_cast<int64_t>(muon_.size());
  // One read per update: the NS input norms (which also waits for the NS to finish on a device).
  backend_->copy_to_host(host_norms_.data(), norms, host_norms_.size() * sizeof(double));
  stats_.ns_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const ShapeBatch& b : batches_) {
    for (size_t i = 0; i < b.views.size(); ++i) {
      DMUON_CHECK(std::isfinite(host_norms_[b.first_norm + i]), "Newton-Schulz input '", b.names[i],
                  "' (the Muon update of a finite gradient) is not finite on rank ", rank_, " at update ", updates_);
    }
  }
  const MuonHyper& mu = options_.muon;
  const float decay = static_cast<float>(1.0 - mu.lr * mu.weight_decay), neg_lr = static_cast<float>(-mu.lr);
  for (MuonMatrix& m : muon_) {
    if (!m.slot) continue;
    const MuonMatrixOptions& mo = muon_options_[m.options];
    const int64_t cols = m.spec->cols();
    if (mo.variant == MuonVariant::normuon && m.gathered.size() == 0) {  // per row block, on the whole O (a
      Buffer& v = m.slot->variance;                                       // rank's apply reads its piece of it)
      for (const MatrixBlock& blk : m.blocks) {
        normalize(DeviceSpan(*backend_, m.full.f32() + blk.row0 * cols, blk.rows * cols),
                  DeviceSpan(*backend_, v.f32() + blk.row0, blk.rows), blk.rows, cols, mo);
      }
    }
    // This rank's slice [offset, offset+count) of each run.
    const ParamRef& r = m.slot->ref;
    float* w = values_of(*m.slot);
    for (const MuonMatrix::ScaleRun& run : m.scale_runs) {
      const int64_t begin = std::max(run.begin, r.offset), end = std::min(run.end, r.offset + r.count);
      if (begin >= end) continue;
      backend_->run({rules::MuonApply{.w = DeviceSpan(*backend_, w + (begin - r.offset), end - begin),
                                      .o = DeviceSpan(*backend_, m.full.f32() + begin, end - begin),
                                      .decay = decay,
                                      .neg_lr = neg_lr,
                                      .scale = run.scale,
                                      .cautious_wd = mo.cautious_wd}});
    }
  }
}

std::vector<StateSlice> Optimizer::state_slices() {
  std::vector<StateSlice> out;
  for (Slot& s : slots_) {
    const ParamRef& r = s.ref;
    out.push_back({r.spec.name, "param", r.spec.shape, r.offset, values_of(s), r.count});
    if (s.group == OptimGroup::muon) {
      out.push_back({r.spec.name, "muon.momentum", r.spec.shape, r.offset, s.momentum.f32(), r.count});
      if (muon_options_[s.muon_options].variant == MuonVariant::normuon) {  // whole, or none where no piece is held
        const int64_t width = variance_width(
            muon_blocks(r.spec.rows(), r.spec.cols(), muon_options_[s.muon_options], r.spec.name),
            muon_options_[s.muon_options]);
        const std::vector<int64_t> shape =
            width == 1 ? std::vector<int64_t>{r.spec.rows()} : std::vector<int64_t>{width, r.spec.rows()};
        out.push_back({r.spec.name, "normuon.v", shape, 0, s.variance.f32(), s.variance.size()});
      }
    } else {
      out.push_back({r.spec.name, "adamw.m", r.spec.shape, r.offset, s.m.f32(), r.count});
      out.push_back({r.spec.name, "adamw.v", r.spec.shape, r.offset, s.v.f32(), r.count});
    }
  }
  return out;
}

}  // namespace dmuon
