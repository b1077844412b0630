// CudaBackend (cuda_backend.hpp): memory, copies, cuBLAS products from the call descriptors, kernels, events and
// concurrent streams.
#include "backend/cuda/cuda_backend.hpp"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>
#include <variant>

#include "backend/cuda/check.hpp"
#include "backend/cuda/kernels.hpp"
#include "backend/rules/launch.hpp"
#include "dmuon/update_rules.hpp"

namespace dmuon::cuda {

namespace {

constexpr size_t kBlasWorkspaceBytes = size_t{32} << 20;
// run_graph keeps at most this many executable graphs, evicting the least recently launched: callers that pass
// fresh addresses every step (buffers of their own allocator) would otherwise grow the cache without bound.
constexpr size_t kMaxGraphs = 128;

cudaDataType cuda_type(DType t) { return t == DType::f32 ? CUDA_R_32F : CUDA_R_16BF; }

class CudaEvent final : public Event {
 public:
  CudaEvent(int device, cudaStream_t stream) {
    DMUON_CUDA_CHECK(cudaSetDevice(device));
    DMUON_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    DMUON_CUDA_CHECK(cudaEventRecord(event_, stream));
  }
  ~CudaEvent() override { cudaEventDestroy(event_); }
  void wait() override { DMUON_CUDA_CHECK(cudaEventSynchronize(event_)); }

 private:
  cudaEvent_t event_ = nullptr;
};

// The event pair of one timing, destroyed with it.
struct TimingEvents {
  cudaEvent_t start = nullptr, stop = nullptr;
  TimingEvents() {
    DMUON_CUDA_CHECK(cudaEventCreate(&start));
    DMUON_CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~TimingEvents() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
};

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return false;
  const std::string s = v;
  DMUON_CHECK(s == "0" || s == "1", "environment variable ", name, " must be 0 or 1, got '", s, "'");
  return s == "1";
}

}  // namespace

cublasMath_t blas_math_mode(bool tf32) {
  // TF32 only when asked: float32 products otherwise round as float32 (cublasSsyrk follows the math mode; the
  // GemmEx calls choose their compute type in run()). Without DISALLOW_REDUCED_PRECISION_REDUCTION cuBLAS may
  // reduce the split-K partials of a product with a bf16 output in bf16, the output type, rather than in the
  // float32 accumulator (cublas_api.h): an extra rounding per partial.
  const cublasMath_t base = tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_PEDANTIC_MATH;
  return static_cast<cublasMath_t>(base | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);
}

cudaError_t query_event(cudaEvent_t event) {
  const cudaError_t rc = cudaEventQuery(event);
  if (rc == cudaErrorNotReady) (void)cudaGetLastError();
  return rc;
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // "no driver" / "insufficient driver": this machine has no usable GPU
    return 0;
  }
  return n;
}

std::string device_name(int index) {
  cudaDeviceProp prop{};
  DMUON_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  return prop.name;
}

std::string library_versions() {
  int runtime = 0, driver = 0, major = 0, minor = 0, patch = 0;
  DMUON_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  DMUON_CUDA_CHECK(cudaDriverGetVersion(&driver));
  DMUON_CUBLAS_CHECK(cublasGetProperty(MAJOR_VERSION, &major));
  DMUON_CUBLAS_CHECK(cublasGetProperty(MINOR_VERSION, &minor));
  DMUON_CUBLAS_CHECK(cublasGetProperty(PATCH_LEVEL, &patch));
  auto version = [](int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); };
  return "CUDA runtime " + version(runtime) + ", driver " + version(driver) + ", cuBLAS " + std::to_string(major) +
         "." + std::to_string(minor) + "." + std::to_string(patch);
}

std::string device_description(int index) { return device_name(index) + ", " + library_versions(); }

