// AdamWStep's element (dmuon/update_rules.hpp) in torch.optim.AdamW's single-tensor order, for the CPU loop, the
// CUDA kernel and dmuon_gpu_check's host reference.
#pragma once

#include <cstdint>

#include "backend/rules/arithmetic.hpp"
#include "dmuon/update_rules.hpp"

namespace dmuon::rules {

DMUON_HOST_DEVICE inline void adamw_step_at(int64_t i, float* p, const float* grad, float grad_scale, float* m,
                                            float* v, const AdamWStepConstants& k) {
  const float g = mul(grad[i], grad_scale);
  const float mi = lerp(m[i], g, k.one_minus_b1);  // exp_avg.lerp_(grad, 1 − β1)
  const float vi = add(mul(v[i], k.b2), mul(mul(k.one_minus_b2, g), g));
  const float denom = add(div(sqrt_rn(vi), k.bias2_sqrt), k.eps);
  m[i] = mi;
  v[i] = vi;
  p[i] = add(mul(p[i], k.decay), mul(-k.step_size, div(mi, denom)));
}

inline void adamw_step_loop(float* p, const float* grad, float grad_scale, float* m, float* v, int64_t n,
                            const AdamWStepConstants& constants) {
  // A local copy: stores through p, m and v could alias the referenced constants, which would stop GCC from
  // vectorizing the loop (measured: the AdamW step 2.25× slower).
  const AdamWStepConstants k = constants;
  for (int64_t i = 0; i < n; ++i) adamw_step_at(i, p, grad, grad_scale, m, v, k);
}

}  // namespace dmuon::rules
