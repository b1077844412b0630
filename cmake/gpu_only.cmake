# The GPU subset (-DDMUON_GPU_ONLY=ON, docs/gpu.md): for GPU machines without our Debian libraries. Builds the
# backend basics, the CUDA backend and the Newton–Schulz engine (all standard C++ and CUDA) into dmuon_gpu, and
# the check tool dmuon_gpu_check on top: no OpenBLAS (so no CPU backend), MPI, NCCL, CBC, JSON, CLI11 or
# GoogleTest; one process.
if(NOT DMUON_HAVE_CUDA)
  message(FATAL_ERROR "dmuon: DMUON_GPU_ONLY=ON needs the CUDA toolkit (nvcc, cuBLAS)")
endif()
# src/backend/no_cpu_backend.cpp stands in for the CPU backend (which the full build has, and skips it).
file(GLOB _gpu_sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/backend/*.cpp ${PROJECT_SOURCE_DIR}/src/ns/*.cpp)
add_library(dmuon_gpu STATIC ${_gpu_sources} ${PROJECT_SOURCE_DIR}/src/backend/cuda/cublas_calls.cpp)
target_include_directories(dmuon_gpu PUBLIC ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
dmuon_add_cuda_sources(dmuon_gpu)
target_link_libraries(dmuon_gpu PUBLIC CUDA::cudart CUDA::cublas)
dmuon_add_gpu_check(dmuon_gpu)
message(STATUS "dmuon: GPU-only build: dmuon_gpu (backend, CUDA backend, Newton-Schulz) and dmuon_gpu_check")
