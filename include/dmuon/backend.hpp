// The device seam (DESIGN 6): everything above it sees matrices as views (device, dtype, shape, row
// stride) and asks a Backend to do the work; only a Backend knows whether that is OpenBLAS on host
// memory, cuBLAS on a GPU stream, or a recorder that executes nothing. Modelled on ggml's
// ggml_backend_i (a table of operations) and ggml_backend_buffer_i (who owns memory): the interface
// lists what the Newton–Schulz recurrences (DESIGN 2) and the update rules (DESIGN 1) use, no more.
//
// Contract, as for a CUDA stream: operations are queued in call order on the backend's one queue and
// may run after the call returns; pointers passed in must stay valid until the work is done
// (synchronize(), or an Event). Results that live on the device (norms, sums) stay there until the host
// asks with copy_to_host, which waits for the queue. A host-memory backend runs everything at once.
// All element counts and strides are in elements, not bytes. Row-major everywhere.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dmuon/dtype.hpp"

namespace dmuon {

struct UpdateRule;  // dmuon/update_rules.hpp

enum class DeviceKind { cpu, cuda, record };

std::string to_string(DeviceKind device);
DeviceKind parse_device_kind(const std::string& name);  // "cpu", "cuda"; throws listing the valid names

// `count` matrices of rows×cols on one device, matrix i at data + i·batch_stride elements, row r of a
// matrix at + r·ld. count = 1 is one matrix; count > 1 is a strided batch (one batched kernel per op).
struct MatView {
  void* data = nullptr;
  DeviceKind device = DeviceKind::cpu;
  DType dtype = DType::f32;
  int64_t rows = 0, cols = 0;
  int64_t ld = 0;  // row stride ≥ cols
  int64_t count = 1;
  int64_t batch_stride = 0;

  bool empty() const { return rows == 0 || cols == 0 || count == 0; }
  int64_t elements() const { return rows * cols; }  // of one matrix
  // Matrix i of the batch as a count-1 view.
  MatView matrix(int64_t i) const;
  // The first n matrices (n ≤ count).
  MatView first(int64_t n) const;
  float* f32() const;  // data as float (dtype must be f32; device memory stays device memory)
};

// A contiguous view of `count` rows×cols float32 matrices at `data` (ld = cols, stride = rows·cols).
MatView f32_view(DeviceKind device, float* data, int64_t rows, int64_t cols, int64_t count = 1);

// Completion marker on a backend's queue (a CUDA event; on a host backend, already complete).
class Event {
 public:
  virtual ~Event() = default;
  virtual void wait() = 0;  // the host waits until the work before it is done
};

// What a backend runs on: for tuning keys, logs, and the libraries that queue work beside it (NCCL).
struct DeviceProperties {
  int index = 0;                 // the device's index (cuda:index); 0 on the CPU and the recorder
  std::string name;              // "NVIDIA H200"; on the CPU its BLAS ("OpenBLAS"), on the recorder "record"
  std::string versions;          // "CUDA runtime 13.0, driver 13.0, cuBLAS 13.1.0"; the BLAS's build on the CPU
  void* native_queue = nullptr;  // native_queue() below
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual DeviceKind device() const = 0;
  // "cpu: OpenBLAS 0.3.21 (...), 2 threads", "cuda:0 NVIDIA H200, cuBLAS 13.1", for logs and cache keys.
  virtual std::string description() const = 0;
  virtual DeviceProperties properties() const = 0;
  // Whether products and elementwise ops take `dtype` views (convert takes f32 and bf16 on every backend;
  // no backend computes on f64, i64 or u8).
  virtual bool supports(DType dtype) const = 0;
  // Whether the host may read this backend's memory directly (CPU): then copies are memcpy and
  // synchronize() returns at once.
  virtual bool host_memory() const = 0;
  // The queue this backend's work goes on, for code that queues its own work beside it and orders the two
  // (the NCCL communicator, the C ABI's join with a caller's stream): a CUDA backend's cudaStream_t; null
  // on host backends (this default).
  virtual void* native_queue() const { return nullptr; }

  // ---- memory (Buffer below owns it) ----
  virtual void* allocate(size_t bytes) = 0;  // throws dmuon::Error when out of memory
  virtual void deallocate(void* p) noexcept = 0;
  virtual void copy_from_host(void* dst, const void* src, size_t bytes) = 0;
  virtual void copy_to_host(void* dst, const void* src, size_t bytes) = 0;  // waits for the queue first
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;          // device to device, queued
  // out ← in, elementwise with dtype conversion (f32 ↔ bf16 rounds to nearest even); same shapes.
  virtual void convert(const MatView& in, const MatView& out) = 0;
  // Every element of x set to value.
  virtual void fill(const MatView& x, float value) = 0;

