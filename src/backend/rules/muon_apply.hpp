// MuonApply's element (dmuon/update_rules.hpp): W ← W·decay + neg_lr·(O·scale), with cautious_wd W·decay only where
// W·O ≥ 0 (W elsewhere); W as it is where keep is false. For the CPU loop, the CUDA kernel and dmuon_gpu_check's
// host reference.
#pragma once

#include <cstdint>

#include "backend/rules/arithmetic.hpp"

namespace dmuon::rules {

DMUON_HOST_DEVICE inline void muon_apply_at(int64_t i, float* w, const float* o, float decay, float neg_lr,
                                            float scale, bool cautious_wd) {
  const float wi = w[i];
  const float decayed = cautious_wd && !(mul(wi, o[i]) >= 0.0f) ? wi : mul(wi, decay);
  w[i] = add(decayed, mul(neg_lr, mul(o[i], scale)));
}

inline void muon_apply_loop(float* w, const float* o, int64_t n, float decay, float neg_lr, float scale, bool keep,
                            bool cautious_wd) {
  if (!keep) return;
  for (int64_t i = 0; i < n; ++i) muon_apply_at(i, w, o, decay, neg_lr, scale, cautious_wd);
}

}  // namespace dmuon::rules
