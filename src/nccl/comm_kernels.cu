// The NCCL communicator's local reduction: an uneven reduce-scatter receives every rank's block of its part
// (grouped ncclSend/ncclRecv) and sums them here in rank order, so the result does not depend on arrival order.
#include "nccl/comm_kernels.hpp"

#include <cstdint>

#include "backend/cuda_support.hpp"
#include "dmuon/error.hpp"

namespace dmuon::comm {

using cuda::check_launch;
using cuda::grid_for;
using cuda::kThreads;

namespace {

template <typename T>
__device__ T combine(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::max:
      return a > b ? a : b;
    case ReduceOp::min:
      return a < b ? a : b;
    default:
      return a + b;
  }
}

template <typename T>
__global__ void reduce_blocks_kernel(const T* blocks, T* out, int64_t n, int count, ReduceOp op) {
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads) {
    T acc = blocks[i];
    for (int b = 1; b < count; ++b) acc = combine(acc, blocks[int64_t{b} * n + i], op);
    if (op == ReduceOp::average) acc = acc / static_cast<T>(count);
    out[i] = acc;
  }
}

template <typename T>
void reduce_blocks(const void* blocks, void* out, int64_t n, int count, ReduceOp op, cudaStream_t stream) {
  reduce_blocks_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(static_cast<const T*>(blocks), static_cast<T*>(out),
                                                                  n, count, op);
  check_launch();
}

}  // namespace

void launch_reduce_blocks(const void* blocks, void* out, int64_t n, int count, DType type, ReduceOp op,
                          cudaStream_t stream) {
  if (n == 0) return;
  switch (type) {
    case DType::f32:
      return reduce_blocks<float>(blocks, out, n, count, op, stream);
    case DType::f64:
      return reduce_blocks<double>(blocks, out, n, count, op, stream);
    case DType::i64:
      return reduce_blocks<int64_t>(blocks, out, n, count, op, stream);
    case DType::u8:
      return reduce_blocks<uint8_t>(blocks, out, n, count, op, stream);
    case DType::bf16:
      break;
  }
  DMUON_FAIL("the block reduction of an uneven NCCL reduce-scatter takes no ", to_string(type), " buffers");
}

}  // namespace dmuon::comm
