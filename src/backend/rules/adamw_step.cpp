// AdamWStep on the CPU backend: adamw_step.hpp's loop over host memory. Built with -fno-math-errno
// (src/CMakeLists.txt): the sqrt then vectorizes, with the same IEEE-rounded results.
#include "backend/rules/adamw_step.hpp"
#include "backend/rules/launch.hpp"

namespace dmuon::rules {

template <>
void run_on_cpu(const AdamWStep& rule) {
  adamw_step_loop(rule.p.data(), rule.grad.data(), rule.grad_scale, rule.m.data(), rule.v.data(),
                  static_cast<int64_t>(rule.p.size()), rule.k);
}

}  // namespace dmuon::rules
