// The update rules on the CPU (DESIGN 1): the loops of update_rule_loops.hpp, which round as PyTorch does in
// float32, so the golden tensors match to a few ulps rather than by luck; and Σ g². Built with -fno-math-errno
// (CMakeLists.txt): AdamW's sqrt then vectorizes, with the same IEEE-rounded results.
#include "backend/cpu/cpu_backend.hpp"
#include "backend/update_rule_loops.hpp"

namespace dmuon {

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
  update_loops::accumulate(acc, grad, n, first);
}

void CpuBackend::adamw_step(float* p, const float* grad, float grad_scale, float* m, float* v, int64_t n,
                            const AdamWStepConstants& k) {
  update_loops::adamw_step(p, grad, grad_scale, m, v, n, k);
}

void CpuBackend::muon_momentum(const float* grad, float grad_scale, float* momentum, float* u, int64_t n,
                               float one_minus_beta, float beta, bool nesterov) {
  update_loops::muon_momentum(grad, grad_scale, momentum, u, n, one_minus_beta, beta, nesterov);
}

void CpuBackend::muon_apply(float* w, const float* o, int64_t n, float decay, float neg_lr, float scale) {
  update_loops::muon_apply(w, o, n, decay, neg_lr, scale);
}

}  // namespace dmuon
