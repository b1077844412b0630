// AdamWStep on the CUDA backend: adamw_step.hpp's element as a grid-stride kernel.
#include "backend/cuda_support.hpp"
#include "backend/rules/adamw_step.hpp"
#include "backend/rules/launch.hpp"

namespace dmuon::rules {

namespace {

__global__ void adamw_step_kernel(float* p, const float* grad, float grad_scale, float* m, float* v, int64_t n,
                                  AdamWStepConstants k) {
  DMUON_FOR_EACH(i, n) adamw_step_at(i, p, grad, grad_scale, m, v, k);
}

}  // namespace

template <>
void run_on_cuda(const AdamWStep& rule, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(rule.p.size());
  if (n == 0) return;
  adamw_step_kernel<<<cuda::grid_for(n), cuda::kThreads, 0, stream>>>(rule.p.data(), rule.grad.data(), rule.grad_scale,
                                                                      rule.m.data(), rule.v.data(), n, rule.k);
  cuda::check_launch();
}

}  // namespace dmuon::rules
