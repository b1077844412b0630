// MuonApply on the CUDA backend: muon_apply.hpp's element as a grid-stride kernel that reads keep on the device
// (false: no element is written).
#include "backend/cuda_support.hpp"
#include "backend/rules/launch.hpp"
#include "backend/rules/muon_apply.hpp"

namespace dmuon::rules {

namespace {

__global__ void muon_apply_kernel(float* w, const float* o, int64_t n, float decay, float neg_lr, float scale,
                                  const float* keep, bool cautious_wd) {
  if (keep && *keep == 0.0f) return;
  DMUON_FOR_EACH(i, n) muon_apply_at(i, w, o, decay, neg_lr, scale, cautious_wd);
}

}  // namespace

template <>
void run_on_cuda(const MuonApply& rule, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(rule.w.size());
  if (n == 0) return;
  muon_apply_kernel<<<cuda::grid_for(n), cuda::kThreads, 0, stream>>>(rule.w.data(), rule.o.data(), n, rule.decay,
                                                                      rule.neg_lr, rule.scale, rule.keep,
                                                                      rule.cautious_wd);
  cuda::check_launch();
}

}  // namespace dmuon::rules
