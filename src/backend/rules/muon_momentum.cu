// MuonMomentum on the CUDA backend: muon_momentum.hpp's element as a grid-stride kernel that reads the device
// scalars (the scale, keep) itself, so the host never waits for them.
#include "backend/cuda_support.hpp"
#include "backend/rules/launch.hpp"
#include "backend/rules/muon_momentum.hpp"

namespace dmuon::rules {

namespace {

__global__ void muon_momentum_kernel(const float* grad, float grad_scale, const float* device_grad_scale,
                                     const float* keep, float* momentum, float* u, int64_t n, float one_minus_beta,
                                     float beta, bool nesterov) {
  const float scale = device_grad_scale ? *device_grad_scale : grad_scale;
  const bool kept = !keep || *keep != 0.0f;
  DMUON_FOR_EACH(i, n) muon_momentum_at(i, grad, scale, momentum, u, one_minus_beta, beta, nesterov, kept);
}

}  // namespace

template <>
void run_on_cuda(const MuonMomentum& rule, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(rule.momentum.size());
  if (n == 0) return;
  muon_momentum_kernel<<<cuda::grid_for(n), cuda::kThreads, 0, stream>>>(
      rule.grad.data(), rule.grad_scale, rule.device_grad_scale, rule.keep, rule.momentum.data(), rule.u.data(), n,
      rule.one_minus_beta, rule.beta, rule.nesterov);
  cuda::check_launch();
}

}  // namespace dmuon::rules
