// The MILP balancer in a build without CBC (the Python package's or the GPU-only build on a machine without it,
// src/CMakeLists.txt): no solution, so make_plan falls back to the LPT start and says why in Plan::note.
// Builds with CBC have milp.cpp instead.
#include "milp.hpp"

namespace dmuon::detail {

MilpResult balance_milp(const std::vector<PlanItem>&, int, int64_t, const std::vector<int>&, double,
                        const PlanOptions&) {
  return {{}, false, "this build of dmuon has no CBC (built without coinor-libcbc): no MILP solve"};
}

}  // namespace dmuon::detail
