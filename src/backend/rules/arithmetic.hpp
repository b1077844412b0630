// The update rules' float32 arithmetic, written once for the host and the device (DMUON_HOST_DEVICE): every
// operation rounds once, in the order written, so the CPU loops, the CUDA kernels and dmuon_gpu_check's host
// references give the same bits. On the device each is an explicitly rounded intrinsic (__fmul_rn, …), which nvcc
// never contracts into an FMA (tests/backend/cuda_kernels_no_fma_test.cmake); on the host a plain operator, which the build
// never contracts either (-ffp-contract=off, CMakeLists.txt).
#pragma once

#include <cmath>

#ifdef __CUDACC__
#define DMUON_HOST_DEVICE __host__ __device__
#else
#define DMUON_HOST_DEVICE
#endif

namespace dmuon::rules {

DMUON_HOST_DEVICE inline float mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

DMUON_HOST_DEVICE inline float add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

DMUON_HOST_DEVICE inline float sub(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

DMUON_HOST_DEVICE inline float div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// √a rounded once, in float or double.
template <class T>
DMUON_HOST_DEVICE inline T sqrt_rn(T a) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "sqrt_rn: float or double");
#ifdef __CUDA_ARCH__
  if constexpr (sizeof(T) == 8) {
    return __dsqrt_rn(a);
  } else {
    return __fsqrt_rn(a);
  }
#else
  return std::sqrt(a);
#endif
}

// torch.lerp(a, b, w) = a + w·(b − a) for w < 0.5, else b − (b − a)·(1 − w), w cast to float.
DMUON_HOST_DEVICE inline float lerp(float a, float b, float w) {
  return w < 0.5f ? add(a, mul(w, sub(b, a))) : sub(b, mul(sub(b, a), sub(1.0f, w)));
}

}  // namespace dmuon::rules
