// What code above the backend that queues its own CUDA work beside a CUDA backend shares with it (the NCCL
// communicator and its kernels in src/nccl, the C ABI's stream join in src/capi): the runtime's error check, an
// event query that leaves no error behind, and the launch sizes of a grid-stride loop. The CUDA backend's own
// headers (src/backend/cuda/) stay private to the backend; its queue reaches others as Backend::native_queue().
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "dmuon/error.hpp"

// A failed CUDA runtime call becomes dmuon::Error naming the call, the library's own error string and the source
// line (as llm.c's cudaCheck). A failed runtime call also leaves its error as the thread's last error; the check
// clears it before throwing, so that a caller who handles the exception does not see it again from the next
// launch check (cudaGetLastError). Sticky errors (a faulting kernel) cannot be cleared and keep failing every
// call, as they should.
#define DMUON_CUDA_CHECK(call)                                                                           \
  do {                                                                                                   \
    const cudaError_t dmuon_cuda_rc = (call);                                                            \
    if (dmuon_cuda_rc != cudaSuccess) {                                                                  \
      (void)cudaGetLastError();                                                                          \
      DMUON_FAIL("CUDA: ", #call, " failed: ", cudaGetErrorName(dmuon_cuda_rc), " (",                    \
                 cudaGetErrorString(dmuon_cuda_rc), ")");                                                \
    }                                                                                                    \
  } while (0)

namespace dmuon::cuda {

// cudaEventQuery leaving no error behind: a cudaErrorNotReady answer also becomes the thread's last error, which the
// next launch check (cudaGetLastError) would report as its own failure; cleared here, as PyTorch's CUDAEvent::query
// clears it. The NCCL communicator's polling and dmuon_gpu_check's not-ready check use it (src/backend/cuda).
cudaError_t query_event(cudaEvent_t event);

constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n items.
inline unsigned grid_for(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 8192));
}

inline void check_launch() { DMUON_CUDA_CHECK(cudaGetLastError()); }

}  // namespace dmuon::cuda
