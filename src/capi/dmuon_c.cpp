// The C ABI (include/dmuon/dmuon_c.h) over the engine: argument checks, the choice of backend, exceptions
// turned into return codes and a per-thread message. The work itself is abi_calls.hpp's, on the CPU backend for
// host memory and, in builds with the CUDA backend, on the pointers' GPU in the caller's stream order
// (cuda_caller_stream.hpp); float32 and bfloat16 on both.
#include "dmuon/dmuon_c.h"

#include <array>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifdef DMUON_HAVE_JSON
#include <nlohmann/json.hpp>
#endif

#include "capi/abi_calls.hpp"
#ifdef DMUON_HAVE_CUDA
#include "capi/cuda_caller_stream.hpp"
#endif
#include "dmuon/backend.hpp"
#include "dmuon/error.hpp"
#include "dmuon/models.hpp"
#include "dmuon/ns.hpp"
#include "dmuon/optim.hpp"
#include "dmuon/plan.hpp"
#include "dmuon/tune.hpp"

struct dmuon_ns {
  dmuon::NsOptions defaults;         // the math, and the kernel when nothing is tuned
  // Tuned entries per compute dtype asked for and, for calls that ask for none, per shape in its faster dtype (the
  // CPU's; a GPU runs `defaults`); none for a shape: run `defaults`.
  dmuon::capi::TunedEntries tuned;
  std::optional<dmuon::DType> compute;  // dmuon_ns_set_dtype; none: the device's default (ns_compute_dtype)
  std::string warning;               // why the given tuning cache was rejected
  dmuon::capi::Staging staging;      // bf16 matrices widened to float32, and unchecked norms, per backend
  bool check_finite = true;          // dmuon_ns_set_check_finite
};

