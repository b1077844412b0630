// The update rules of DESIGN 1 as values: one struct per rule, holding its views (DeviceSpans of one size n, on
// the backend that runs it: float32 values; a row-shaped rule's differ, checked by its own checked_size) and its
// constants, and UpdateRule, the one operation
// Backend::run takes. Each rule rounds as PyTorch does in float32 (torch.optim.AdamW's single-tensor path,
// KellerJordan/Muon's lerp_ calls), identically on every backend; g = grad·grad_scale throughout.
//
// A rule also tells generic code what it touches, so that the recorder and the test device's fence handle every
// rule through one path: views() (its DeviceSpans, a tuple; a DeviceSpan<float> is written, a DeviceSpan<const
// float> only read) and, where it has any, scalars() (single values in device memory it reads or writes).
// Adding a rule: its struct here and in UpdateRule's variant, and its room in src/backend/rules/
// (docs/ARCHITECTURE.md, "Backends: where a device plugs in").
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <tuple>
#include <variant>

#include "dmuon/device_span.hpp"
#include "dmuon/error.hpp"

namespace dmuon {

// AdamW's per-step constants, derived once per update on the host (torch.optim.AdamW's rounding).
struct AdamWStepConstants {
  float decay;         // 1 − lr·wd
  float one_minus_b1;  // 1 − β1
  float b2;            // β2
  float one_minus_b2;  // 1 − β2
  float step_size;     // lr / (1 − β1^t)
  float bias2_sqrt;    // sqrt(1 − β2^t)
  float eps;
};

namespace rules {

// One value in a backend's memory that a rule reads or writes (null: none).
struct DeviceScalar {
  const void* data;
  size_t bytes;
};

// *sum = Σ (g·scale)² in double, on the device; not finite when a value is not.
struct SumOfSquares {
  static constexpr const char* name = "sum_of_squares";
  DeviceSpan<const float> grad{};
  float grad_scale = 1;
  double* sum = nullptr;  // one double on the device

  auto views() const { return std::tuple{grad}; }
  std::array<DeviceScalar, 1> scalars() const { return {{{sum, sizeof(double)}}}; }
};

// acc ← (first ? 0 : acc) + grad (micro-batch accumulation).
struct Accumulate {
  static constexpr const char* name = "accumulate";
  DeviceSpan<float> acc{};
  DeviceSpan<const float> grad{};
  bool first = false;

  auto views() const { return std::tuple{acc, grad}; }
};

// torch.optim.AdamW's single-tensor step: p ← p·decay; m.lerp_(g, 1−β1); v ← β2·v + (1−β2)·g²;
// p ← p − step_size·m / (sqrt(v)/bias2_sqrt + eps).
struct AdamWStep {
  static constexpr const char* name = "adamw_step";
  DeviceSpan<float> p{};
  DeviceSpan<const float> grad{};
  DeviceSpan<float> m{}, v{};
  AdamWStepConstants k{};
  float grad_scale = 1;

  auto views() const { return std::tuple{p, grad, m, v}; }
};

// M ← lerp(M, g, 1−β); U ← nesterov ? lerp(g, M, β) : M. 1−β and β come rounded from double separately (as
// torch's lerp_ weights are), so both are given. u may alias grad (g is read before u is written).
struct MuonMomentum {
  static constexpr const char* name = "muon_momentum";
  DeviceSpan<const float> grad{};  // may be empty (no data, size 0): a zero gradient of momentum's size
  DeviceSpan<float> momentum{}, u{};
  float one_minus_beta = 0, beta = 0;
  bool nesterov = false;
  float grad_scale = 1;
  const float* device_grad_scale = nullptr;  // one float32 on the device; when set, replaces grad_scale
  // One float32 on the device; *keep == 0 leaves M as it is, bit for bit, and sets U = M (the step leaves the
  // tensor out: a non-finite gradient is never read).
  const float* keep = nullptr;

