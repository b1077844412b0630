// The C ABI's work on a backend (abi_calls.hpp).
#include "capi/abi_calls.hpp"

#include <algorithm>
#include <array>
#include <exception>
#include <initializer_list>
#include <utility>
#include <vector>

#include "dmuon/error.hpp"
#include "dmuon/update_rules.hpp"

namespace dmuon::capi {

namespace {

// `count` dense rows×cols matrices of `dtype` at `data` (one matrix: count 1).
MatView dense_view(const Backend& backend, void* data, DType dtype, int64_t rows, int64_t cols, int64_t count = 1) {
  MatView v;
  v.data = data;
  v.device = backend.device();
  v.dtype = dtype;
  v.rows = rows;
  v.cols = cols;
  v.ld = cols;
  v.count = count;
  v.batch_stride = rows * cols;
  return v;
}

// AdamW's bf16 values per staged pass: a CPU pass stays in cache; a GPU pass is a few large kernels.
int64_t adamw_chunk(const Backend& backend) { return backend.host_memory() ? int64_t{1} << 16 : int64_t{1} << 24; }

// At least `elements` float32 values on `backend` in `buffers`, grown on demand.
float* grown(std::map<const Backend*, Buffer>& buffers, Backend& backend, int64_t elements) {
  Buffer& b = buffers[&backend];
  if (b.size() < elements) b = Buffer(backend, DType::f32, elements);
  return b.f32();
}

}  // namespace

std::unique_lock<std::mutex> hold(const Backend& backend) {
  static std::mutex registry;
  static std::map<const Backend*, std::mutex> locks;  // map nodes stay put: a reference outlives the registry lock
  std::mutex* lock = nullptr;
  {
    const std::lock_guard<std::mutex> guard(registry);
    lock = &locks[&backend];
  }
  return std::unique_lock<std::mutex>(*lock);
}

void run_joined(Backend& backend, const QueueJoin& join, const std::function<void(Backend&)>& work) {
  const auto held = hold(backend);
  join.backend_waits_for_caller();
  std::exception_ptr failure;
  try {
    work(backend);
  } catch (...) {
    failure = std::current_exception();
  }
  join.caller_waits_for_backend();
  if (failure) std::rethrow_exception(failure);
}

Staging::~Staging() {
  for (auto* buffers : {&buffers_, &norms_}) {
    for (auto& [backend, buffer] : *buffers) {
      const auto held = hold(*backend);
      buffer = Buffer();
    }
  }
}

float* Staging::take(Backend& backend, int64_t elements) { return grown(buffers_, backend, elements); }

int64_t Staging::elements(const Backend& backend) const {
  int64_t n = 0;
  for (const auto* buffers : {&buffers_, &norms_}) {
    const auto it = buffers->find(&backend);
    if (it != buffers->end()) n += it->second.size();
  }
  return n;
}

double* Staging::norms(Backend& backend, int64_t count) {
  return reinterpret_cast<double*>(grown(norms_, backend, 2 * count));  // two float32 slots per double
}

DType ns_compute_dtype(const Backend& backend, std::optional<DType> asked, DType storage) {
  const DType compute = asked ? *asked : backend.device() == DeviceKind::cpu ? cpu_ns_default_dtype() : storage;
  DMUON_CHECK(backend.supports(compute), "Newton-Schulz in ", to_string(compute), " is not supported by ",
              backend.description());
  return compute;
}

NsOptions call_ns_options(const Backend& backend, const TunedEntries& tuned, const NsOptions& defaults,
                          std::optional<DType> asked, DType storage, int64_t rows, int64_t cols, int64_t batch,
                          bool* tuned_out) {
  const auto has_shape = [&](const std::vector<TuneEntry>& entries) {
    return std::any_of(entries.begin(), entries.end(), [&](const TuneEntry& t) { return t.rows == rows && t.cols == cols; });
  };
  NsOptions e;
  bool from_entry = false;
  if (!asked && backend.host_memory() && has_shape(tuned.chosen)) {
    from_entry = true;
    e = tuned_options(tuned.chosen, rows, cols, static_cast<int>(batch), defaults);  // its dtype: the faster one
    DMUON_CHECK(backend.supports(e.dtype), "Newton-Schulz in ", to_string(e.dtype), " (tuned for ", rows, "x", cols,
                ") is not supported by ", backend.description());
  } else {
    const DType compute = ns_compute_dtype(backend, asked, storage);
    const auto entries = tuned.by_dtype.find(compute);
    from_entry = entries != tuned.by_dtype.end() && backend.host_memory() && has_shape(entries->second);
    e = entries == tuned.by_dtype.end() || !backend.host_memory()
            ? defaults
            : tuned_options(entries->second, rows, cols, static_cast<int>(batch), defaults);
    e.dtype = compute;
  }
  if (tuned_out) *tuned_out = from_entry;
  if (e.dtype == DType::bf16 && e.restarts == NsOptions{}.restarts) e.restarts = {1, 3};  // DESIGN 2.2: half precision
  return e;
}

void ns_run(Backend& backend, DType storage, std::span<const void* const> in, std::span<void* const> out,
            int64_t rows, int64_t cols, const NsOptions& options, std::span<const std::string> names,
            Staging& staging, bool check_finite) {
  DMUON_CHECK(in.size() == out.size(), "ns_run: ", in.size(), " inputs but ", out.size(), " outputs");
  const auto batch = static_cast<int64_t>(in.size());
  const NsOptions& e = options;
  double* norms = check_finite ? nullptr : staging.norms(backend, batch);
  std::vector<MatView> u(in.size()), o(in.size());
  if (storage == DType::f32) {
    for (size_t i = 0; i < in.size(); ++i) {
      u[i] = dense_view(backend, const_cast<void*>(in[i]), DType::f32, rows, cols);
      o[i] = dense_view(backend, out[i], DType::f32, rows, cols);
    }
    newton_schulz_batched(backend, u, o, e, names, norms);
    return;
  }
  // bf16: widen into the staging, orthogonalize there in place, round back into out.
  float* wide = staging.take(backend, batch * rows * cols);
  for (int64_t i = 0; i < batch; ++i) {
    u[i] = dense_view(backend, wide + i * rows * cols, DType::f32, rows, cols);
    backend.convert(dense_view(backend, const_cast<void*>(in[i]), DType::bf16, rows, cols), u[i]);
  }
  newton_schulz_batched(backend, u, u, e, names, norms);
  for (int64_t i = 0; i < batch; ++i) backend.convert(u[i], dense_view(backend, out[i], DType::bf16, rows, cols));
}

namespace {

// An operand's values as float32 on the backend: the operand itself when float32, else `slot` (room for its
// values), filled from it when `read`.
float* widened(Backend& backend, const Operand& x, int64_t n, float* slot, bool read) {
  if (x.dtype == DType::f32) return static_cast<float*>(x.data);
  if (read) backend.convert(dense_view(backend, x.data, x.dtype, 1, n), dense_view(backend, slot, DType::f32, 1, n));
  return slot;
}

// Rounds `wide` back into the operand when it is not float32 (wide is then its slot).
void narrowed(Backend& backend, const float* wide, const Operand& x, int64_t n) {
  if (x.dtype == DType::f32) return;
  backend.convert(dense_view(backend, const_cast<float*>(wide), DType::f32, 1, n),
                  dense_view(backend, x.data, x.dtype, 1, n));
}

// K slots of n float32 values one after another from base (all nullptr where base is: no operand needs one).
template <size_t K>
std::array<float*, K> consecutive(float* base, int64_t n) {
  std::array<float*, K> out{};
  if (base != nullptr)
    for (size_t k = 0; k < K; ++k) out[k] = base + static_cast<int64_t>(k) * n;
  return out;
}

// One tensor's momentum: the rule on n values, U written to `u` (float32, or its slot and rounded back). slots: the
// float32 room of grad, momentum and u where they are narrower (nullptr where float32).
void momentum_of(Backend& backend, int64_t n, const Operand& grad, const Operand& momentum, const Operand& u,
                 const float* keep, const StepFlags& flags, double beta, bool nesterov, std::array<float*, 3> slots) {
  rules::MuonMomentum rule;
  if (grad.data != nullptr) rule.grad = {backend, widened(backend, grad, n, slots[0], true), static_cast<size_t>(n)};
  float* m = widened(backend, momentum, n, slots[1], true);
  float* out = widened(backend, u, n, slots[2], false);
  rule.momentum = {backend, m, static_cast<size_t>(n)};
  rule.u = {backend, out, static_cast<size_t>(n)};
  rule.one_minus_beta = static_cast<float>(1.0 - beta);  // rounded from double separately, as torch's lerp_ weights
  rule.beta = static_cast<float>(beta);
  rule.nesterov = nesterov;
  rule.device_grad_scale = flags.grad_scale;
  rule.keep = keep;
  backend.run(UpdateRule{rule});
  narrowed(backend, m, momentum, n);
  narrowed(backend, out, u, n);
}

// One tensor's apply: W ← W·decay + (−lr)·(O·scale) where kept (cautious_wd: the decay where W·O ≥ 0 only). slots:
// the float32 room of W and O where they are narrower (nullptr where float32).
void apply_of(Backend& backend, int64_t n, const Operand& w, const Operand& o, const float* keep, double lr,
              double weight_decay, double scale, bool cautious_wd, std::array<float*, 2> slots) {
  rules::MuonApply rule;
  float* wide_w = widened(backend, w, n, slots[0], true);
  rule.w = {backend, wide_w, static_cast<size_t>(n)};
  rule.o = {backend, widened(backend, o, n, slots[1], true), static_cast<size_t>(n)};
  rule.decay = static_cast<float>(1.0 - lr * weight_decay);
  rule.neg_lr = static_cast<float>(-lr);
  rule.scale = static_cast<float>(scale);
  rule.keep = keep;
  rule.cautious_wd = cautious_wd;
  backend.run(UpdateRule{rule});
  narrowed(backend, wide_w, w, n);
}

int64_t largest(std::span<const int64_t> sizes) {
  int64_t n = 0;
  for (int64_t s : sizes) n = std::max(n, s);
  return n;
}

// Whether an operand of the lists (a null one aside: a zero gradient) is stored narrower than float32, and so needs
// a float32 slot of the staging.
bool any_narrow(std::initializer_list<std::span<const Operand>> lists) {
  for (const auto& list : lists)
    for (const Operand& x : list)
      if (x.data != nullptr && x.dtype != DType::f32) return true;
  return false;
}

}  // namespace

void muon_momentum_run(Backend& backend, std::span<const int64_t> sizes, std::span<const Operand> grads,
                       std::span<const Operand> momenta, std::span<const Operand> u, const StepFlags& flags,
                       double beta, bool nesterov, Staging& staging) {
  float* slots = any_narrow({grads, momenta, u}) ? staging.take(backend, 3 * largest(sizes)) : nullptr;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) continue;  // an empty tensor (a rank without rows of a matrix) has nothing to update
    momentum_of(backend, sizes[i], grads[i], momenta[i], u[i], flags.keep_of(i), flags, beta, nesterov,
                consecutive<3>(slots, sizes[i]));
  }
}

