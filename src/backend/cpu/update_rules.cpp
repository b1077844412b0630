// The update rules' elementwise loops on the CPU (DESIGN 1), written to round as PyTorch does in
// float32 (torch.optim.AdamW single-tensor path; KellerJordan/Muon's lerp_ calls), so the golden
// tensors match to a few ulps rather than by luck. Built with -fno-math-errno (CMakeLists.txt): AdamW's
// sqrt then vectorizes, with the same IEEE-rounded results.
#include "backend/cpu/cpu_backend.hpp"

#include <cmath>

namespace dmuon {

namespace {
// torch.lerp(a, b, w) = a + w·(b − a) for w < 0.5, else b − (b − a)·(1 − w), w cast to float.
float lerp(float a, float b, float w) { return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w); }
}  // namespace

// Σ (g_i·scale)² in double; four partial sums break the add latency chain (the order differs from a
// plain loop by rounding in the last bits of a double, far below what float32 clipping can see).
void CpuBackend::sum_of_squares(const float* g, int64_t n, float scale, double* sum) {
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
  *sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

void CpuBackend::accumulate(float* acc, const float* grad, int64_t n, bool first) {
  for (int64_t i = 0; i < n; ++i) acc[i] = (first ? 0.0f : acc[i]) + grad[i];
}

void CpuBackend::adamw_step(float* p, const float* grad, float grad_scale, float* m, float* v, int64_t n,
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

void CpuBackend::muon_momentum(const float* grad, float grad_scale, float* momentum, float* u, int64_t n,
                               float one_minus_beta, float beta, bool nesterov) {
  // momentum.lerp_(g, 1 − β); nesterov: g.lerp_(momentum, β)
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * grad_scale;
    momentum[i] = lerp(momentum[i], g, one_minus_beta);
    u[i] = nesterov ? lerp(g, momentum[i], beta) : momentum[i];
  }
}

void CpuBackend::muon_apply(float* w, const float* o, int64_t n, float decay, float neg_lr, float scale) {
  for (int64_t i = 0; i < n; ++i) w[i] = w[i] * decay + neg_lr * (o[i] * scale);
}

}  // namespace dmuon
