// A build without OpenBLAS (a lean build: the Python package's or the GPU-only one, CMakeLists.txt) has no CPU
// backend: asking for it is an error, and the CPU's answers that need BLAS say there is none. Builds with OpenBLAS
// skip this file (src/CMakeLists.txt) and have src/backend/cpu/ instead.
#include <cstdlib>
#include <string>

#include "dmuon/backend.hpp"
#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"

namespace dmuon {

Backend& cpu_backend() {
  DMUON_FAIL("this build of dmuon has no CPU backend (built without OpenBLAS); use backend_for(DeviceKind::cuda)");
}

int cpu_device_count() { return 0; }

// No CPU computes here: the rule without bf16 matrix units, DMUON_NS_DEFAULT_DTYPE still obeyed.
DType cpu_ns_default_dtype() {
  static const DType dtype = ns_default_dtype_rule(false, std::getenv("DMUON_NS_DEFAULT_DTYPE"));
  return dtype;
}

bool cpu_ns_bf16_candidate() {
  static const bool candidate = ns_bf16_candidate_rule(false, std::getenv("DMUON_NS_DEFAULT_DTYPE"));
  return candidate;
}

namespace linalg {

std::string blas_description() { return "none (built without OpenBLAS)"; }

}  // namespace linalg

}  // namespace dmuon