CudaBackend::CudaBackend(int device, bool tf32, bool graphs) : device_(device), tf32_(tf32), graphs_on_(graphs) {
  activate();
  DMUON_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  DMUON_CUBLAS_CHECK(cublasCreate(&blas_));
  DMUON_CUBLAS_CHECK(cublasSetStream(blas_, stream_));
  DMUON_CUBLAS_CHECK(cublasSetMathMode(blas_, blas_math_mode(tf32_)));
  // A workspace of cuBLAS's recommended size for Hopper (cublasSetWorkspace: 32 MiB), so that products
  // captured by run_graph use it instead of allocating inside the capture.
  DMUON_CUDA_CHECK(cudaMalloc(&blas_workspace_, kBlasWorkspaceBytes));
  DMUON_CUBLAS_CHECK(cublasSetWorkspace(blas_, blas_workspace_, kBlasWorkspaceBytes));
  // allocate() takes memory from the device's default pool (cudaMallocAsync), whose release threshold is 0: it
  // hands freed memory back to the driver at every synchronisation, so a buffer freed and allocated again each
  // step costs a driver allocation each time. Keep freed memory in the pool instead, as PyTorch's caching
  // allocator keeps its blocks (setting the same value again for another backend of the device is harmless).
  cudaMemPool_t pool = nullptr;
  DMUON_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device_));
  uint64_t keep = std::numeric_limits<uint64_t>::max();
  DMUON_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
}

CudaBackend::~CudaBackend() {
  workers_.clear();
  cudaSetDevice(device_);
  for (auto& [key, graph] : graphs_) cudaGraphExecDestroy(graph.exec);
  if (blas_) cublasDestroy(blas_);
  if (stream_) cudaStreamDestroy(stream_);
  if (blas_workspace_) cudaFree(blas_workspace_);
}

void CudaBackend::activate() const {
  int current = -1;
  DMUON_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device_) DMUON_CUDA_CHECK(cudaSetDevice(device_));
}

std::string CudaBackend::description() const {
  return "cuda:" + std::to_string(device_) + " " + device_description(device_) + (tf32_ ? ", TF32 on" : "") +
         (graphs_on_ ? "" : ", CUDA graphs off");
}

DeviceProperties CudaBackend::properties() const {
  return {device_, device_name(device_), library_versions(), native_queue()};
}

void CudaBackend::check_device(const MatView& v, const char* op, const char* name) const {
  DMUON_CHECK(v.device == DeviceKind::cuda, op, " on cuda:", device_, ": ", name, " is a ", to_string(v.device),
              " view");
}

// ---- memory ----

void CudaBackend::check_not_capturing(const char* op) const {
  DMUON_CHECK(!capturing_, op, " on cuda:", device_, " inside run_graph: a graph cannot wait for the host, read back "
              "or allocate");
}

void* CudaBackend::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  check_not_capturing("allocate");
  activate();
  void* p = nullptr;
  const cudaError_t rc = cudaMallocAsync(&p, bytes, stream_);
  if (rc == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    DMUON_FAIL("cuda:", device_, ": out of device memory allocating ", bytes, " bytes");
  }
  DMUON_CUDA_CHECK(rc);
  return p;
}

void CudaBackend::deallocate(void* p) noexcept {
  if (p == nullptr) return;
  // A graph that names this address can never be launched with its key again unless the pool hands the same
  // address out again; drop it now rather than when the cache is full. (An in-flight launch still completes:
  // cudaGraphExecDestroy frees a running graph when it finishes.)
  const auto address = static_cast<int64_t>(reinterpret_cast<intptr_t>(p));
  std::erase_if(graphs_, [&](const auto& entry) {
    const std::vector<int64_t>& key = entry.first;
    if (std::find(key.begin(), key.end(), address) == key.end()) return false;
    cudaGraphExecDestroy(entry.second.exec);
    return true;
  });
  // Stream-ordered: after the work queued before it. Errors here (the runtime shutting down at exit) are
  // dropped, and so is the last error they would leave behind. The calling thread's current device is its own
  // (a destructor runs anywhere: a C ABI handle's end in a PyTorch program, a thread's exit): put back after.
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess) current = -1;
  if (cudaSetDevice(device_) != cudaSuccess || cudaFreeAsync(p, stream_) != cudaSuccess) (void)cudaGetLastError();
  if (current >= 0 && current != device_ && cudaSetDevice(current) != cudaSuccess) (void)cudaGetLastError();
}

