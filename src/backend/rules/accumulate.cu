// Accumulate on the CUDA backend: accumulate.hpp's element as a grid-stride kernel.
#include "backend/cuda_support.hpp"
#include "backend/rules/accumulate.hpp"
#include "backend/rules/launch.hpp"

namespace dmuon::rules {

namespace {

__global__ void accumulate_kernel(float* acc, const float* grad, int64_t n, bool first) {
  DMUON_FOR_EACH(i, n) accumulate_at(i, acc, grad, first);
}

}  // namespace

template <>
void run_on_cuda(const Accumulate& rule, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(rule.acc.size());
  if (n == 0) return;
  accumulate_kernel<<<cuda::grid_for(n), cuda::kThreads, 0, stream>>>(rule.acc.data(), rule.grad.data(), n,
                                                                      rule.first);
  cuda::check_launch();
}

}  // namespace dmuon::rules