void muon_apply_run(Backend& backend, std::span<const int64_t> sizes, std::span<const Operand> w,
                    std::span<const Operand> o, const StepFlags& flags, double lr, double weight_decay,
                    std::span<const double> scales, bool cautious_wd, Staging& staging) {
  float* slots = any_narrow({w, o}) ? staging.take(backend, 2 * largest(sizes)) : nullptr;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] > 0)
      apply_of(backend, sizes[i], w[i], o[i], flags.keep_of(i), lr, weight_decay, scales[i], cautious_wd,
               consecutive<2>(slots, sizes[i]));
  }
}

void muon_update_run(Backend& backend, int64_t rows, int64_t cols, std::span<const Operand> grads,
                     std::span<const Operand> momenta, std::span<const Operand> w, const StepFlags& flags, double beta,
                     bool nesterov, double lr, double weight_decay, double scale, bool cautious_wd,
                     const NsOptions& options, std::span<const std::string> names, Staging& staging,
                     bool check_finite) {
  const auto batch = static_cast<int64_t>(w.size());
  const int64_t n = rows * cols;
  // [U_0 … U_{batch−1} | a float32 slot of one matrix for each of grads, momenta and w that holds a bfloat16 operand]
  // (bfloat16 state of float32 parameters: the momentum's alone)
  const std::array<bool, 3> narrow{any_narrow({grads}), any_narrow({momenta}), any_narrow({w})};
  float* stack = staging.take(backend, (batch + std::count(narrow.begin(), narrow.end(), true)) * n);
  std::array<float*, 3> slot{};  // the gradients', the momenta's, the weights'; nullptr where all are float32
  float* next = stack + batch * n;
  for (size_t k = 0; k < slot.size(); ++k)
    if (narrow[k]) slot[k] = std::exchange(next, next + n);
  double* norms = check_finite ? nullptr : staging.norms(backend, batch);
  std::vector<MatView> u(w.size());
  for (int64_t i = 0; i < batch; ++i) {
    const Operand ui{stack + i * n, DType::f32};
    momentum_of(backend, n, grads[i], momenta[i], ui, flags.keep_of(i), flags, beta, nesterov,
                {slot[0], slot[1], nullptr});
    u[i] = dense_view(backend, ui.data, DType::f32, rows, cols);
  }
  newton_schulz_batched(backend, u, u, options, names, norms);
  for (int64_t i = 0; i < batch; ++i)
    apply_of(backend, n, w[i], {stack + i * n, DType::f32}, flags.keep_of(i), lr, weight_decay, scale, cautious_wd,
             {slot[2], nullptr});
}

