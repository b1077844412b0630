// MuonMomentum's element (dmuon/update_rules.hpp), KellerJordan/Muon's momentum.lerp_(g, 1 − β) and, with Nesterov,
// g.lerp_(momentum, β); a missing gradient is zeros times the scale, and keep = false leaves M as it is and sets
// U = M. For the CPU loop, the CUDA kernel and dmuon_gpu_check's host reference.
#pragma once

#include <cstdint>

#include "backend/rules/arithmetic.hpp"

namespace dmuon::rules {

// grad: null for a zero gradient. g is read before u (which may alias grad) is written.
DMUON_HOST_DEVICE inline void muon_momentum_at(int64_t i, const float* grad, float grad_scale, float* momentum,
                                               float* u, float one_minus_beta, float beta, bool nesterov, bool keep) {
  const float m = momentum[i];
  if (!keep) {  // the step leaves this tensor out: M as it is, bit for bit (−0 and Inf too), and U = M
    u[i] = m;
    return;
  }
  const float g = mul(grad ? grad[i] : 0.0f, grad_scale);
  const float mi = lerp(m, g, one_minus_beta);
  momentum[i] = mi;
  u[i] = nesterov ? lerp(g, mi, beta) : mi;
}

inline void muon_momentum_loop(const float* grad, float grad_scale, float* momentum, float* u, int64_t n,
                               float one_minus_beta, float beta, bool nesterov, bool keep) {
  for (int64_t i = 0; i < n; ++i) {
    muon_momentum_at(i, grad, grad_scale, momentum, u, one_minus_beta, beta, nesterov, keep);
  }
}

}  // namespace dmuon::rules
