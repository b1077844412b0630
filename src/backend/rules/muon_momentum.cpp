// MuonMomentum on the CPU backend: muon_momentum.hpp's loop over host memory, the device scalars (host memory
// here) read once.
#include "backend/rules/launch.hpp"
#include "backend/rules/muon_momentum.hpp"

namespace dmuon::rules {

template <>
void run_on_cpu(const MuonMomentum& rule) {
  const float grad_scale = rule.device_grad_scale ? *rule.device_grad_scale : rule.grad_scale;
  const bool keep = !rule.keep || *rule.keep != 0.0f;
  muon_momentum_loop(rule.grad.data(), grad_scale, rule.momentum.data(), rule.u.data(),
                     static_cast<int64_t>(rule.momentum.size()), rule.one_minus_beta, rule.beta, rule.nesterov, keep);
}

}  // namespace dmuon::rules
