// Error checks for the CUDA runtime and cuBLAS: a failed call becomes dmuon::Error naming the call, the
// library's own error string and the source line (as llm.c's cudaCheck). A failed runtime call also leaves its
// error as the thread's last error; DMUON_CUDA_CHECK clears it before throwing, so that a caller who handles the
// exception does not see it again from the next launch check (cudaGetLastError). Sticky errors (a faulting
// kernel) cannot be cleared and keep failing every call, as they should.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "dmuon/error.hpp"

#define DMUON_CUDA_CHECK(call)                                                                           \
  do {                                                                                                   \
    const cudaError_t dmuon_cuda_rc = (call);                                                            \
    if (dmuon_cuda_rc != cudaSuccess) {                                                                  \
      (void)cudaGetLastError();                                                                          \
      DMUON_FAIL("CUDA: ", #call, " failed: ", cudaGetErrorName(dmuon_cuda_rc), " (",                    \
                 cudaGetErrorString(dmuon_cuda_rc), ")");                                                \
    }                                                                                                    \
  } while (0)

#define DMUON_CUBLAS_CHECK(call)                                                                         \
  do {                                                                                                   \
    const cublasStatus_t dmuon_cublas_rc = (call);                                                       \
    if (dmuon_cublas_rc != CUBLAS_STATUS_SUCCESS)                                                        \
      DMUON_FAIL("cuBLAS: ", #call, " failed: ", cublasGetStatusName(dmuon_cublas_rc), " (",             \
                 cublasGetStatusString(dmuon_cublas_rc), ")");                                           \
  } while (0)