  auto views() const { return std::tuple{grad, momentum, u}; }
  std::array<DeviceScalar, 2> scalars() const {
    return {{{device_grad_scale, sizeof(float)}, {keep, sizeof(float)}}};
  }
};

// W ← W·decay + neg_lr·(O·scale); with cautious_wd the decay only where W·O ≥ 0 (update and weight agree in sign,
// arXiv 2510.12402, as microsoft/dion's muon.py masks it), W as it is elsewhere.
struct MuonApply {
  static constexpr const char* name = "muon_apply";
  DeviceSpan<float> w{};
  DeviceSpan<const float> o{};
  float decay = 1, neg_lr = 0, scale = 1;
  const float* keep = nullptr;  // one float32 on the device; *keep == 0 leaves w as it is, bit for bit
  bool cautious_wd = false;

  auto views() const { return std::tuple{w, o}; }
  std::array<DeviceScalar, 1> scalars() const { return {{{keep, sizeof(float)}}}; }
};

// NorMuon's normalization (arXiv 2510.05491, algorithm 1; microsoft/dion's normuon.py) of one orthogonalized
// rows×cols matrix O (row-major, in place) with its per-row (neuron) second moment v (rows values):
//   v_r ← lerp(v_r, mean_j O_rj², 1−β2);  Ô_rj = O_rj / (√v_r + 1e-8);  O ← Ô·(‖O‖_F / max(‖Ô‖_F, 1e-8))
// The row sums and both norms in double, v and O in float32 (src/backend/rules/normuon_normalize.hpp).
// A row-shaped rule: its two views differ in size (o: rows·cols, v: rows).
struct NorMuonNormalize {
  static constexpr const char* name = "normuon_normalize";
  DeviceSpan<float> o{}, v{};
  int64_t rows = 0, cols = 0;
  float one_minus_beta2 = 0;  // 1 − β2, rounded from double as torch's lerp weight is

  auto views() const { return std::tuple{o, v}; }
};

// n, the one size of a rule's views; throws naming the rule when two differ.
template <class Rule>
int64_t checked_size(const Rule& rule) {
  const auto sizes = std::apply(
      [](const auto&... view) { return std::array<size_t, sizeof...(view)>{view.size()...}; }, rule.views());
  for (size_t size : sizes) {
    DMUON_CHECK(size == sizes[0], Rule::name, ": views of ", sizes[0], " and ", size, " elements");
  }
  return static_cast<int64_t>(sizes[0]);
}

// MuonMomentum's gradient may also be empty, with no data (a zero gradient).
inline int64_t checked_size(const MuonMomentum& rule) {
  const size_t n = rule.momentum.size();
  DMUON_CHECK(rule.u.size() == n && (rule.grad.size() == n || (rule.grad.empty() && !rule.grad.data())),
              MuonMomentum::name, ": gradient, momentum and output sizes differ (", rule.grad.size(), ", ", n, ", ",
              rule.u.size(), ")");
  return static_cast<int64_t>(n);
}

// NorMuonNormalize: o holds rows·cols values and v rows; returns rows·cols.
inline int64_t checked_size(const NorMuonNormalize& rule) {
  DMUON_CHECK(rule.rows >= 0 && rule.cols >= 0 && rule.o.size() == static_cast<size_t>(rule.rows * rule.cols) &&
                  rule.v.size() == static_cast<size_t>(rule.rows),
              NorMuonNormalize::name, ": a ", rule.rows, "x", rule.cols, " matrix needs ", rule.rows * rule.cols,
              " values and ", rule.rows, " row moments, got ", rule.o.size(), " and ", rule.v.size());
  return static_cast<int64_t>(rule.o.size());
}

}  // namespace rules

// One update rule, for Backend::run.
struct UpdateRule {
  std::variant<rules::SumOfSquares, rules::Accumulate, rules::AdamWStep, rules::MuonMomentum, rules::MuonApply,
               rules::NorMuonNormalize>
      op;
};

}  // namespace dmuon