  // ---- products (float32 accumulation; each op runs once per matrix of the views' batch) ----
  // C(m×n) = alpha·op(A)·op(B) + beta·C; op(A) m×k, op(B) k×n. C must not overlap A or B.
  virtual void gemm(bool trans_a, bool trans_b, float alpha, const MatView& a, const MatView& b, float beta,
                    const MatView& c) = 0;
  // C(n×n) = alpha·op(A)·op(A)ᵀ + beta·C (SYRK), the full symmetric C; op(A) = A (n×k) or, with
  // trans, Aᵀ (A k×n). beta·C must be symmetric. C must not overlap A.
  virtual void syrk(bool trans, float alpha, const MatView& a, float beta, const MatView& c) = 0;
  // C(m×m) = alpha·A·B + beta·C for A m×k, B k×m whose product is known to be symmetric (DESIGN 2.3):
  // only tiles on and above the diagonal of a tiles×tiles grid are computed, then mirrored. beta·C
  // must be symmetric. tiles ≥ 1 (1: one full product). C must not overlap A or B.
  virtual void symmetric_gemm(float alpha, const MatView& a, const MatView& b, float beta, const MatView& c,
                              int tiles) = 0;

  // ---- elementwise and reductions on views ----
  virtual void scale(const MatView& x, float alpha) = 0;                  // x ← alpha·x
  virtual void add_identity(const MatView& c, float alpha) = 0;           // C ← C + alpha·I (square)
  virtual void mirror_upper(const MatView& c) = 0;                        // lower triangle ← upper
  virtual void transpose(const MatView& in, const MatView& out) = 0;      // out(cols×rows) = inᵀ
  // norms[i] = ‖x_i‖_F in double for each matrix of the batch, written to device memory (count values);
  // NaN or Inf when an element is not finite.
  virtual void frobenius_norms(const MatView& x, double* norms) = 0;
  // x_i ← x_i / (norms[i]·safety + eps), norms read on the device (DESIGN 2.1's normalisation).
  virtual void scale_by_inverse_norm(const MatView& x, const double* norms, double safety, double eps) = 0;

  // ---- the update rules (DESIGN 1): one elementwise pass over float32 views, update_rules.hpp ----
  virtual void run(const UpdateRule& rule) = 0;

  // ---- ordering and parallelism ----
  virtual void synchronize() = 0;  // the host waits for everything queued
  virtual std::unique_ptr<Event> record_event() = 0;
  // Runs fn(queue, w) for w in [0, workers) on independent queues of this device whose work may overlap
  // (CPU: threads with single-threaded BLAS; CUDA: streams), and returns when all of it is done.
  // workers ≤ 1 runs fn(*this, 0).
  virtual void run_concurrently(int workers, const std::function<void(Backend& queue, int worker)>& fn) = 0;
  // How many workers one call can use at most (CPU: BLAS threads; GPU: 1) and, for a scope, set it
  // (≤ 0: keep). Returns the previous value.
  virtual int parallelism() const = 0;
  virtual int set_parallelism(int n) = 0;
  // How many matrices of a batch to put in one batched kernel: 1 on the CPU (one matrix at a time stays in
  // cache and runs the same calls as the unbatched path), the whole batch on a GPU.
  virtual int64_t preferred_batch() const = 0;
  // Seconds the work that `enqueue` queues takes, for the autotuner and the benchmarks. A GPU times it with
  // events around the queued work on the device (the host clock would time the queueing); this default, for
  // host backends, is the steady clock around enqueue() between two synchronize() calls.
  virtual double time_queued(const std::function<void()>& enqueue);

  // ---- replay (CUDA graphs per (shape, batch), DESIGN 6) ----
  // Queues `fn`'s work, which may be recorded once and replayed: on the first call with a key a GPU
  // captures what fn queues into a graph and launches it; later calls with an equal key launch that
  // graph again without calling fn. Host backends call fn every time (this default). So the key must
  // determine everything fn queues: shapes, options, scalars and every address fn's operations read or
  // write (a graph replays the addresses it captured). Inside fn: operations of this backend only, no
  // allocation and nothing that waits for the queue or reads back (copy_to_host, synchronize, events).
  virtual void run_graph(const std::vector<int64_t>& key, const std::function<void()>& fn);
};

// Sets a backend's parallelism for a scope and restores it on exit.
class ParallelismScope {
 public:
  ParallelismScope(Backend& backend, int n);  // n ≤ 0: keep the current value
  ~ParallelismScope();
  ParallelismScope(const ParallelismScope&) = delete;
  ParallelismScope& operator=(const ParallelismScope&) = delete;

