# The CUDA backend (DESIGN 6, docs/gpu.md). DMUON_CUDA=AUTO builds it when nvcc, cuBLAS and nccl.h are all
# found (they are on every development machine, so CI compiles and links the CUDA code it cannot run); ON
# makes a missing piece an error; OFF leaves the build CPU-only. Sets DMUON_HAVE_CUDA and, when on, the
# imported target dmuon::nccl and the CUDA language.
set(DMUON_CUDA AUTO CACHE STRING "Build the CUDA backend: AUTO (when nvcc, cuBLAS and nccl.h are found), ON or OFF")
set_property(CACHE DMUON_CUDA PROPERTY STRINGS AUTO ON OFF)
if(NOT DMUON_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "DMUON_CUDA must be AUTO, ON or OFF, got '${DMUON_CUDA}'")
endif()

set(DMUON_HAVE_CUDA OFF)
set(DMUON_HAVE_NCCL OFF)
if(NOT DMUON_CUDA STREQUAL "OFF")
  # H100/H200 (sm_90) machine code plus PTX that newer GPUs compile at load time. nvcc 13 would default to sm_75.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90-real 90-virtual)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  # cuBLAS outside the toolkit: CUBLAS_ROOT (scripts/gpu-check.sh passes torch's wheel folder, site-packages/nvidia/
  # cu13, whose libraries have only versioned names) gives FindCUDAToolkit's CUDA::cublas its libraries and headers.
  if(CUBLAS_ROOT)
    foreach(_lib cublas cublasLt)
      find_library(CUDA_${_lib}_LIBRARY NAMES ${_lib} lib${_lib}.so.13 lib${_lib}.so.12 PATHS ${CUBLAS_ROOT}
                   PATH_SUFFIXES lib lib64 NO_DEFAULT_PATH)
    endforeach()
  endif()
  find_package(CUDAToolkit QUIET)
  # After the toolkit's headers: that folder also holds the wheels' CUDA runtime headers, which must not shadow
  # nvcc's own; cublas_v2.h comes from it when the toolkit has none.
  if(CUBLAS_ROOT AND TARGET CUDA::cublas)
    set_property(TARGET CUDA::cublas APPEND PROPERTY INTERFACE_INCLUDE_DIRECTORIES ${CUBLAS_ROOT}/include)
  endif()
  # NCCL has no CMake package: the toolkit on our machines carries it; NCCL_ROOT (or the nvidia-nccl-cu13
  # Python wheel's folder) points elsewhere.
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_INCLUDE_DIRS} PATH_SUFFIXES include)
  find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${CUDAToolkit_LIBRARY_DIR}
               PATH_SUFFIXES lib lib64)
  set(_dmuon_cuda_missing "")
  if(NOT CMAKE_CUDA_COMPILER)
    list(APPEND _dmuon_cuda_missing "nvcc")
  endif()
  if(NOT CUDAToolkit_FOUND OR NOT TARGET CUDA::cublas)
    list(APPEND _dmuon_cuda_missing "cuBLAS (CUDAToolkit)")
  endif()
  # A GPU-only build is one process without MPI: it needs no NCCL.
  if(NOT DMUON_GPU_ONLY AND (NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY))
    list(APPEND _dmuon_cuda_missing "NCCL (nccl.h, libnccl)")
  endif()
  if(_dmuon_cuda_missing STREQUAL "")
    set(DMUON_HAVE_CUDA ON)
    set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
    enable_language(CUDA)
    # CMake 3.25 does not know nvcc 13's C++20 flag ("CUDA20" dialect): teach it after the compiler check.
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_EXTENSIONS OFF)
    add_compile_options($<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-ffp-contract=off>)  # host code as CMakeLists.txt's
    if(NCCL_INCLUDE_DIR AND NCCL_LIBRARY AND NOT DMUON_GPU_ONLY)
      set(DMUON_HAVE_NCCL ON)
      add_library(dmuon::nccl UNKNOWN IMPORTED)
      set_target_properties(dmuon::nccl PROPERTIES IMPORTED_LOCATION ${NCCL_LIBRARY}
                                                   INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR})
      file(STRINGS ${NCCL_INCLUDE_DIR}/nccl.h _nccl_version REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
      string(REGEX REPLACE "[^0-9;]" "" _nccl_version "${_nccl_version}")
      string(REPLACE ";" "." _nccl_version "${_nccl_version}")
      set(_nccl_found "NCCL ${_nccl_version} (${NCCL_LIBRARY})")
    else()
      set(_nccl_found "no NCCL (GPU-only build)")
    endif()
    message(STATUS "dmuon: CUDA backend ON: nvcc ${CMAKE_CUDA_COMPILER_VERSION} (${CMAKE_CUDA_COMPILER}), "
                   "CUDA toolkit ${CUDAToolkit_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES}, "
                   "cuBLAS ${CUDA_cublas_LIBRARY}, ${_nccl_found}")
  elseif(DMUON_CUDA STREQUAL "ON")
    message(FATAL_ERROR "dmuon: DMUON_CUDA=ON but not found: ${_dmuon_cuda_missing}")
  else()
    message(STATUS "dmuon: CUDA backend OFF (DMUON_CUDA=AUTO; not found: ${_dmuon_cuda_missing})")
  endif()
else()
  message(STATUS "dmuon: CUDA backend OFF (DMUON_CUDA=OFF)")
endif()

# Adds the CUDA backend's kernels and host code (src/backend/cuda/*.cu) and the update rules' CUDA launchers
# (src/backend/rules/*.cu), compiled by nvcc, to `target` (the backend layer). Its call descriptors
# (cublas_calls.cpp) are plain C++ in every build.
function(dmuon_add_cuda_sources target)
  file(GLOB _cuda_sources CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/backend/cuda/*.cu
       ${PROJECT_SOURCE_DIR}/src/backend/rules/*.cu)
  add_library(${target}_cuda OBJECT ${_cuda_sources})
  target_include_directories(${target}_cuda PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(${target}_cuda PRIVATE CUDA::cudart CUDA::cublas)
  target_sources(${target} PRIVATE $<TARGET_OBJECTS:${target}_cuda>)
  target_compile_definitions(${target} PUBLIC DMUON_HAVE_CUDA)
  # Public: code above the backend (tests, the tuner's GPU key) includes the backend's CUDA header.
  target_link_libraries(${target} PUBLIC CUDA::cudart CUDA::cublas)
endfunction()

# dmuon_gpu_check (bench/gpu_check): the GPU checks and `bench ns` on the GPU (bench/device_ns_bench.cpp) over
# `library`, with the ctest `gpu_check` (exit 77 without a device: reported as skipped). Beside the library's public
# headers it includes the backend's top-level internal headers (src/backend/*.hpp: bf16 rounding, the CUDA runtime
# check), the update rules' element code (src/backend/rules/<rule>.hpp: its host loops are the references) and the
# tests' float64 Newton–Schulz reference (tests/support).
function(dmuon_add_gpu_check library)
  add_executable(dmuon_gpu_check ${PROJECT_SOURCE_DIR}/bench/gpu_check/gpu_check.cpp
                                 ${PROJECT_SOURCE_DIR}/bench/gpu_check/kernel_checks.cpp
                                 ${PROJECT_SOURCE_DIR}/bench/gpu_check/muon_step_bench.cpp
                                 ${PROJECT_SOURCE_DIR}/bench/device_ns_bench.cpp)
  target_include_directories(dmuon_gpu_check PRIVATE ${PROJECT_SOURCE_DIR}/src ${PROJECT_SOURCE_DIR}/bench
                                                     ${PROJECT_SOURCE_DIR}/tests/support)
  target_link_libraries(dmuon_gpu_check PRIVATE ${library} CUDA::cudart CUDA::cublas)
  # At the top of the build folder in every build (the full one declares it in bench/), where scripts/gpu-check.sh runs it.
  set_target_properties(dmuon_gpu_check PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR})
  enable_testing()
  add_test(NAME gpu_check COMMAND dmuon_gpu_check test)
  set_tests_properties(gpu_check PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 300)
endfunction()