namespace {

thread_local std::string last_error;

// A caller's mistake (DMUON_ERR_INVALID) or a device/dtype this build lacks (DMUON_ERR_UNSUPPORTED).
struct InvalidArgument : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct Unsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void require(bool ok, const std::string& message) {
  if (!ok) throw InvalidArgument(message);
}

// Runs `body`, mapping what it throws to a return code and last_error.
template <typename Body>
int guarded(const char* function, Body&& body) {
  try {
    body();
    return DMUON_OK;
  } catch (const InvalidArgument& e) {
    last_error = std::string(function) + ": " + e.what();
    return DMUON_ERR_INVALID;
  } catch (const Unsupported& e) {
    last_error = std::string(function) + ": " + e.what();
    return DMUON_ERR_UNSUPPORTED;
  } catch (const std::exception& e) {
    last_error = std::string(function) + ": " + e.what();
    return DMUON_ERR_FAILED;
  } catch (...) {
    last_error = std::string(function) + ": unknown C++ exception";
    return DMUON_ERR_FAILED;
  }
}

const char* device_name(int device) {
  switch (device) {
    case DMUON_DEVICE_CPU: return "cpu";
    case DMUON_DEVICE_CUDA: return "cuda";
    default: return nullptr;
  }
}
const char* dtype_name(int dtype) {
  switch (dtype) {
    case DMUON_DTYPE_F32: return "float32";
    case DMUON_DTYPE_BF16: return "bfloat16";
    default: return nullptr;
  }
}

// Why `device` cannot run here ("" when it can). Both dtypes run wherever a device does.
std::string missing_device(int device) {
  if (device == DMUON_DEVICE_CPU)
    return dmuon::device_count(dmuon::DeviceKind::cpu) > 0
               ? ""
               : "this build of libdmuon_c has no CPU backend (built without OpenBLAS: CUDA tensors only)";
#ifdef DMUON_HAVE_CUDA
  return dmuon::capi::cuda_devices() > 0 ? "" : "this machine has no usable CUDA device";
#else
  return "this build of libdmuon_c has no CUDA backend (built without the CUDA toolkit)";
#endif
}

bool supported(int device, int dtype) {
  return device_name(device) != nullptr && dtype_name(dtype) != nullptr && missing_device(device).empty();
}

// The storage type of a checked device/dtype pair.
dmuon::DType check_device_dtype(int device, int dtype, const void* stream) {
  const char* dev = device_name(device);
  const char* dt = dtype_name(dtype);
  require(dev != nullptr, "unknown device code " + std::to_string(device) + " (0 cpu, 1 cuda)");
  require(dt != nullptr, "unknown dtype code " + std::to_string(dtype) + " (0 float32, 1 bfloat16)");
  const std::string missing = missing_device(device);
  if (!missing.empty()) throw Unsupported(std::string(dt) + " matrices on device " + dev + ": " + missing);
  require(device != DMUON_DEVICE_CPU || stream == nullptr, "stream must be NULL for device cpu");
  return dtype == DMUON_DTYPE_BF16 ? dmuon::DType::bf16 : dmuon::DType::f32;
}

// Runs work(backend) where the data is: the CPU backend at once, or the CUDA backend of the device holding
// `pointers` (pointer i named name_of(i) in errors), ordered in `stream`.
void on_device(int device, void* stream, std::span<const void* const> pointers,
               const std::function<std::string(size_t)>& name_of, const std::function<void(dmuon::Backend&)>& work) {
  if (device == DMUON_DEVICE_CPU) {
    work(dmuon::cpu_backend());
    return;
  }
#ifdef DMUON_HAVE_CUDA
  dmuon::capi::on_caller_stream(dmuon::capi::cuda_device_of(pointers, name_of), stream, work);
#else
  (void)stream, (void)pointers, (void)name_of;
  throw Unsupported("device cuda: " + missing_device(device));  // check_device_dtype said so first
#endif
}

// Refuses tensor `name` unless its contiguity flag says it is dense row-major memory (dmuon_c.h): the engine reads
// and writes its elements as consecutive values from the pointer on, so strided memory would give wrong values and
// reach other memory. The name is formatted only for the error (no strings built per tensor on every call).
template <typename Name>
void require_dense(int dense, const Name& name) {
  if (dense == 1) return;
  throw InvalidArgument(std::string(name()) + " is not dense row-major memory (its contiguity flag is " +
                        std::to_string(dense) +
                        "): the engine reads its elements as consecutive values; pass a dense (C-contiguous) copy");
}

// The n operands of a multi-tensor call: data[i] of dtypes[i] with contiguity flags dense[i], named what[i] in errors;
// null only where `optional` or where sizes (when given) says the tensor is empty.
std::vector<dmuon::capi::Operand> operands(const char* what, const char* dense_name, int64_t n, const void* const* data,
                                           const int* dtypes, const int* dense, const void* stream, int device,
                                           const int64_t* sizes, bool optional = false) {
  require(data != nullptr && dtypes != nullptr, std::string(what) + " and its dtypes must be given");
  require(dense != nullptr, std::string(dense_name) + " (the contiguity flags of " + what + ") must be given");
  std::vector<dmuon::capi::Operand> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const auto name = [what, i] { return std::string(what) + "[" + std::to_string(i) + "]"; };
    if (!optional && data[i] == nullptr && !(sizes && sizes[i] == 0)) throw InvalidArgument(name() + " is NULL");
    if (data[i] != nullptr) require_dense(dense[i], name);
    out[i] = {const_cast<void*>(data[i]), check_device_dtype(device, dtypes[i], stream)};
  }
  return out;
}

// Every pointer a call touches, for on_device (which finds the GPU from them), named "<what>[i]" (the name is
// formatted only when on_device asks for it: an error).
struct Touched {
  Touched(std::initializer_list<std::pair<const char*, std::span<const dmuon::capi::Operand>>> groups) {
    for (const auto& [what, xs] : groups) add(what, xs);
  }
  std::vector<const void*> pointers;
  std::vector<std::pair<const char*, size_t>> names;  // (what, i) of pointers[k]
  void add(const char* what, std::span<const dmuon::capi::Operand> xs) {
    for (size_t i = 0; i < xs.size(); ++i) add(what, i, xs[i].data);
  }
  void add(const char* what, size_t i, const void* p) {
    if (p == nullptr) return;
    pointers.push_back(p);
    names.emplace_back(what, i);
  }
  std::function<std::string(size_t)> name_of() const {
    return [this](size_t k) { return std::string(names[k].first) + "[" + std::to_string(names[k].second) + "]"; };
  }
};

