// The update rules' elementwise loops in float32 on host memory (DESIGN 1), rounding as PyTorch does
// (torch.optim.AdamW's single-tensor path; KellerJordan/Muon's lerp_ calls): the CPU backend's definitions
// (src/backend/cpu/update_rules.cpp), and the host loops dmuon_gpu_check compares the CUDA kernels with bit for
// bit. Header-only and plain C++, so the GPU-only build (no CPU backend) has them too.
#pragma once

#include <cmath>
#include <cstdint>

#include "dmuon/backend.hpp"

namespace dmuon::update_loops {

// torch.lerp(a, b, w) = a + w·(b − a) for w < 0.5, else b − (b − a)·(1 − w), w cast to float.
inline float lerp(float a, float b, float w) { return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w); }

inline void accumulate(float* acc, const float* grad, int64_t n, bool first) {
  for (int64_t i = 0; i < n; ++i) acc[i] = (first ? 0.0f : acc[i]) + grad[i];
}

inline void adamw_step(float* p, const float* grad, float grad_scale, float* m, float* v, int64_t n,
                       const AdamWStepConstants& constants) {
  // Local copies: stores through p, m and v could alias the referenced constants, which would stop GCC from
  // vectorizing the loop (measured: the AdamW step 2.25× slower).
  const AdamWStepConstants k = constants;
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * grad_scale;
    m[i] = lerp(m[i], g, k.one_minus_b1);  // exp_avg.lerp_(grad, 1 − β1)
    v[i] = v[i] * k.b2 + k.one_minus_b2 * g * g;
    const float denom = std::sqrt(v[i]) / k.bias2_sqrt + k.eps;
    p[i] = p[i] * k.decay + (-k.step_size) * (m[i] / denom);
  }
}

// momentum.lerp_(g, 1 − β); nesterov: g.lerp_(momentum, β).
inline void muon_momentum(const float* grad, float grad_scale, float* momentum, float* u, int64_t n,
                          float one_minus_beta, float beta, bool nesterov) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * grad_scale;
    momentum[i] = lerp(momentum[i], g, one_minus_beta);
    u[i] = nesterov ? lerp(g, momentum[i], beta) : momentum[i];
  }
}

inline void muon_apply(float* w, const float* o, int64_t n, float decay, float neg_lr, float scale) {
  for (int64_t i = 0; i < n; ++i) w[i] = w[i] * decay + neg_lr * (o[i] * scale);
}

}  // namespace dmuon::update_loops
