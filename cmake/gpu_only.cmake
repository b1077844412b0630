# The GPU subset (-DDMUON_GPU_ONLY=ON, docs/gpu.md): for GPU machines without our Debian libraries. Builds the
# backend basics, the recording backend, the CUDA backend and the Newton–Schulz engine (all standard C++ and CUDA)
# into dmuon_gpu, and the check tool dmuon_gpu_check on top: no OpenBLAS (so no CPU backend), MPI, NCCL, CBC,
# JSON, CLI11 or GoogleTest; one process. CI configures and builds it (the gpu_only_build test).
if(NOT DMUON_HAVE_CUDA)
  message(FATAL_ERROR "dmuon: DMUON_GPU_ONLY=ON needs the CUDA toolkit (nvcc, cuBLAS)")
endif()
# Every source of the two layers, subfolders included (backend/record: ns/kernel_calls.cpp records on it), but
# the CPU backend's (src/backend/cpu/ and the rules' CPU launchers, src/backend/rules/*.cpp):
# src/backend/no_cpu_backend.cpp stands in for it (the full build has it, and skips that file).
file(GLOB_RECURSE _gpu_sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/backend/*.cpp ${PROJECT_SOURCE_DIR}/src/ns/*.cpp)
list(FILTER _gpu_sources EXCLUDE REGEX "/src/backend/(cpu|rules)/")
add_library(dmuon_gpu STATIC ${_gpu_sources})
target_include_directories(dmuon_gpu PUBLIC ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
dmuon_add_cuda_sources(dmuon_gpu)
target_link_libraries(dmuon_gpu PUBLIC CUDA::cudart CUDA::cublas)
# Whole: every object of dmuon_gpu is linked, so a symbol that none of them defines fails this build instead of
# hiding until a caller first needs the object that uses it.
dmuon_add_gpu_check("$<LINK_LIBRARY:WHOLE_ARCHIVE,dmuon_gpu>")
message(STATUS "dmuon: GPU-only build: dmuon_gpu (backend, CUDA backend, Newton-Schulz) and dmuon_gpu_check")