void CudaBackend::copy_from_host(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  check_not_capturing("copy_from_host");  // a replay would read the host memory again, whatever it holds then
  activate();
  // From pageable memory the runtime stages the source before returning, so the caller may reuse it.
  DMUON_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
}

void CudaBackend::copy_to_host(void* dst, const void* src, size_t bytes) {
  check_not_capturing("copy_to_host");
  activate();
  if (bytes > 0) DMUON_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  DMUON_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  activate();
  DMUON_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
}

void CudaBackend::convert(const MatView& in, const MatView& out) {
  check_device(in, "convert", "in");
  check_device(out, "convert", "out");
  DMUON_CHECK(in.rows == out.rows && in.cols == out.cols && in.count == out.count, "convert: in is ", in.count, "x",
              in.rows, "x", in.cols, ", out ", out.count, "x", out.rows, "x", out.cols);
  activate();
  launch_convert(in, out, stream_);
}

void CudaBackend::fill(const MatView& x, float value) {
  check_device(x, "fill", "x");
  activate();
  launch_fill(x, value, stream_);
}

// ---- products ----

void CudaBackend::run(const std::vector<BlasCall>& calls, const MatView& a, const MatView& b, const MatView& c) {
  activate();
  for (const BlasCall& call : calls) {
    const MatView& a_view = call.a_source == Source::a ? a : b;
    const MatView& b_view = call.b_source == Source::a ? a : b;
    const size_t ab_size = dtype_size(call.ab_type), c_size = dtype_size(call.c_type);
    const void* pa = static_cast<const char*>(a_view.data) + call.a_offset * ab_size;
    const void* pb = static_cast<const char*>(b_view.data) + call.b_offset * ab_size;
    void* pc = static_cast<char*>(c.data) + call.c_offset * c_size;
    const int m = static_cast<int>(call.m), n = static_cast<int>(call.n), k = static_cast<int>(call.k);
    const int lda = static_cast<int>(call.lda), ldb = static_cast<int>(call.ldb), ldc = static_cast<int>(call.ldc);
    const cublasOperation_t op_a = call.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (call.kind == BlasCall::Kind::syrk) {
      DMUON_CUBLAS_CHECK(cublasSsyrk(blas_, call.lower ? CUBLAS_FILL_MODE_LOWER : CUBLAS_FILL_MODE_UPPER, op_a, n, k,
                                     &call.alpha, static_cast<const float*>(pa), lda, &call.beta,
                                     static_cast<float*>(pc), ldc));
      continue;
    }
    const cublasOperation_t op_b = call.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cudaDataType ab = cuda_type(call.ab_type), ct = cuda_type(call.c_type);
    const cublasComputeType_t compute =
        call.ab_type == DType::f32 && tf32_ ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    if (call.batch == 1) {
      DMUON_CUBLAS_CHECK(cublasGemmEx(blas_, op_a, op_b, m, n, k, &call.alpha, pa, ab, lda, pb, ab, ldb, &call.beta,
                                      pc, ct, ldc, compute, CUBLAS_GEMM_DEFAULT));
    } else {
      DMUON_CUBLAS_CHECK(cublasGemmStridedBatchedEx(blas_, op_a, op_b, m, n, k, &call.alpha, pa, ab, lda,
                                                    call.stride_a, pb, ab, ldb, call.stride_b, &call.beta, pc, ct, ldc,
                                                    call.stride_c, static_cast<int>(call.batch), compute,
                                                    CUBLAS_GEMM_DEFAULT));
    }
  }
}

void CudaBackend::scale_only(const MatView& c, float beta) {
  activate();
  if (beta == 0.0f) {
    launch_fill(c, 0.0f, stream_);  // BLAS's β = 0: C is not read, so NaN in it does not survive
  } else if (beta != 1.0f) {
    launch_scale(c, beta, stream_);
  }
}

