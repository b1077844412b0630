// Error checks for the CUDA runtime (DMUON_CUDA_CHECK, backend/cuda_support.hpp) and cuBLAS: a failed call
// becomes dmuon::Error naming the call, the library's own error string and the source line (as llm.c's cudaCheck).
#pragma once

#include <cublas_v2.h>

#include "backend/cuda_support.hpp"
#include "dmuon/error.hpp"

#define DMUON_CUBLAS_CHECK(call)                                                                         \
  do {                                                                                                   \
    const cublasStatus_t dmuon_cublas_rc = (call);                                                       \
    if (dmuon_cublas_rc != CUBLAS_STATUS_SUCCESS)                                                        \
      DMUON_FAIL("cuBLAS: ", #call, " failed: ", cublasGetStatusName(dmuon_cublas_rc), " (",             \
                 cublasGetStatusString(dmuon_cublas_rc), ")");                                           \
  } while (0)