 private:
  Backend& backend_;
  int previous_;
};

// Memory of `size` elements of `dtype` on a backend, freed with it. Move-only.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Backend& backend, DType dtype, int64_t size);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  float* f32() const;  // throws unless dtype is f32
  int64_t size() const { return size_; }
  DType dtype() const { return dtype_; }
  Backend* backend() const { return backend_; }
  // `count` rows×cols matrices packed from element `offset` (ld = cols). Throws when they do not fit.
  MatView view(int64_t rows, int64_t cols, int64_t count = 1, int64_t offset = 0) const;
  // Host copies, explicit because on a GPU they cost a transfer and a wait.
  void upload(std::span<const float> values, int64_t offset = 0);    // f32 only
  void download(std::span<float> values, int64_t offset = 0) const;  // f32 only

 private:
  Backend* backend_ = nullptr;
  void* data_ = nullptr;
  int64_t size_ = 0;
  DType dtype_ = DType::f32;
};

// Bytes now and the most since the last reset (a count kept where the memory is allocated and freed).
struct MemoryCount {
  size_t live = 0, peak = 0;
};
// That count, kept from any thread: buffer_bytes's and ns_workspace_bytes's.
class MemoryCounter {
 public:
  void allocated(size_t bytes);
  void freed(size_t bytes) { live_ -= bytes; }
  // The count now; reset_peak: from now on the peak starts at live.
  MemoryCount read(bool reset_peak);

 private:
  std::atomic<size_t> live_{0}, peak_{0};
};
// Every Buffer's bytes, on every backend (device memory included): all the memory the engine allocates (parameters,
// gradients and optimizer state of ShardedParams and the optimizers, the Muon step's buffers, the Newton–Schulz
// workspaces). reset_peak: from now on the peak starts at live. For the benchmarks' memory figures.
MemoryCount buffer_bytes(bool reset_peak = false);

// The process's CPU backend (OpenBLAS on host memory); thread-safe, lives for the whole process.
Backend& cpu_backend();

// Newton–Schulz's compute dtype on the CPU where the caller asks for none (dmuon ns --dtype auto, a new C ABI handle,
// hence DMuon(ns_dtype=None)): bf16 where this CPU has bf16 matrix units that oneDNN uses (AMX), float32 elsewhere
// (AVX-512 BF16 alone and a build without oneDNN included). The environment variable DMUON_NS_DEFAULT_DTYPE (bf16 or f32) overrides
// the machine's answer, so the suite runs under either default on any CPU. Read once per process.
DType cpu_ns_default_dtype();
// Its rule, with the machine's answer given (tests fake it): `forced`, DMUON_NS_DEFAULT_DTYPE's value, when set
// (null or empty: unset; neither bf16 nor f32 throws naming the variable), else bf16 exactly when `bf16_units`.
DType ns_default_dtype_rule(bool bf16_units, const char* forced);
// Whether bf16 competes with float32 when a CPU caller that asks for no dtype tunes (auto_tune_dtypes, tune.hpp): where
// this CPU has bf16 instructions that oneDNN uses (AVX-512 BF16 or AMX), so a bf16 product may beat float32 — whether
// it does differs per CPU and shape, hence measured — unless DMUON_NS_DEFAULT_DTYPE forces the default. Read once per
// process.
bool cpu_ns_bf16_candidate();
// Its rule, with the machine's answer given (tests fake it): bf16_products when `forced` is unset (null or empty), else
// whether it is bf16 (then bf16 is the default, and always timed; f32: never). Invalid values: ns_default_dtype_rule's.
bool ns_bf16_candidate_rule(bool bf16_products, const char* forced);

// How many devices of `device` this build can use on this machine, so that code above the seam never asks a
// device library itself: cuda, the CUDA devices this process sees when the build has the CUDA backend (0
// without it, without a driver or without a device; never throws); cpu 1 (0 in the GPU-only build, which has
// no CPU backend); record 1 (a RecordingBackend needs no device).
int device_count(DeviceKind device);

// A backend for `device` (cuda: device `index`, created on first use and kept for the process). Throws
// dmuon::Error naming the device when this build or machine lacks it.
Backend& backend_for(DeviceKind device, int index = 0);

}  // namespace dmuon
