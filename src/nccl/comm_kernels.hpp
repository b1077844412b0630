// The NCCL communicator's own kernels (comm_kernels.cu), launched on its stream; the caller has checked sizes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "dmuon/dtype.hpp"

namespace dmuon::comm {

// out[i] = op over b of blocks[b·n + i], b = 0..count−1 in that order (average: the sum divided by count).
// type: f32, f64, i64 or u8.
void launch_reduce_blocks(const void* blocks, void* out, int64_t n, int count, DType type, ReduceOp op,
                          cudaStream_t stream);

}  // namespace dmuon::comm