// The step flags of n tensors (keep: NULL or n pointers, grad_scale: NULL or one), touched for on_device.
dmuon::capi::StepFlags step_flags(int64_t n, const float* const* keep, const float* grad_scale, Touched& touched) {
  dmuon::capi::StepFlags flags;
  if (keep != nullptr) {
    flags.keep = {keep, static_cast<size_t>(n)};
    for (int64_t i = 0; i < n; ++i) {
      require(keep[i] != nullptr, "keep[" + std::to_string(i) + "] is NULL (give NULL for the whole array instead)");
      touched.add("keep", static_cast<size_t>(i), keep[i]);
    }
  }
  flags.grad_scale = grad_scale;
  touched.add("grad_scale", 0, grad_scale);
  return flags;
}

void require_sizes(int64_t n, const int64_t* sizes) {
  require(n >= 0, "n must be >= 0, got " + std::to_string(n));
  require(n == 0 || sizes != nullptr, "sizes must be given");
  for (int64_t i = 0; i < n; ++i)
    require(sizes[i] >= 0, "sizes[" + std::to_string(i) + "] is " + std::to_string(sizes[i]));
}

// NULL: no cache; "": the default path; else the path itself.
const char* resolve_cache(const char* tune_cache, std::string& storage) {
  if (tune_cache == nullptr) return nullptr;
  storage = *tune_cache ? std::string(tune_cache) : dmuon::default_tune_cache_path();
  return storage.c_str();
}

// The entries timed in `dtypes` (one a caller asks for, or those a call that asks for none chooses among).
std::vector<dmuon::TuneEntry> load_entries(const std::string& path, int threads, const std::vector<dmuon::DType>& dtypes,
                                           std::string* warning) {
  dmuon::TuneKey key = dmuon::current_tune_key(threads);
  key.dtype = dmuon::tune_dtype_key(dtypes);
  return dmuon::TuneCache::load(path, key, warning).entries();
}

// What a call that asks for no compute dtype chooses among on this CPU (dmuon_tune times them).
std::vector<dmuon::DType> unasked_dtypes() { return dmuon::cpu_auto_tune_dtypes(); }

void write_string(const std::string& text, char* buf, size_t cap, size_t* needed) {
  if (needed) *needed = text.size() + 1;
  require(buf != nullptr && cap > text.size(),
          "buffer of " + std::to_string(cap) + " bytes is too small for " + std::to_string(text.size() + 1));
  std::memcpy(buf, text.c_str(), text.size() + 1);
}

// Matrix i's blocks (block_counts[i] of them, 0: none, the whole matrix), read in order from block_rows and
// block_cols, as make_plan_items' ns_blocks (it reads their shapes only: row0 and col0 stay 0). The blocks must
// cover the matrix: their elements sum to its own.
std::vector<std::vector<dmuon::MatrixBlock>> blocks_of(int64_t n, const int64_t* rows, const int64_t* cols,
                                                       const int64_t* block_counts, const int64_t* block_rows,
                                                       const int64_t* block_cols) {
  std::vector<std::vector<dmuon::MatrixBlock>> out(static_cast<size_t>(n));
  int64_t next = 0;
  for (int64_t i = 0; i < n; ++i) {
    const std::string matrix = "matrix " + std::to_string(i);
    require(block_counts[i] >= 0, matrix + " has " + std::to_string(block_counts[i]) + " blocks");
    if (block_counts[i] == 0) continue;
    require(block_rows && block_cols, "block_rows and block_cols must be given (" + matrix + " has " +
                                          std::to_string(block_counts[i]) + " blocks)");
    int64_t elements = 0;
    for (int64_t b = 0; b < block_counts[i]; ++b, ++next) {
      require(block_rows[next] >= 1 && block_cols[next] >= 1,
              matrix + "'s block " + std::to_string(b) + " has shape " + std::to_string(block_rows[next]) + "x" +
                  std::to_string(block_cols[next]));
      out[i].push_back({0, 0, block_rows[next], block_cols[next]});
      elements += block_rows[next] * block_cols[next];
    }
    require(elements == rows[i] * cols[i], matrix + " (" + std::to_string(rows[i]) + "x" + std::to_string(cols[i]) +
                                               ", " + std::to_string(rows[i] * cols[i]) + " elements) has blocks of " +
                                               std::to_string(elements) + " elements");
  }
  return out;
}

