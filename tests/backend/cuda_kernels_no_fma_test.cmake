cmake_minimum_required(VERSION 3.25)
# The CUDA kernels round as the CPU backend does (src/backend/cuda/kernels.hpp; the update rules,
# src/backend/rules/arithmetic.hpp; the NCCL communicator's block reduction, src/nccl/comm_kernels.cu, sums in rank
# order): no multiply and add fused into one FMA, which nvcc does by default for a * b + c (its -fmad=true), so each
# kernel spells its arithmetic in explicitly rounded intrinsics. Checked without a GPU: every kernel file (the
# rules' found by glob) compiled to PTX (compute_90, as the build) holds no fma.rn instruction. (The double
# division and square root in the norms are single PTX instructions, div.rn.f64 and sqrt.rn.f64.) Fails naming
# each kernel that has one.
#   -DNVCC=<nvcc> -DSOURCE_DIR=<repo> -DOUT=<scratch folder>
file(MAKE_DIRECTORY ${OUT})
set(problems "")
file(GLOB rules RELATIVE ${SOURCE_DIR}/src ${SOURCE_DIR}/src/backend/rules/*.cu)
if(NOT rules)
  message(FATAL_ERROR "no update rule kernels found in ${SOURCE_DIR}/src/backend/rules")
endif()
list(TRANSFORM rules REPLACE "\\.cu$" "")
set(files backend/cuda/matrix_kernels nccl/comm_kernels ${rules})
foreach(file IN LISTS files)
  get_filename_component(name ${file} NAME)
  execute_process(COMMAND ${NVCC} -std=c++20 -ptx -arch=compute_90 -I${SOURCE_DIR}/include -I${SOURCE_DIR}/src
                          ${SOURCE_DIR}/src/${file}.cu -o ${OUT}/${name}.ptx
                  RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "nvcc -ptx ${name}.cu failed: ${err}")
  endif()
  file(STRINGS ${OUT}/${name}.ptx lines REGEX "^(\\.visible )?\\.entry |fma\\.rn")
  set(kernel "")
  foreach(line IN LISTS lines)
    if(line MATCHES "\\.entry ([^(]+)")
      set(kernel ${CMAKE_MATCH_1})
    elseif(line MATCHES "fma\\.rn")
      string(STRIP "${line}" line)
      string(APPEND problems "${name}.cu, kernel ${kernel}: ${line}\n")
    endif()
  endforeach()
endforeach()
if(problems)
  message(FATAL_ERROR "fused multiply-adds in kernels that must round as the CPU:\n${problems}")
endif()
list(JOIN files ".cu, " shown)
message(STATUS "no fma.rn in ${shown}.cu")
