// cpu_bf16.hpp's general products in a build without oneDNN (CMakeLists.txt: DMUON_ONEDNN off or libdnnl-dev
// missing): the CPU backend computes in float32 only, and a bf16 product is an error that says why.
#include "backend/cpu_bf16.hpp"
#include "dmuon/error.hpp"

namespace dmuon::cpu_bf16 {

namespace {
[[noreturn]] void missing() {
  DMUON_FAIL("bfloat16 products on the CPU need oneDNN: this build has none (install libdnnl-dev and reconfigure)");
}
}  // namespace

bool available() { return false; }
bool native() { return false; }
bool matrix_units() { return false; }
std::string description() { return "no oneDNN"; }

void gemm(bool, bool, int64_t, int64_t, int64_t, float, const uint16_t*, int64_t, const uint16_t*, int64_t, float,
          uint16_t*, int64_t) {
  missing();
}
void gemm_f32(bool, bool, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t, float, float*,
              int64_t) {
  missing();
}

}  // namespace dmuon::cpu_bf16
