// The NS engine's kernel sequence (ns.hpp: ns_kernel_calls), recorded by running the engine on a RecordingBackend:
// the one source the planner's flop counts and the simulator's kernel list read.
#include "dmuon/backend_record.hpp"
#include "dmuon/error.hpp"
#include "dmuon/ns.hpp"

namespace dmuon {

std::vector<KernelCall> ns_kernel_calls(int64_t rows, int64_t cols, int batch, const NsOptions& options,
                                        int64_t preferred_batch) {
  DMUON_CHECK(rows >= 0 && cols >= 0 && batch >= 0, "ns_kernel_calls: shape ", rows, "x", cols, " batch ", batch);
  RecordingBackend rec(preferred_batch);
  std::vector<Buffer> buffers;
  std::vector<MatView> views;
  for (int i = 0; i < batch; ++i) {
    buffers.emplace_back(rec, DType::f32, rows * cols);
    views.push_back(buffers.back().view(rows, cols));
  }
  NsOptions o = options;
  o.threads = 0;
  // The norms stay on the device, as in the optimizer's step (its one read per update is not NS's).
  const Buffer norms(rec, DType::f32, 2 * static_cast<int64_t>(batch));
  newton_schulz_batched(rec, views, views, o, {}, reinterpret_cast<double*>(norms.data()));
  buffers.clear();
  ns_release_workspaces(&rec);
  return rec.calls();
}

double total_flops(const std::vector<KernelCall>& calls, bool full) {
  double sum = 0;
  for (const KernelCall& c : calls) sum += full ? c.full_flops : c.flops;
  return sum;
}

}  // namespace dmuon
