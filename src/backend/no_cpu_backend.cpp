// The GPU-only build (cmake/gpu_only.cmake) has no OpenBLAS, hence no CPU backend: asking for it is an error.
// The full build skips this file (src/CMakeLists.txt) and has src/backend/cpu/ instead.
#include "dmuon/backend.hpp"
#include "dmuon/error.hpp"

namespace dmuon {

Backend& cpu_backend() {
  DMUON_FAIL("this GPU-only build of dmuon (DMUON_GPU_ONLY=ON) has no CPU backend; use backend_for(DeviceKind::cuda)");
}

int cpu_device_count() { return 0; }

}  // namespace dmuon
