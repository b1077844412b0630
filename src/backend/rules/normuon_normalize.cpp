// NorMuonNormalize on the CPU backend: normuon_normalize.hpp's loop over host memory.
#include "backend/rules/launch.hpp"
#include "backend/rules/normuon_normalize.hpp"

namespace dmuon::rules {

template <>
void run_on_cpu(const NorMuonNormalize& rule) {
  normuon_normalize_loop(rule.o.data(), rule.v.data(), rule.rows, rule.cols, rule.one_minus_beta2);
}

}  // namespace dmuon::rules