void CudaBackend::gemm(bool trans_a, bool trans_b, float alpha, const MatView& a, const MatView& b, float beta,
                       const MatView& c) {
  check_device(a, "gemm", "A");
  check_device(b, "gemm", "B");
  check_device(c, "gemm", "C");
  const std::vector<BlasCall> calls = gemm_calls(trans_a, trans_b, alpha, a, b, beta, c);  // checks the shapes
  if ((trans_a ? a.rows : a.cols) == 0) return scale_only(c, beta);
  run(calls, a, b, c);
}

void CudaBackend::syrk(bool trans, float alpha, const MatView& a, float beta, const MatView& c) {
  check_device(a, "syrk", "A");
  check_device(c, "syrk", "C");
  if ((trans ? a.rows : a.cols) == 0) {
    (void)syrk_calls(trans, alpha, a, beta, c, SyrkMethod{false, 1});  // checks the shapes
    return scale_only(c, beta);
  }
  // cuBLAS's SYRK is float32 and one matrix per call: bf16 and batches take the tiled product.
  const bool native = a.dtype == DType::f32 && c.dtype == DType::f32 && c.count == 1;
  const SyrkMethod method{native, native ? 1 : syrk_tiles(c.rows)};
  run(syrk_calls(trans, alpha, a, beta, c, method), a, a, c);
  launch_mirror_upper(c, stream_);
}

void CudaBackend::symmetric_gemm(float alpha, const MatView& a, const MatView& b, float beta, const MatView& c,
                                 int tiles) {
  check_device(a, "symmetric_gemm", "A");
  check_device(b, "symmetric_gemm", "B");
  check_device(c, "symmetric_gemm", "C");
  const std::vector<BlasCall> calls = symmetric_gemm_calls(alpha, a, b, beta, c, tiles);  // checks the shapes
  if (a.cols == 0) return scale_only(c, beta);
  run(calls, a, b, c);
  launch_mirror_upper(c, stream_);
}

// ---- elementwise and reductions ----

void CudaBackend::scale(const MatView& x, float alpha) {
  check_device(x, "scale", "x");
  activate();
  launch_scale(x, alpha, stream_);
}

void CudaBackend::add_identity(const MatView& c, float alpha) {
  check_device(c, "add_identity", "C");
  DMUON_CHECK(c.rows == c.cols, "add_identity: C is ", c.rows, "x", c.cols, ", not square");
  activate();
  launch_add_identity(c, alpha, stream_);
}

void CudaBackend::mirror_upper(const MatView& c) {
  check_device(c, "mirror_upper", "C");
  DMUON_CHECK(c.rows == c.cols, "mirror_upper: C is ", c.rows, "x", c.cols, ", not square");
  activate();
  launch_mirror_upper(c, stream_);
}

void CudaBackend::transpose(const MatView& in, const MatView& out) {
  check_device(in, "transpose", "in");
  check_device(out, "transpose", "out");
  DMUON_CHECK(out.rows == in.cols && out.cols == in.rows && out.count == in.count, "transpose: in is ", in.count, "x",
              in.rows, "x", in.cols, ", out ", out.count, "x", out.rows, "x", out.cols);
  activate();
  launch_transpose(in, out, stream_);
}

void CudaBackend::frobenius_norms(const MatView& x, double* norms) {
  check_device(x, "frobenius_norms", "x");
  activate();
  launch_frobenius_norms(x, norms, stream_);
}

void CudaBackend::scale_by_inverse_norm(const MatView& x, const double* norms, double safety, double eps) {
  check_device(x, "scale_by_inverse_norm", "x");
  activate();
  launch_scale_by_inverse_norm(x, norms, safety, eps, stream_);
}

// ---- update rules ----

void CudaBackend::run(const UpdateRule& rule) {
  activate();
  std::visit(
      [&](const auto& r) {
        rules::checked_size(r);
        rules::run_on_cuda(r, stream_);
      },
      rule.op);
}

// ---- ordering and parallelism ----