void adamw_run(Backend& backend, DType storage, void* p, const void* grad, void* m, void* v, int64_t n,
               const AdamWStepConstants& k, float grad_scale, Staging& staging) {
  const auto step = [&](float* p32, const float* grad32, float* m32, float* v32, int64_t len) {
    backend.run({rules::AdamWStep{.p = DeviceSpan(backend, p32, len),
                                  .grad = DeviceSpan(backend, grad32, len),
                                  .m = DeviceSpan(backend, m32, len),
                                  .v = DeviceSpan(backend, v32, len),
                                  .k = k,
                                  .grad_scale = grad_scale}});
  };
  if (storage == DType::f32) {
    step(static_cast<float*>(p), static_cast<const float*>(grad), static_cast<float*>(m), static_cast<float*>(v), n);
    return;
  }
  // bf16: p, grad, m, v widened chunk by chunk into four float32 rows, stepped, p, m, v rounded back.
  const int64_t chunk = std::min(n, adamw_chunk(backend));
  float* wide = staging.take(backend, 4 * chunk);
  const auto bf16_at = [](const void* base, int64_t offset) {
    return const_cast<char*>(static_cast<const char*>(base)) + offset * static_cast<int64_t>(dtype_size(DType::bf16));
  };
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t len = std::min(chunk, n - start);
    const void* sources[4] = {p, grad, m, v};
    for (int64_t r = 0; r < 4; ++r)
      backend.convert(dense_view(backend, bf16_at(sources[r], start), DType::bf16, 1, len),
                      dense_view(backend, wide + r * len, DType::f32, 1, len));
    step(wide, wide + len, wide + 2 * len, wide + 3 * len, len);
    void* targets[4] = {p, nullptr, m, v};
    for (int64_t r : {0, 2, 3})
      backend.convert(dense_view(backend, wide + r * len, DType::f32, 1, len),
                      dense_view(backend, bf16_at(targets[r], start), DType::bf16, 1, len));
  }
}

}  // namespace dmuon::capi
