// What dmuon_ns_run, dmuon_adamw_step and the Muon update calls (include/dmuon/dmuon_c.h) do once the C ABI has
// checked its arguments and chosen a backend: the same calls for the CPU, for the CUDA backend (its stream joined to the caller's,
// cuda_caller_stream.hpp) and for the tests' fenced device. The caller's data is in the backend's memory, in its
// storage type: float32 is used in place; bfloat16 is widened into float32 staging (exact), computed there
// (Newton–Schulz iterates in its compute dtype, ns_compute_dtype) and rounded back once per value.
// The staging touches the data only through backend operations (convert), so no host access to device memory.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dmuon/backend.hpp"
#include "dmuon/ns.hpp"
#include "dmuon/tune.hpp"
#include "dmuon/update_rules.hpp"

namespace dmuon::capi {

// A handle's float32 staging per backend, grown on demand and kept, so repeated calls reuse its addresses
// (and a GPU its recorded graphs). Its end (dmuon_ns_destroy, a thread's exit for the calls' per-thread staging)
// frees each backend's buffers under that backend's hold, as a call would: a CUDA backend's deallocation drops
// graphs from the cache that another thread's call may be using (and keeps the caller's current device).
class Staging {
 public:
  Staging() = default;
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;
  ~Staging();
  // At least `elements` float32 values on `backend`.
  float* take(Backend& backend, int64_t elements);
  // At least `count` doubles on `backend`: the input norms of an unchecked Newton–Schulz call.
  double* norms(Backend& backend, int64_t count);
  // The float32 values (take's and norms' together) held on `backend`.
  int64_t elements(const Backend& backend) const;

