// MuonApply on the CPU backend: muon_apply.hpp's loop over host memory, keep (host memory here) read once.
#include "backend/rules/launch.hpp"
#include "backend/rules/muon_apply.hpp"

namespace dmuon::rules {

template <>
void run_on_cpu(const MuonApply& rule) {
  muon_apply_loop(rule.w.data(), rule.o.data(), static_cast<int64_t>(rule.w.size()), rule.decay, rule.neg_lr,
                  rule.scale, !rule.keep || *rule.keep != 0.0f, rule.cautious_wd);
}

}  // namespace dmuon::rules
