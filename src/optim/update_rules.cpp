// The per-tensor AdamW and Muon definitions on host spans (optim.hpp): checks and torch's rounding of the
// per-step constants here, the elementwise loops the CPU backend's rules (dmuon/update_rules.hpp, run by
// src/backend/rules/), so the optimizers and these definitions run the same code.
#include <cmath>

#include "dmuon/error.hpp"
#include "dmuon/optim.hpp"
#include "dmuon/update_rules.hpp"

namespace dmuon {

AdamWStepConstants adamw_step_constants(const AdamWHyper& hyper, int64_t t) {
  DMUON_CHECK(t >= 1, "adamw_step: step count ", t, " must be ≥ 1");
  const double bias1 = 1.0 - std::pow(hyper.beta1, static_cast<double>(t));
  const double bias2 = 1.0 - std::pow(hyper.beta2, static_cast<double>(t));
  return {static_cast<float>(1.0 - hyper.lr * hyper.weight_decay),
          static_cast<float>(1.0 - hyper.beta1),
          static_cast<float>(hyper.beta2),
          static_cast<float>(1.0 - hyper.beta2),
          static_cast<float>(hyper.lr / bias1),
          static_cast<float>(std::sqrt(bias2)),
          static_cast<float>(hyper.eps)};
}

void adamw_step(std::span<float> p, std::span<const float> grad, float grad_scale, std::span<float> m,
                std::span<float> v, int64_t t, const AdamWHyper& hyper) {
  DMUON_CHECK(grad.size() == p.size() && m.size() == p.size() && v.size() == p.size(),
              "adamw_step: parameter, gradient and state sizes differ (", p.size(), ", ", grad.size(), ", ",
              m.size(), ", ", v.size(), ")");
  Backend& cpu = cpu_backend();
  cpu.run({rules::AdamWStep{.p = DeviceSpan(cpu, p.data(), p.size()),
                            .grad = DeviceSpan(cpu, grad.data(), grad.size()),
                            .m = DeviceSpan(cpu, m.data(), m.size()),
                            .v = DeviceSpan(cpu, v.data(), v.size()),
                            .k = adamw_step_constants(hyper, t),
                            .grad_scale = grad_scale}});
}

void muon_momentum(std::span<const float> grad, float grad_scale, std::span<float> momentum, std::span<float> u,
                   const MuonHyper& hyper) {
  DMUON_CHECK(grad.size() == momentum.size() && u.size() == momentum.size(),
              "muon_momentum: gradient, momentum and output sizes differ (", grad.size(), ", ", momentum.size(), ", ",
              u.size(), ")");
  Backend& cpu = cpu_backend();
  cpu.run({rules::MuonMomentum{.grad = DeviceSpan(cpu, grad.data(), grad.size()),
                               .momentum = DeviceSpan(cpu, momentum.data(), momentum.size()),
                               .u = DeviceSpan(cpu, u.data(), u.size()),
                               .one_minus_beta = static_cast<float>(1.0 - hyper.momentum),
                               .beta = static_cast<float>(hyper.momentum),
                               .nesterov = hyper.nesterov,
                               .grad_scale = grad_scale}});
}

double muon_scale(int64_t rows, int64_t cols, MuonScale scale) {
  DMUON_CHECK(rows > 0 && cols > 0, "muon_scale: empty matrix ", rows, "x", cols);
  switch (scale) {
    case MuonScale::original: return std::sqrt(std::max(1.0, static_cast<double>(rows) / cols));
    case MuonScale::match_rms_adamw: return 0.2 * std::sqrt(static_cast<double>(std::max(rows, cols)));
    case MuonScale::spectral: return std::sqrt(static_cast<double>(rows) / cols);
    case MuonScale::unit_rms: return std::sqrt(static_cast<double>(std::max(rows, cols)));
  }
  DMUON_FAIL("muon_scale: unknown MuonScale ", static_cast<int>(scale));
}

void muon_apply(std::span<float> w, std::span<const float> o, const MuonHyper& hyper, double s) {
  DMUON_CHECK(w.size() == o.size(), "muon_apply: weight has ", w.size(), " values, update ", o.size());
  Backend& cpu = cpu_backend();
  cpu.run({rules::MuonApply{.w = DeviceSpan(cpu, w.data(), w.size()),
                            .o = DeviceSpan(cpu, o.data(), o.size()),
                            .decay = static_cast<float>(1.0 - hyper.lr * hyper.weight_decay),
                            .neg_lr = static_cast<float>(-hyper.lr),
                            .scale = static_cast<float>(s)}});
}

}  // namespace dmuon
