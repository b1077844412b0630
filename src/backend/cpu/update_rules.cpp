// The per-tensor AdamW and Muon definitions, written to round as PyTorch does in float32
// (torch.optim.AdamW single-tensor path; KellerJordan/Muon's lerp_ calls), so the golden tensors
// match to a few ulps rather than by luck.
#include <cmath>

#include "dmuon/error.hpp"
#include "dmuon/optim.hpp"

namespace dmuon {

namespace {

// torch.lerp(a, b, w) = a + w·(b − a) for w < 0.5, else b − (b − a)·(1 − w), w cast to float.
float lerp(float a, float b, float w) { return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w); }

}  // namespace

void adamw_step(std::span<float> p, std::span<const float> grad, float grad_scale, std::span<float> m,
                std::span<float> v, int64_t t, const AdamWHyper& hyper) {
  DMUON_CHECK(grad.size() == p.size() && m.size() == p.size() && v.size() == p.size(),
              "adamw_step: parameter, gradient and state sizes differ (", p.size(), ", ", grad.size(), ", ",
              m.size(), ", ", v.size(), ")");
  DMUON_CHECK(t >= 1, "adamw_step: step count ", t, " must be ≥ 1");
  const float decay = static_cast<float>(1.0 - hyper.lr * hyper.weight_decay);
  const float one_minus_b1 = static_cast<float>(1.0 - hyper.beta1);
  const float b2 = static_cast<float>(hyper.beta2), one_minus_b2 = static_cast<float>(1.0 - hyper.beta2);
  const double bias1 = 1.0 - std::pow(hyper.beta1, static_cast<double>(t));
  const double bias2 = 1.0 - std::pow(hyper.beta2, static_cast<double>(t));
  const float step_size = static_cast<float>(hyper.lr / bias1);
  const float bias2_sqrt = static_cast<float>(std::sqrt(bias2));
  const float eps = static_cast<float>(hyper.eps);
  for (size_t i = 0; i < p.size(); ++i) {
    const float g = grad[i] * grad_scale;
    m[i] = lerp(m[i], g, one_minus_b1);  // exp_avg.lerp_(grad, 1 − β1)
    v[i] = v[i] * b2 + one_minus_b2 * g * g;
    const float denom = std::sqrt(v[i]) / bias2_sqrt + eps;
    p[i] = p[i] * decay + (-step_size) * (m[i] / denom);
  }
}

void muon_momentum(std::span<const float> grad, float grad_scale, std::span<float> momentum, std::span<float> u,
                   const MuonHyper& hyper) {
  DMUON_CHECK(grad.size() == momentum.size() && u.size() == momentum.size(),
              "muon_momentum: gradient, momentum and output sizes differ (", grad.size(), ", ", momentum.size(), ", ",
              u.size(), ")");
  const float w = static_cast<float>(1.0 - hyper.momentum);  // momentum.lerp_(g, 1 − β)
  const float beta = static_cast<float>(hyper.momentum);     // nesterov: g.lerp_(momentum, β)
  for (size_t i = 0; i < grad.size(); ++i) {
    const float g = grad[i] * grad_scale;
    momentum[i] = lerp(momentum[i], g, w);
    u[i] = hyper.nesterov ? lerp(g, momentum[i], beta) : momentum[i];
  }
}

double muon_scale(int64_t rows, int64_t cols, MuonScale scale) {
  DMUON_CHECK(rows > 0 && cols > 0, "muon_scale: empty matrix ", rows, "x", cols);
  if (scale == MuonScale::original) return std::sqrt(std::max(1.0, static_cast<double>(rows) / cols));
  return 0.2 * std::sqrt(static_cast<double>(std::max(rows, cols)));
}

void muon_apply(std::span<float> w, std::span<const float> o, const MuonHyper& hyper, double s) {
  DMUON_CHECK(w.size() == o.size(), "muon_apply: weight has ", w.size(), " values, update ", o.size());
  const float decay = static_cast<float>(1.0 - hyper.lr * hyper.weight_decay);
  const float scale = static_cast<float>(s);
  const float neg_lr = static_cast<float>(-hyper.lr);
  for (size_t i = 0; i < w.size(); ++i) w[i] = w[i] * decay + neg_lr * (o[i] * scale);
}

}  // namespace dmuon