 private:
  std::map<const Backend*, Buffer> buffers_, norms_;
};

// Holds `backend` for one C ABI call: a CUDA backend (its stream, cuBLAS handle, graph cache and capture flag) is one
// per device, shared by every thread that calls the C ABI, whose functions are reentrant (cuda_caller_stream.cpp
// takes it for the whole call; the CPU backend is thread-safe and is not held).
std::unique_lock<std::mutex> hold(const Backend& backend);

// A call's order with its caller's queue (on a GPU two events, cuda_caller_stream.cpp): the backend's queue waits
// for what the caller queued before the call, and the caller's queue for the call's work.
struct QueueJoin {
  std::function<void()> backend_waits_for_caller, caller_waits_for_backend;
};
// Holds `backend` (hold) and runs join.backend_waits_for_caller, work, then join.caller_waits_for_backend, the last
// even when work throws (the caller's queue must not run ahead of what the work did queue); rethrows after it.
void run_joined(Backend& backend, const QueueJoin& join, const std::function<void(Backend&)>& work);

// Newton–Schulz's compute dtype (its iterates' storage; products accumulate in float32) for data stored as `storage`
// on `backend`: `asked` (dmuon_ns_set_dtype) when the caller chose one, never inferred from the data; else the
// device's default: on the CPU cpu_ns_default_dtype (bf16 with bf16 matrix units, else float32), on a GPU the storage's (bf16
// data: bf16 iterates). Throws naming the device when it cannot compute in the dtype asked for.
DType ns_compute_dtype(const Backend& backend, std::optional<DType> asked, DType storage);

// A handle's tuned kernels, timed on the CPU (tune.hpp): per compute dtype a caller may ask for, and `chosen`, those
// tuned among cpu_auto_tune_dtypes() for calls that ask for none, each in its faster dtype.
struct TunedEntries {
  std::map<DType, std::vector<TuneEntry>> by_dtype;
  std::vector<TuneEntry> chosen;
};

// The options of one call of `batch` rows×cols matrices of `storage` on `backend`, the compute dtype `asked` for or
// none: unasked on the CPU where `tuned.chosen` has the shape, that entry's kernel in its dtype (chosen by
// measurement); else in ns_compute_dtype(backend, asked, storage), the kernel tuned for that dtype where
// `tuned.by_dtype` has the shape (on the CPU: a GPU runs `defaults`), else `defaults`. bf16 with DESIGN 2.2's
// half-precision restarts unless `defaults` or the entry set others. An asked dtype is never replaced. `tuned_out`
// (optional): whether a tuned entry gave the kernel.
NsOptions call_ns_options(const Backend& backend, const TunedEntries& tuned, const NsOptions& defaults,
                          std::optional<DType> asked, DType storage, int64_t rows, int64_t cols, int64_t batch,
                          bool* tuned_out = nullptr);

// O_i = orth(U_i) for in.size() rows×cols matrices of `storage` at in[i] / out[i] (dense, row-major; out[i] may
// equal in[i]) in `backend`'s memory, computing as `options` says (call_ns_options). check_finite: the inputs' norms are read back and a non-finite input throws,
// naming it (on a GPU the host then waits for everything queued before); false: the norms stay in the staging,
// nothing is read back and a non-finite input gives non-finite outputs (for callers that check their gradients).
void ns_run(Backend& backend, DType storage, std::span<const void* const> in, std::span<void* const> out,
            int64_t rows, int64_t cols, const NsOptions& options, std::span<const std::string> names,
            Staging& staging, bool check_finite = true);


// One tensor of a multi-tensor call: `data` in the caller's storage type, `size` elements.
struct Operand {
  void* data = nullptr;
  DType dtype = DType::f32;
};

// The values a Muon step keeps on the device (dmuon_c.h): per tensor a pointer to its keep flag (null: kept), and
// the gradients' factor (null: 1). The host never reads them.
struct StepFlags {
  std::span<const float* const> keep;  // one per tensor, or empty: every tensor is updated
  const float* grad_scale = nullptr;
  const float* keep_of(size_t i) const { return keep.empty() ? nullptr : keep[i]; }
};

// Muon's momentum for tensors i of sizes[i] values: M_i ← lerp(M_i, g_i, 1−β),
// U_i = nesterov ? lerp(g_i, M_i, β) : M_i
// (rules::MuonMomentum; grads[i].data null: a zero gradient). float32 operands are used in place, bfloat16 ones widened
// into `staging` and rounded back once (staging is taken only when some operand is bfloat16).
void muon_momentum_run(Backend& backend, std::span<const int64_t> sizes, std::span<const Operand> grads,
                       std::span<const Operand> momenta, std::span<const Operand> u, const StepFlags& flags,
                       double beta, bool nesterov, Staging& staging);

// W_i ← W_i·(1 − lr·wd) − lr·(O_i·scales[i]) where kept (rules::MuonApply; cautious_wd: the decay where W·O ≥ 0
// only), operands as muon_momentum_run's.
void muon_apply_run(Backend& backend, std::span<const int64_t> sizes, std::span<const Operand> w,
                    std::span<const Operand> o, const StepFlags& flags, double lr, double weight_decay,
                    std::span<const double> scales, bool cautious_wd, Staging& staging);

// The whole update of w.size() rows×cols matrices held here: momentum into a float32 U in `staging`, O = orth(U) in
// place with `options` (check_finite as ns_run's), then the apply with `scale` and cautious_wd. The staging holds the
// U stack, and room for three widened matrices only when some operand is bfloat16.
void muon_update_run(Backend& backend, int64_t rows, int64_t cols, std::span<const Operand> grads,
                     std::span<const Operand> momenta, std::span<const Operand> w, const StepFlags& flags, double beta,
                     bool nesterov, double lr, double weight_decay, double scale, bool cautious_wd,
                     const NsOptions& options, std::span<const std::string> names, Staging& staging,
                     bool check_finite);

// One AdamW step (constants k) on n values of `storage` at p, grad, m, v in `backend`'s memory, in place.
void adamw_run(Backend& backend, DType storage, void* p, const void* grad, void* m, void* v, int64_t n,
               const AdamWStepConstants& k, float grad_scale, Staging& staging);

}  // namespace dmuon::capi
