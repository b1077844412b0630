// Accumulate on the CPU backend: accumulate.hpp's loop over host memory.
#include "backend/rules/accumulate.hpp"
#include "backend/rules/launch.hpp"

namespace dmuon::rules {

template <>
void run_on_cpu(const Accumulate& rule) {
  accumulate_loop(rule.acc.data(), rule.grad.data(), static_cast<int64_t>(rule.acc.size()), rule.first);
}

}  // namespace dmuon::rules
