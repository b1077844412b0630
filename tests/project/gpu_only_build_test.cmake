# The GPU-only configuration (-DDMUON_GPU_ONLY=ON, cmake/gpu_only.cmake: what scripts/gpu-check.sh builds on a GPU
# machine without our Debian libraries) configures and builds dmuon_gpu_check, linked with every object of its
# library, so that neither rots where no GPU runs them. About 2 minutes on one core (docs/gpu.md).
#   -DSOURCE_DIR=<repo> -DBUILD_DIR=<scratch build folder> -DCXX=<g++> -DNVCC=<nvcc>
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${BUILD_DIR} -DCMAKE_BUILD_TYPE=Release -DDMUON_CUDA=ON
                        -DDMUON_GPU_ONLY=ON -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_CUDA_COMPILER=${NVCC}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "configuring the GPU-only build failed:\n${out}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --parallel 1 --target dmuon_gpu_check
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the GPU-only dmuon_gpu_check failed:\n${out}")
endif()
message(STATUS "the GPU-only build configures and builds dmuon_gpu_check")
