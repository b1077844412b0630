// The optimizer step shared by every variant: micro-batch accumulation, the global gradient norm
// (clipping and the non-finite check, agreed across ranks), AdamW on elementwise parameters, and
// Muon on matrices (single process here; distributed variants override muon_inputs).
#include <chrono>
#include <cmath>
#include <map>
#include <set>

#include "dmuon/error.hpp"
#include "dmuon/optim.hpp"
#include "dmuon/rank_agreement.hpp"

namespace dmuon {

namespace {
OptimGroup assign_group(const std::vector<GroupRule>& rules, const ParamSpec& spec) {
  for (const GroupRule& rule : rules) {
    if (name_matches(rule.pattern, spec.name)) return rule.group;
  }
  return spec.role == ParamRole::matrix ? OptimGroup::muon : OptimGroup::adamw;
}

// Σ (g_i·scale)² in double; four partial sums break the add latency chain (the order differs from a
// plain loop by rounding in the last bits of a double, far below what float32 clipping can see).
double sum_of_squares(const float* g, int64_t n, float scale) {
  double acc[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int k = 0; k < 4; ++k) {
      const double x = static_cast<double>(g[i + k] * scale);
      acc[k] += x * x;
    }
  }
  for (; i < n; ++i) {
    const double x = static_cast<double>(g[i] * scale);
    acc[0] += x * x;
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}
}  // namespace

Optimizer::Optimizer(std::vector<ParamRef> params, OptimizerOptions options, Orthogonalizer orth)
    : options_(std::move(options)), orth_(std::move(orth)) {
  DMUON_CHECK(options_.accumulation_steps >= 1, "accumulation_steps must be ≥ 1, got ", options_.accumulation_steps);
  DMUON_CHECK(options_.clip_grad_norm >= 0, "clip_grad_norm must be ≥ 0 (0: off), got ", options_.clip_grad_norm);
  const MuonHyper& mu = options_.muon;
  const AdamWHyper& ad = options_.adamw;
  DMUON_CHECK(mu.momentum >= 0 && mu.momentum < 1, "Muon momentum must be in [0, 1), got ", mu.momentum);
  DMUON_CHECK(ad.beta1 >= 0 && ad.beta1 < 1 && ad.beta2 >= 0 && ad.beta2 < 1, "AdamW betas must be in [0, 1), got (",
              ad.beta1, ", ", ad.beta2, ")");
  DMUON_CHECK(ad.eps > 0, "AdamW eps must be > 0, got ", ad.eps);
  std::set<std::string> names;
  for (ParamRef& p : params) {
    const int64_t numel = p.spec.numel();
    if (p.count < 0) p.count = numel;
    DMUON_CHECK(names.insert(p.spec.name).second, "parameter '", p.spec.name, "' is registered twice");
    DMUON_CHECK(p.offset >= 0 && p.offset + p.count <= numel, "parameter '", p.spec.name, "': local slice [",
                p.offset, ", ", p.offset + p.count, ") lies outside its ", numel, " elements");
    Slot s{p, assign_group(options_.rules, p.spec), {}, {}, {}, {}};
    if (s.group == OptimGroup::muon) {
      DMUON_CHECK(p.spec.shape.size() >= 2, "parameter '", p.spec.name, "' has ", p.spec.shape.size(),
                  " dimension(s); Muon needs a matrix (move it to AdamW with a GroupRule)");
      DMUON_CHECK(orth_, "parameter '", p.spec.name, "' is in the Muon group but the optimizer has no Orthogonalizer");
      s.momentum.assign(p.count, 0.0f);
    } else {
      s.m.assign(p.count, 0.0f);
      s.v.assign(p.count, 0.0f);
    }
    if (options_.accumulation_steps > 1) s.accumulated.assign(p.count, 0.0f);
    slots_.push_back(std::move(s));
  }
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
  return options_.accumulation_steps > 1 ? s.accumulated.data() : s.ref.grad;
}

OptimizerOptions all_adamw(OptimizerOptions options) {
  options.rules = {{"*", OptimGroup::adamw}};
  return options;
}

AdamW::AdamW(std::vector<ParamRef> params, OptimizerOptions options)
    : Optimizer(std::move(params), all_adamw(std::move(options)), Orthogonalizer{}) {}

void Optimizer::sum_across_ranks(std::span<double>) {}

void Optimizer::refresh_views(bool) {}

bool Optimizer::step() {
  refresh_views(true);
  for (const Slot& s : slots_) {
    DMUON_CHECK(s.ref.count == 0 || (s.ref.values && s.ref.grad), "parameter '", s.ref.spec.name, "' on rank ", rank_,
                " has no values or gradient buffer");
  }
  const int k = options_.accumulation_steps;
  ++micro_;
  if (k > 1) {
    for (Slot& s : slots_) {
      for (int64_t i = 0; i < s.ref.count; ++i) s.accumulated[i] = (micro_ == 1 ? 0.0f : s.accumulated[i]) + s.ref.grad[i];
    }
    if (micro_ < k) return false;
  }
  micro_ = 0;
  const float mean_scale = 1.0f / static_cast<float>(k);

  // totals = {Σ g², parameters with a non-finite gradient}, summed over ranks so all decide alike.
  double totals[2] = {0, 0};
  const std::string* bad = nullptr;
  for (const Slot& s : slots_) {
    const double sq = sum_of_squares(effective_grad(s), s.ref.count, mean_scale);
    if (!std::isfinite(sq)) {
      totals[1] += 1;
      if (!bad) bad = &s.ref.spec.name;
    } else {
      totals[0] += sq;
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

void Optimizer::update_adamw(float grad_scale) {
  for (Slot& s : slots_) {
    if (s.group != OptimGroup::adamw || s.ref.count == 0) continue;
    const size_t n = s.ref.count;
    adamw_step({s.ref.values, n}, {effective_grad(s), n}, grad_scale, s.m, s.v, updates_, options_.adamw);
  }
}

std::vector<Optimizer::MuonMatrix> Optimizer::muon_inputs(float grad_scale) {
  std::vector<MuonMatrix> out;
  for (Slot& s : slots_) {
    if (s.group != OptimGroup::muon || s.ref.count == 0) continue;
    const int64_t n = s.ref.spec.numel();
    DMUON_CHECK(s.ref.count == n, "parameter '", s.ref.spec.name, "' holds ", s.ref.count, " of ", n,
                " elements on rank ", rank_, "; this optimizer needs whole Muon matrices");
    MuonMatrix m{&s, &s.ref.spec, std::vector<float>(n)};
    muon_momentum({effective_grad(s), size_t(n)}, grad_scale, s.momentum, m.full, options_.muon);
    out.push_back(std::move(m));
  }
  return out;
}

void Optimizer::update_muon(float grad_scale) {
  std::vector<MuonMatrix> matrices = muon_inputs(grad_scale);
  stats_ = {};
  std::map<std::pair<int64_t, int64_t>, std::vector<MuonMatrix*>> by_shape;
  for (MuonMatrix& m : matrices) by_shape[{m.spec->rows(), m.spec->cols()}].push_back(&m);
  for (auto& [shape, batch] : by_shape) {
    const auto [rows, cols] = shape;
    std::vector<float*> io;
    std::vector<std::string> names;
    for (MuonMatrix* m : batch) {
      io.push_back(m->full.data());
      names.push_back(m->spec->name);
    }
    const auto t0 = std::chrono::steady_clock::now();
    orth_(std::vector<const float*>(io.begin(), io.end()), io, rows, cols, names);
    stats_.ns_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    stats_.ns_matrices += static_cast<int64_t>(batch.size());
    const double scale = muon_scale(rows, cols, options_.muon.scale);
    for (MuonMatrix* m : batch) {
      if (!m->slot) continue;
      const ParamRef& r = m->slot->ref;
      muon_apply({r.values, size_t(r.count)}, {m->full.data() + r.offset, size_t(r.count)}, options_.muon, scale);
    }
  }
}

std::vector<StateSlice> Optimizer::state_slices() {
  refresh_views(false);
  std::vector<StateSlice> out;
  for (Slot& s : slots_) {
    const ParamRef& r = s.ref;
    out.push_back({r.spec.name, "param", r.spec.shape, r.offset, r.values, r.count});
    if (s.group == OptimGroup::muon) {
      out.push_back({r.spec.name, "muon.momentum", r.spec.shape, r.offset, s.momentum.data(), r.count});
    } else {
      out.push_back({r.spec.name, "adamw.m", r.spec.shape, r.offset, s.m.data(), r.count});
      out.push_back({r.spec.name, "adamw.v", r.spec.shape, r.offset, s.v.data(), r.count});
    }
  }
  return out;
}

}  // namespace dmuon