// The body of dmuon_plan_owners and dmuon_plan_owners_blocks (block_counts NULL: every matrix costed whole).
void plan_owners(int64_t n, const int64_t* rows, const int64_t* cols, const int64_t* block_counts,
                 const int64_t* block_rows, const int64_t* block_cols, int world_size, const char* balancer,
                 const char* costs, const char* tune_cache, int threads, double time_limit_s, int32_t* owner_out,
                 int* used_tuned) {
  require(n >= 0, "n must be >= 0");
  require(n == 0 || (rows && cols && owner_out), "rows, cols and owner_out must be given");
  require(world_size >= 1, "world_size must be >= 1, got " + std::to_string(world_size));
  require(balancer && costs, "balancer and costs must be given");
  const std::string cost_kind = costs;
  require(cost_kind == "flop" || cost_kind == "tuned" || cost_kind == "auto",
          "costs must be flop, tuned or auto, got '" + cost_kind + "'");
  dmuon::PlanOptions options;
  options.balancer = dmuon::parse_balancer(balancer);
  options.time_limit_s = time_limit_s;
  std::vector<dmuon::ParamSpec> params;
  for (int64_t i = 0; i < n; ++i) {
    require(rows[i] >= 1 && cols[i] >= 1, "matrix " + std::to_string(i) + " has shape " + std::to_string(rows[i]) +
                                              "x" + std::to_string(cols[i]));
    params.push_back({"matrix" + std::to_string(i), {rows[i], cols[i]}, dmuon::ParamRole::matrix, static_cast<int>(i)});
  }
  const std::vector<std::vector<dmuon::MatrixBlock>> ns_blocks =
      block_counts ? blocks_of(n, rows, cols, block_counts, block_rows, block_cols)
                   : std::vector<std::vector<dmuon::MatrixBlock>>{};
  std::vector<dmuon::PlanItem> items;
  bool tuned = false;
  if (cost_kind != "flop") {
    std::string path_storage;
    const char* path = resolve_cache(tune_cache, path_storage);
    require(cost_kind == "auto" || path != nullptr, "costs=tuned needs a tuning cache");
    require(threads >= 1, "threads must be >= 1, got " + std::to_string(threads));
    std::string warning;
    // The planner's costs: the times of calls that ask for no dtype, the ones dmuon_tune tunes.
    const auto entries = path ? load_entries(path, threads, unasked_dtypes(), &warning)
                              : std::vector<dmuon::TuneEntry>{};
    try {
      items = dmuon::make_plan_items(params, world_size, dmuon::tuned_batch_time(entries), ns_blocks);
      tuned = true;
    } catch (const dmuon::Error& e) {
      if (cost_kind == "tuned") throw dmuon::Error(std::string(e.what()) + (warning.empty() ? "" : "; " + warning));
    }
  }
  if (!tuned) items = dmuon::make_plan_items(params, world_size, dmuon::relative_flop_batch_time(), ns_blocks);
  const dmuon::Plan plan = dmuon::make_plan(params, items, world_size, options);
  for (int64_t i = 0; i < n; ++i) owner_out[i] = plan.owner[i];
  if (used_tuned) *used_tuned = tuned ? 1 : 0;
}

// The parameters of a model manifest as a JSON list of {"name", "shape", "role"}.
std::string model_params_text(const char* name_or_path, int layers) {
#ifdef DMUON_HAVE_JSON
  nlohmann::json list = nlohmann::json::array();
  for (const dmuon::ParamSpec& p : dmuon::load_model_manifest(name_or_path, layers)) {
    list.push_back({{"name", p.name}, {"shape", p.shape}, {"role", std::string(dmuon::to_string(p.role))}});
  }
  return list.dump();
#else
  throw Unsupported(std::string("cannot read model ") + name_or_path + " (" + std::to_string(layers) +
                    " layers): this build of libdmuon_c has no JSON library (built without nlohmann-json)");
#endif
}

}  // namespace

