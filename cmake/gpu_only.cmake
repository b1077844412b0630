# The GPU subset (-DDMUON_GPU_ONLY=ON, docs/gpu.md): for a GPU machine without our Debian libraries, one process.
# CMakeLists.txt builds it as the Python package's lean build (libdmuon_c and python/dmuon with the CUDA backend,
# whatever of OpenBLAS, CBC and nlohmann-json it finds; no MPI, NCCL, CLI11 or GoogleTest), and this file adds the
# check tool dmuon_gpu_check on the backend and Newton–Schulz layers. CI configures and builds it with every Debian
# library hidden (the gpu_only_build test), as on the GPU machine.
# Whole: every object of these layers is linked, so a symbol that none of them defines fails this build instead of
# hiding until a caller first needs the object that uses it (libdmuon_c's --no-undefined checks what it links).
dmuon_add_gpu_check(dmuon_ns)
foreach(_layer dmuon_io dmuon_backend dmuon_ns)
  set_property(TARGET dmuon_gpu_check PROPERTY LINK_LIBRARY_OVERRIDE_${_layer} WHOLE_ARCHIVE)
endforeach()
message(STATUS "dmuon: GPU-only build: libdmuon_c (dmuon_python) and dmuon_gpu_check")