void CudaBackend::synchronize() {
  check_not_capturing("synchronize");
  activate();
  DMUON_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::unique_ptr<Event> CudaBackend::record_event() { return std::make_unique<CudaEvent>(device_, stream_); }

void CudaBackend::run_concurrently(int workers, const std::function<void(Backend& queue, int worker)>& fn) {
  if (workers <= 1) {
    fn(*this, 0);
    return;
  }
  // Creating streams and cuBLAS handles, and joining streams with new events, cannot be recorded.
  check_not_capturing("run_concurrently");
  activate();
  while (static_cast<int>(workers_.size()) < workers)
    workers_.push_back(std::make_unique<CudaBackend>(device_, tf32_, graphs_on_));
  // Workers start after what this stream queued so far, and this stream continues after all of them.
  cudaEvent_t ready = nullptr;
  DMUON_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  DMUON_CUDA_CHECK(cudaEventRecord(ready, stream_));
  for (int w = 0; w < workers; ++w) DMUON_CUDA_CHECK(cudaStreamWaitEvent(workers_[w]->stream_, ready, 0));
  cudaEventDestroy(ready);
  for (int w = 0; w < workers; ++w) fn(*workers_[w], w);
  for (int w = 0; w < workers; ++w) {
    cudaEvent_t done = nullptr;
    DMUON_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    DMUON_CUDA_CHECK(cudaEventRecord(done, workers_[w]->stream_));
    DMUON_CUDA_CHECK(cudaStreamWaitEvent(stream_, done, 0));
    cudaEventDestroy(done);  // released once the wait is satisfied
  }
}

int64_t CudaBackend::preferred_batch() const { return std::numeric_limits<int64_t>::max(); }

void CudaBackend::run_graph(const std::vector<int64_t>& key, const std::function<void()>& fn) {
  if (!graphs_on_) {
    fn();
    return;
  }
  activate();
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    if (graphs_.size() >= kMaxGraphs) {  // evict the least recently launched
      auto oldest = std::min_element(graphs_.begin(), graphs_.end(),
                                     [](const auto& x, const auto& y) { return x.second.last_use < y.second.last_use; });
      cudaGraphExecDestroy(oldest->second.exec);
      graphs_.erase(oldest);
    }
    check_not_capturing("run_graph");
    DMUON_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    capturing_ = true;
    cudaGraph_t graph = nullptr;
    try {
      fn();
    } catch (...) {
      capturing_ = false;
      if (cudaStreamEndCapture(stream_, &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
      (void)cudaGetLastError();  // an invalidated capture's error is not the caller's
      throw;
    }
    capturing_ = false;
    DMUON_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t rc = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    DMUON_CUDA_CHECK(rc);
    it = graphs_.emplace(key, Graph{exec, 0}).first;
  }
  it->second.last_use = ++graph_clock_;
  DMUON_CUDA_CHECK(cudaGraphLaunch(it->second.exec, stream_));
}

double CudaBackend::time_queued(const std::function<void()>& enqueue) {
  activate();
  TimingEvents events;
  DMUON_CUDA_CHECK(cudaEventRecord(events.start, stream_));
  enqueue();
  DMUON_CUDA_CHECK(cudaEventRecord(events.stop, stream_));
  DMUON_CUDA_CHECK(cudaEventSynchronize(events.stop));
  float ms = 0;
  DMUON_CUDA_CHECK(cudaEventElapsedTime(&ms, events.start, events.stop));
  return ms / 1e3;
}

}  // namespace dmuon::cuda

namespace dmuon {

Backend& cuda_backend(int index) {
  static std::mutex mutex;
  static std::vector<cuda::CudaBackend*> backends;
  std::lock_guard<std::mutex> lock(mutex);
  const int n = cuda::device_count();
  DMUON_CHECK(index >= 0 && index < n, "device cuda:", index, " does not exist: this machine has ", n,
              " usable CUDA device(s)");
  if (backends.empty()) backends.resize(n, nullptr);
  // Never destroyed: a static destructor would run after the CUDA runtime has shut down.
  if (backends[index] == nullptr)
    backends[index] =
        new cuda::CudaBackend(index, cuda::env_flag("DMUON_CUDA_TF32"), !cuda::env_flag("DMUON_CUDA_NO_GRAPHS"));
  return *backends[index];
}

}  // namespace dmuon
