// The update rules of DESIGN 1 on device memory, rounding exactly as the CPU definitions
// (src/backend/cpu/update_rules.cpp, torch.optim's float32 order): each operation is one explicitly rounded
// intrinsic in the CPU's evaluation order, so nvcc cannot fuse a multiply and an add into an FMA.
#include <cstdint>

#include "backend/cuda/device_view.cuh"
#include "backend/cuda/kernels.hpp"

namespace dmuon::cuda {

namespace {

// torch.lerp(a, b, w) = a + w·(b − a) for w < 0.5, else b − (b − a)·(1 − w).
__device__ float lerp(float a, float b, float w) {
  return w < 0.5f ? __fadd_rn(a, __fmul_rn(w, __fsub_rn(b, a)))
                  : __fsub_rn(b, __fmul_rn(__fsub_rn(b, a), __fsub_rn(1.0f, w)));
}

#define DMUON_FOR_EACH(i, n) \
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < (n); i += int64_t{gridDim.x} * kThreads)

__global__ void accumulate_kernel(float* acc, const float* grad, int64_t n, bool first) {
  DMUON_FOR_EACH(i, n) acc[i] = __fadd_rn(first ? 0.0f : acc[i], grad[i]);
}

__global__ void adamw_kernel(float* p, const float* grad, float grad_scale, float* m, float* v, int64_t n,
                             AdamWStepConstants k) {
  DMUON_FOR_EACH(i, n) {
    const float g = __fmul_rn(grad[i], grad_scale);
    const float mi = lerp(m[i], g, k.one_minus_b1);
    const float vi = __fadd_rn(__fmul_rn(v[i], k.b2), __fmul_rn(__fmul_rn(k.one_minus_b2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), k.bias2_sqrt), k.eps);
    m[i] = mi;
    v[i] = vi;
    p[i] = __fadd_rn(__fmul_rn(p[i], k.decay), __fmul_rn(-k.step_size, __fdiv_rn(mi, denom)));
  }
}

__global__ void muon_momentum_kernel(const float* grad, float grad_scale, float* momentum, float* u, int64_t n,
                                     float one_minus_beta, float beta, bool nesterov) {
  DMUON_FOR_EACH(i, n) {
    const float g = __fmul_rn(grad[i], grad_scale);  // read before u (which may alias grad) is written
    const float mi = lerp(momentum[i], g, one_minus_beta);
    momentum[i] = mi;
    u[i] = nesterov ? lerp(g, mi, beta) : mi;
  }
}

__global__ void muon_apply_kernel(float* w, const float* o, int64_t n, float decay, float neg_lr, float scale) {
  DMUON_FOR_EACH(i, n) w[i] = __fadd_rn(__fmul_rn(w[i], decay), __fmul_rn(neg_lr, __fmul_rn(o[i], scale)));
}

struct ScaledGradLoad {
  const float* grad;
  float grad_scale;
  __device__ double operator()(int64_t, int64_t i) const { return __fmul_rn(grad[i], grad_scale); }
};

}  // namespace

void launch_sum_of_squares(const float* grad, int64_t n, float grad_scale, double* sum, cudaStream_t stream) {
  if (n == 0) {
    DMUON_CUDA_CHECK(cudaMemsetAsync(sum, 0, sizeof(double), stream));
    return;
  }
  sums_of_squares(ScaledGradLoad{grad, grad_scale}, n, 1, false, sum, stream);
}

void launch_accumulate(float* acc, const float* grad, int64_t n, bool first, cudaStream_t stream) {
  if (n == 0) return;
  accumulate_kernel<<<grid_for(n), kThreads, 0, stream>>>(acc, grad, n, first);
  check_launch();
}

void launch_adamw_step(float* p, const float* grad, float grad_scale, float* m, float* v, int64_t n,
                       const AdamWStepConstants& k, cudaStream_t stream) {
  if (n == 0) return;
  adamw_kernel<<<grid_for(n), kThreads, 0, stream>>>(p, grad, grad_scale, m, v, n, k);
  check_launch();
}

void launch_muon_momentum(const float* grad, float grad_scale, float* momentum, float* u, int64_t n,
                          float one_minus_beta, float beta, bool nesterov, cudaStream_t stream) {
  if (n == 0) return;
  muon_momentum_kernel<<<grid_for(n), kThreads, 0, stream>>>(grad, grad_scale, momentum, u, n, one_minus_beta, beta,
                                                             nesterov);
  check_launch();
}

void launch_muon_apply(float* w, const float* o, int64_t n, float decay, float neg_lr, float scale,
                       cudaStream_t stream) {
  if (n == 0) return;
  muon_apply_kernel<<<grid_for(n), kThreads, 0, stream>>>(w, o, n, decay, neg_lr, scale);
  check_launch();
}

}  // namespace dmuon::cuda
