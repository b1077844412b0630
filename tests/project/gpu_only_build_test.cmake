# The GPU-only configuration (-DDMUON_GPU_ONLY=ON, cmake/gpu_only.cmake: what scripts/gpu-check.sh builds on a GPU
# machine) with every Debian library hidden, as that machine most likely lacks them (no pkg-config, so no OpenBLAS
# or CBC, and no nlohmann-json): configures, builds dmuon_gpu_check (linked with every object of the io, backend and
# Newton–Schulz layers) and libdmuon_c with python/dmuon (dmuon_python), and runs tests/python/gpu_only_capi_check.py
# with them, so that none of it rots where no GPU runs it (docs/gpu.md).
#   -DSOURCE_DIR=<repo> -DBUILD_DIR=<scratch build folder> -DCXX=<g++> -DNVCC=<nvcc> -DPYTHON=<python with torch, or
#   empty: the Python check is left out>
set(python_arg "")
if(PYTHON)
  set(python_arg -DPython3_EXECUTABLE=${PYTHON})
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${BUILD_DIR} -DCMAKE_BUILD_TYPE=Release -DDMUON_CUDA=ON
                        -DDMUON_GPU_ONLY=ON -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_CUDA_COMPILER=${NVCC}
                        ${python_arg} -DCMAKE_DISABLE_FIND_PACKAGE_PkgConfig=ON
                        -DCMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=ON
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the GPU-only build failed:\n${out}")
endif()
set(lacks "dmuon: lean build without OpenBLAS (no CPU backend: CUDA tensors only); CBC (the milp balancer falls back to LPT); nlohmann-json (no tuning cache file, no model manifests)")
string(FIND "${out}" "${lacks}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "the GPU-only configure does not say what it goes without (\"${lacks}\"):\n${out}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --parallel 1 --target dmuon_gpu_check dmuon_python
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the GPU-only dmuon_gpu_check and libdmuon_c failed:\n${out}")
endif()
if(NOT PYTHON)
  message(STATUS "no Python with torch: dmuon.torch with the GPU-only libdmuon_c is not checked")
  return()
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=DMUON_C_LIBRARY PYTHONPATH=${BUILD_DIR}/python
                        ${PYTHON} ${SOURCE_DIR}/tests/python/gpu_only_capi_check.py
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "dmuon.torch with the GPU-only libdmuon_c failed:\n${out}")
endif()
message(STATUS "the GPU-only build (no Debian library) builds dmuon_gpu_check and libdmuon_c, and DMuon runs with it")
