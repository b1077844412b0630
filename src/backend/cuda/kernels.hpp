// The CUDA backend's matrix kernels (matrix_kernels.cu), launched on a stream; callers have checked shapes. Float
// arithmetic rounds as the CPU backend's definitions do: every product and sum is an explicitly rounded intrinsic
// (__fmul_rn, __fadd_rn, …), never contracted into an FMA. Reductions accumulate in double in a fixed order
// (deterministic run to run). The update rules' kernels live with their rules (src/backend/rules/<rule>.cu).
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

}  // namespace dmuon::cuda