extern "C" {

int dmuon_abi_version(void) { return DMUON_C_ABI_VERSION; }

const char* dmuon_last_error(void) { return last_error.c_str(); }

int dmuon_supports(int device, int dtype) { return supported(device, dtype) ? 1 : 0; }

int dmuon_tuning_chooses_dtype(void) { return unasked_dtypes().size() > 1 ? 1 : 0; }

int dmuon_ns_create(const char* coeffs, const char* algo, int steps, int threads, const char* tune_cache,
                    dmuon_ns** out) {
  return guarded("dmuon_ns_create", [&] {
    require(out != nullptr, "out is NULL");
    require(coeffs != nullptr && algo != nullptr, "coeffs and algo must be given");
    require(steps >= 1, "steps must be >= 1, got " + std::to_string(steps));
    require(threads >= 1, "threads must be >= 1, got " + std::to_string(threads));
    auto ns = std::make_unique<dmuon_ns>();
    ns->defaults.coeffs = dmuon::parse_ns_coeffs(coeffs);
    ns->defaults.algo = dmuon::parse_ns_algo(algo);
    ns->defaults.steps = steps;
    ns->defaults.threads = threads;
    std::string path_storage;
    const char* path = resolve_cache(tune_cache, path_storage);
    if (path && ns->defaults.algo == dmuon::NsAlgo::automatic) {
      // Each dtype's entries (a call may ask for either), and those of calls that ask for none, with their
      // warning (dmuon_tune fills that setting).
      // (A build without a CPU backend, the GPU-only one, runs no tuned CPU call: none.)
      const bool cpu = dmuon::device_count(dmuon::DeviceKind::cpu) > 0;
      for (const dmuon::DType dtype : {dmuon::DType::f32, dmuon::DType::bf16}) {
        if (!cpu || !dmuon::cpu_backend().supports(dtype)) continue;
        std::string unused;
        ns->tuned.by_dtype[dtype] = load_entries(path, threads, {dtype}, &unused);
      }
      ns->tuned.chosen = load_entries(path, threads, unasked_dtypes(), &ns->warning);
    }
    *out = ns.release();
  });
}

void dmuon_ns_destroy(dmuon_ns* ns) { delete ns; }

void dmuon_engine_bytes(uint64_t* live, uint64_t* peak, int reset_peak) {
  const dmuon::MemoryCount bytes = dmuon::buffer_bytes(reset_peak != 0);
  if (live) *live = bytes.live;
  if (peak) *peak = bytes.peak;
}

void dmuon_release_workspaces(void) { dmuon::ns_release_workspaces(); }

int64_t dmuon_ns_tuned_entries(const dmuon_ns* ns) {
  if (!ns) return 0;
  // The settings' entries, each setting once (where float32 alone is tuned, calls that ask for none take float32's).
  int64_t n = unasked_dtypes().size() > 1 ? static_cast<int64_t>(ns->tuned.chosen.size()) : 0;
  for (const auto& [dtype, entries] : ns->tuned.by_dtype) n += static_cast<int64_t>(entries.size());
  return n;
}

const char* dmuon_ns_warning(const dmuon_ns* ns) { return ns ? ns->warning.c_str() : ""; }

int dmuon_ns_call_dtype(const dmuon_ns* ns, int device, int dtype, int64_t rows, int64_t cols, int64_t batch,
                        int* compute, int* tuned) {
  return guarded("dmuon_ns_call_dtype", [&] {
    require(ns != nullptr, "handle is NULL");
    const dmuon::DType storage = check_device_dtype(device, dtype, nullptr);
    require(batch >= 1, "batch must be >= 1, got " + std::to_string(batch));
    require(rows >= 1 && cols >= 1, "shape must be positive, got " + std::to_string(rows) + "x" + std::to_string(cols));
    dmuon::Backend& backend =
        dmuon::backend_for(device == DMUON_DEVICE_CPU ? dmuon::DeviceKind::cpu : dmuon::DeviceKind::cuda);
    bool from_entry = false;
    const dmuon::NsOptions options = dmuon::capi::call_ns_options(backend, ns->tuned, ns->defaults, ns->compute,
                                                                  storage, rows, cols, batch, &from_entry);
    if (compute) *compute = options.dtype == dmuon::DType::bf16 ? DMUON_DTYPE_BF16 : DMUON_DTYPE_F32;
    if (tuned) *tuned = from_entry ? 1 : 0;
  });
}

int dmuon_ns_set_check_finite(dmuon_ns* ns, int check) {
  return guarded("dmuon_ns_set_check_finite", [&] {
    require(ns != nullptr, "handle is NULL");
    require(check == 0 || check == 1, "check must be 0 or 1, got " + std::to_string(check));
    ns->check_finite = check == 1;
  });
}

int dmuon_ns_set_dtype(dmuon_ns* ns, int dtype) {
  return guarded("dmuon_ns_set_dtype", [&] {
    require(ns != nullptr, "handle is NULL");
    require(dtype == DMUON_NS_DTYPE_DEFAULT || dtype_name(dtype) != nullptr,
            "Newton-Schulz dtype must be -1 (the device's default), 0 (float32) or 1 (bfloat16), got " +
                std::to_string(dtype));
    if (dtype == DMUON_NS_DTYPE_DEFAULT) {
      ns->compute.reset();
    } else {
      ns->compute = dtype == DMUON_DTYPE_BF16 ? dmuon::DType::bf16 : dmuon::DType::f32;
    }
  });
}

int dmuon_ns_run(dmuon_ns* ns, int device, int dtype, void* stream, const void* const* in, const int* in_dense,
                 void* const* out, const int* out_dense, int64_t batch, int64_t rows, int64_t cols,
                 const char* const* names) {
  return guarded("dmuon_ns_run", [&] {
    require(ns != nullptr, "handle is NULL");
    const dmuon::DType storage = check_device_dtype(device, dtype, stream);
    require(batch >= 0, "batch must be >= 0, got " + std::to_string(batch));
    require(rows >= 1 && cols >= 1, "shape must be positive, got " + std::to_string(rows) + "x" + std::to_string(cols));
    if (batch == 0) return;
    require(in != nullptr && out != nullptr, "in and out must be given");
    require(in_dense != nullptr && out_dense != nullptr, "in_dense and out_dense (contiguity flags) must be given");
    std::vector<std::string> labels;
    for (int64_t i = 0; i < batch; ++i) {
      require(in[i] != nullptr && out[i] != nullptr, "matrix " + std::to_string(i) + " has a NULL pointer");
      require_dense(in_dense[i], [i] { return "in[" + std::to_string(i) + "]"; });
      require_dense(out_dense[i], [i] { return "out[" + std::to_string(i) + "]"; });
      if (names) labels.emplace_back(names[i] ? names[i] : "matrix");
    }
    const std::span<const void* const> inputs(in, static_cast<size_t>(batch));
    const std::span<void* const> outputs(out, static_cast<size_t>(batch));
    std::vector<const void*> pointers(inputs.begin(), inputs.end());
    pointers.insert(pointers.end(), outputs.begin(), outputs.end());
    const auto name_of = [batch](size_t i) {
      return (i < static_cast<size_t>(batch) ? "in[" + std::to_string(i) : "out[" + std::to_string(i - batch)) + "]";
    };
    on_device(device, stream, pointers, name_of, [&](dmuon::Backend& backend) {
      const dmuon::NsOptions options =
          dmuon::capi::call_ns_options(backend, ns->tuned, ns->defaults, ns->compute, storage, rows, cols, batch);
      dmuon::capi::ns_run(backend, storage, inputs, outputs, rows, cols, options, labels, ns->staging,
                          ns->check_finite);
    });
  });
}

int dmuon_adamw_step(int device, int dtype, void* stream, void* p, const void* grad, void* exp_avg,
                     void* exp_avg_sq, const int* dense, int64_t n, int64_t step, double lr, double beta1, double beta2, double eps,
                     double weight_decay, float grad_scale) {
  return guarded("dmuon_adamw_step", [&] {
    const dmuon::DType storage = check_device_dtype(device, dtype, stream);
    require(n >= 0, "n must be >= 0, got " + std::to_string(n));
    require(step >= 1, "step must be >= 1, got " + std::to_string(step));
    if (n == 0) return;
    require(p && grad && exp_avg && exp_avg_sq, "p, grad, exp_avg and exp_avg_sq must be given");
    require(dense != nullptr, "dense (the contiguity flags of p, grad, exp_avg, exp_avg_sq) must be given");
    const std::array<const char*, 4> arguments{"p", "grad", "exp_avg", "exp_avg_sq"};
    for (size_t i = 0; i < arguments.size(); ++i) require_dense(dense[i], [&] { return arguments[i]; });
    const dmuon::AdamWStepConstants k = dmuon::adamw_step_constants({lr, beta1, beta2, eps, weight_decay}, step);
    const void* pointers[] = {p, grad, exp_avg, exp_avg_sq};
    // bf16 staging: per thread, as the function is reentrant; kept, so repeated steps reuse it.
    thread_local dmuon::capi::Staging staging;
    const auto name_of = [&arguments](size_t i) { return std::string(arguments[i]); };
    on_device(device, stream, pointers, name_of, [&](dmuon::Backend& backend) {
      dmuon::capi::adamw_run(backend, storage, p, grad, exp_avg, exp_avg_sq, n, k, grad_scale, staging);
    });
  });
}

int dmuon_muon_momentum(int device, void* stream, int64_t n, const int64_t* sizes, const void* const* grads,
                        const int* grad_dtypes, const int* grad_dense, void* const* momenta,
                        const int* momentum_dtypes, const int* momentum_dense, void* const* u, const int* u_dtypes,
                        const int* u_dense, const float* const* keep, const float* grad_scale, double beta,
                        int nesterov) {
  return guarded("dmuon_muon_momentum", [&] {
    require_sizes(n, sizes);
    require(beta >= 0 && beta < 1, "beta must be in [0, 1), got " + std::to_string(beta));
    if (n == 0) return;
    const auto g = operands("grads", "grad_dense", n, grads, grad_dtypes, grad_dense, stream, device, sizes, true);
    const auto m = operands("momenta", "momentum_dense", n, momenta, momentum_dtypes, momentum_dense, stream, device,
                            sizes);
    const auto us = operands("u", "u_dense", n, u, u_dtypes, u_dense, stream, device, sizes);
    Touched touched{{"grads", g}, {"momenta", m}, {"u", us}};
    const dmuon::capi::StepFlags flags = step_flags(n, keep, grad_scale, touched);
    thread_local dmuon::capi::Staging staging;  // per thread, as the function is reentrant
    on_device(device, stream, touched.pointers, touched.name_of(), [&](dmuon::Backend& backend) {
      dmuon::capi::muon_momentum_run(backend, {sizes, static_cast<size_t>(n)}, g, m, us, flags, beta, nesterov != 0,
                                     staging);
    });
  });
}

int dmuon_muon_apply(int device, void* stream, int64_t n, const int64_t* sizes, void* const* w, const int* w_dtypes,
                     const int* w_dense, const void* const* o, const int* o_dtypes, const int* o_dense,
                     const float* const* keep, double lr, double weight_decay, const double* scales,
                     int cautious_wd) {
  return guarded("dmuon_muon_apply", [&] {
    require_sizes(n, sizes);
    if (n == 0) return;
    require(scales != nullptr, "scales must be given");
    const auto ws = operands("w", "w_dense", n, w, w_dtypes, w_dense, stream, device, sizes);
    const auto os = operands("o", "o_dense", n, o, o_dtypes, o_dense, stream, device, sizes);
    Touched touched{{"w", ws}, {"o", os}};
    const dmuon::capi::StepFlags flags = step_flags(n, keep, nullptr, touched);
    thread_local dmuon::capi::Staging staging;
    on_device(device, stream, touched.pointers, touched.name_of(), [&](dmuon::Backend& backend) {
      dmuon::capi::muon_apply_run(backend, {sizes, static_cast<size_t>(n)}, ws, os, flags, lr, weight_decay,
                                  {scales, static_cast<size_t>(n)}, cautious_wd != 0, staging);
    });
  });
}

int dmuon_muon_update(dmuon_ns* ns, int device, void* stream, int64_t batch, int64_t rows, int64_t cols,
                      const void* const* grads, const int* grad_dtypes, const int* grad_dense, void* const* momenta,
                      const int* momentum_dtypes, const int* momentum_dense, void* const* w, const int* w_dtypes,
                      const int* w_dense, const float* const* keep,
                      const float* grad_scale, double beta, int nesterov, double lr, double weight_decay,
                      double scale, int cautious_wd, const char* const* names) {
  return guarded("dmuon_muon_update", [&] {
    require(ns != nullptr, "handle is NULL");
    require(batch >= 0, "batch must be >= 0, got " + std::to_string(batch));
    require(rows >= 1 && cols >= 1, "shape must be positive, got " + std::to_string(rows) + "x" + std::to_string(cols));
    require(beta >= 0 && beta < 1, "beta must be in [0, 1), got " + std::to_string(beta));
    if (batch == 0) return;
    const auto g = operands("grads", "grad_dense", batch, grads, grad_dtypes, grad_dense, stream, device, nullptr, true);
    const auto m = operands("momenta", "momentum_dense", batch, momenta, momentum_dtypes, momentum_dense, stream,
                            device, nullptr);
    const auto ws = operands("w", "w_dense", batch, w, w_dtypes, w_dense, stream, device, nullptr);
    Touched touched{{"grads", g}, {"momenta", m}, {"w", ws}};
    const dmuon::capi::StepFlags flags = step_flags(batch, keep, grad_scale, touched);
    std::vector<std::string> labels;
    for (int64_t i = 0; names && i < batch; ++i) labels.emplace_back(names[i] ? names[i] : "matrix");
    on_device(device, stream, touched.pointers, touched.name_of(), [&](dmuon::Backend& backend) {
      // The update's data may mix storage types: a GPU's default iterates are bf16, as for bf16 data.
      const dmuon::NsOptions options = dmuon::capi::call_ns_options(backend, ns->tuned, ns->defaults, ns->compute,
                                                                    dmuon::DType::bf16, rows, cols, batch);
      dmuon::capi::muon_update_run(backend, rows, cols, g, m, ws, flags, beta, nesterov != 0, lr, weight_decay, scale,
                                   cautious_wd != 0, options, labels, ns->staging, ns->check_finite);
    });
  });
}

int dmuon_plan_owners(int64_t n, const int64_t* rows, const int64_t* cols, int world_size, const char* balancer,
                      const char* costs, const char* tune_cache, int threads, double time_limit_s,
                      int32_t* owner_out, int* used_tuned) {
  return guarded("dmuon_plan_owners", [&] {
    plan_owners(n, rows, cols, nullptr, nullptr, nullptr, world_size, balancer, costs, tune_cache, threads,
                time_limit_s, owner_out, used_tuned);
  });
}

int dmuon_plan_owners_blocks(int64_t n, const int64_t* rows, const int64_t* cols, const int64_t* block_counts,
                             const int64_t* block_rows, const int64_t* block_cols, int world_size,
                             const char* balancer, const char* costs, const char* tune_cache, int threads,
                             double time_limit_s, int32_t* owner_out, int* used_tuned) {
  return guarded("dmuon_plan_owners_blocks", [&] {
    require(n == 0 || block_counts, "block_counts must be given");
    plan_owners(n, rows, cols, block_counts, block_rows, block_cols, world_size, balancer, costs, tune_cache,
                threads, time_limit_s, owner_out, used_tuned);
  });
}

int dmuon_tune(int64_t n, const int64_t* rows, const int64_t* cols, const int32_t* batch, int threads, int rounds,
               const char* tune_cache) {
  return guarded("dmuon_tune", [&] {
    require(n >= 0 && (n == 0 || (rows && cols && batch)), "rows, cols and batch must be given");
    require(tune_cache != nullptr, "tune_cache must be a path or \"\" (the default path)");
    require(threads >= 1 && rounds >= 1, "threads and rounds must be >= 1");
    std::vector<dmuon::TuneRequest> requests;
    for (int64_t i = 0; i < n; ++i) {
      require(rows[i] >= 1 && cols[i] >= 1 && batch[i] >= 1, "request " + std::to_string(i) + " is not positive");
      requests.push_back({rows[i], cols[i], batch[i]});
    }
    std::string path_storage;
    dmuon::TuneSessionOptions options;
    options.cache_path = resolve_cache(tune_cache, path_storage);
    options.threads = threads;
    options.rounds = rounds;
    options.dtypes = unasked_dtypes();  // what a handle chooses among unasked (call_ns_options)
    dmuon::tune_with_cache(requests, options);
  });
}

int dmuon_default_tune_cache_path(char* buf, size_t cap, size_t* needed) {
  return guarded("dmuon_default_tune_cache_path", [&] { write_string(dmuon::default_tune_cache_path(), buf, cap, needed); });
}

int dmuon_model_params_json(const char* name_or_path, int layers, char* buf, size_t cap, size_t* needed) {
  return guarded("dmuon_model_params_json", [&] {
    require(name_or_path != nullptr, "name_or_path is NULL");
    require(layers >= 0, "layers must be >= 0");
    write_string(model_params_text(name_or_path, layers), buf, cap, needed);
  });
}

}  // extern "C"
