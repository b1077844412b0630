// The CUDA backend's own kernels (matrix_kernels.cu, update_kernels.cu), launched on a stream; callers have
// checked shapes. Float arithmetic rounds as the CPU backend's definitions do: every product and sum is an
// explicitly rounded intrinsic (__fmul_rn, __fadd_rn, …), never contracted into an FMA, so the update rules
// give the CPU's bits. Reductions accumulate in double in a fixed order (deterministic run to run).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "dmuon/backend.hpp"

namespace dmuon::cuda {

// ---- matrices (f32 or bf16, batched views) ----
void launch_convert(const MatView& in, const MatView& out, cudaStream_t stream);
void launch_fill(const MatView& x, float value, cudaStream_t stream);
void launch_scale(const MatView& x, float alpha, cudaStream_t stream);
void launch_add_identity(const MatView& c, float alpha, cudaStream_t stream);
void launch_mirror_upper(const MatView& c, cudaStream_t stream);
void launch_transpose(const MatView& in, const MatView& out, cudaStream_t stream);
// norms[i] = ‖x_i‖_F (double, device memory).
void launch_frobenius_norms(const MatView& x, double* norms, cudaStream_t stream);
// x_i ← x_i · float(1 / (norms[i]·safety + eps)).
void launch_scale_by_inverse_norm(const MatView& x, const double* norms, double safety, double eps,
                                  cudaStream_t stream);

// ---- the update rules on n float32 values ----
void launch_sum_of_squares(const float* grad, int64_t n, float grad_scale, double* sum, cudaStream_t stream);
void launch_accumulate(float* acc, const float* grad, int64_t n, bool first, cudaStream_t stream);
void launch_adamw_step(float* p, const float* grad, float grad_scale, float* m, float* v, int64_t n,
                       const AdamWStepConstants& k, cudaStream_t stream);
void launch_muon_momentum(const float* grad, float grad_scale, float* momentum, float* u, int64_t n,
                          float one_minus_beta, float beta, bool nesterov, cudaStream_t stream);
void launch_muon_apply(float* w, const float* o, int64_t n, float decay, float neg_lr, float scale,
                       cudaStream_t stream);

}  // namespace dmuon::cuda
