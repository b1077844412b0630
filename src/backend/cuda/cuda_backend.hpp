// The CUDA backend (DESIGN 6): every Backend operation on device memory, queued on one CUDA stream per object
// with its own cuBLAS handle. Products run as the column-major calls of cublas_calls.hpp (float32: cublasSsyrk
// for one X·Xᵀ, GemmEx otherwise; bfloat16: GemmEx / GemmStridedBatchedEx with float32 accumulation; a batch is
// one strided-batched call per product); elementwise ops and reductions are the kernels of kernels.hpp. Nothing
// waits for the device except copy_to_host, synchronize and Event::wait. Internal header: code outside
// src/backend reaches the device and its stream through Backend::properties() and Backend::native_queue().
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cublas_calls.hpp"
#include "backend/cuda_support.hpp"
#include "dmuon/backend.hpp"

namespace dmuon::cuda {

class CudaBackend final : public Backend {
 public:
  // A backend on `device` with a new stream. tf32: float32 products may use TF32 tensor cores (off by default;
  // env DMUON_CUDA_TF32=1 turns it on for backend_for's backends).
  // graphs = false: run_graph calls fn every time (DMUON_CUDA_NO_GRAPHS=1, to compare or to isolate a graph bug).
  explicit CudaBackend(int device, bool tf32 = false, bool graphs = true);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  int device_index() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  bool tf32() const { return tf32_; }

  DeviceKind device() const override { return DeviceKind::cuda; }
  std::string description() const override;
  DeviceProperties properties() const override;  // native_queue: stream()
  void* native_queue() const override { return stream_; }
  bool supports(DType dtype) const override { return dtype == DType::f32 || dtype == DType::bf16; }
  bool host_memory() const override { return false; }

  void* allocate(size_t bytes) override;
  void deallocate(void* p) noexcept override;
  void copy_from_host(void* dst, const void* src, size_t bytes) override;
  void copy_to_host(void* dst, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void convert(const MatView& in, const MatView& out) override;
  void fill(const MatView& x, float value) override;

  void gemm(bool trans_a, bool trans_b, float alpha, const MatView& a, const MatView& b, float beta,
            const MatView& c) override;
  void syrk(bool trans, float alpha, const MatView& a, float beta, const MatView& c) override;
  void symmetric_gemm(float alpha, const MatView& a, const MatView& b, float beta, const MatView& c,
                      int tiles) override;

  void scale(const MatView& x, float alpha) override;
  void add_identity(const MatView& c, float alpha) override;
  void mirror_upper(const MatView& c) override;
  void transpose(const MatView& in, const MatView& out) override;
  void frobenius_norms(const MatView& x, double* norms) override;
  void scale_by_inverse_norm(const MatView& x, const double* norms, double safety, double eps) override;

  // The rule's CUDA launcher (src/backend/rules/<rule>.cu) on this stream.
  void run(const UpdateRule& rule) override;

  void synchronize() override;
  std::unique_ptr<Event> record_event() override;
  // Queues fn's work for each worker on its own stream; the streams start after this stream's work so far and
  // this stream continues after all of them (done in queue order; the host does not wait).
  void run_concurrently(int workers, const std::function<void(Backend& queue, int worker)>& fn) override;
  // One stream is one worker: parallelism is 1 and setting it changes nothing.
  int parallelism() const override { return 1; }
  int set_parallelism(int) override { return 1; }
  int64_t preferred_batch() const override;
  // One CUDA graph per key: captured from fn on the key's first call (stream capture of this stream, thread-local
  // mode, so a forbidden call inside fn fails the capture instead of running), instantiated, and launched on
  // this and every later call with the key. Pointers are part of the key (backend.hpp), so a graph never
  // replays on other buffers and needs no cudaGraphExecUpdate. The cache is bounded: a graph goes when a buffer
  // whose address its key names is deallocated here, or, past kMaxGraphs, when it is the least recently launched.
  void run_graph(const std::vector<int64_t>& key, const std::function<void()>& fn) override;
  // CUDA events around the queued work on this stream (no host timing).
  double time_queued(const std::function<void()>& enqueue) override;

 private:
  void activate() const;  // makes device_ current for this thread
  void run(const std::vector<BlasCall>& calls, const MatView& a, const MatView& b, const MatView& c);
  // C ← beta·C: a product with k = 0, kept from cuBLAS (which has got beta scaling wrong for it before).
  void scale_only(const MatView& c, float beta);
  void check_device(const MatView& v, const char* op, const char* name) const;
  void check_not_capturing(const char* op) const;  // host waits and allocations are not capturable

  int device_;
  bool tf32_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  std::vector<std::unique_ptr<CudaBackend>> workers_;  // run_concurrently's streams, made on first use
  void* blas_workspace_ = nullptr;  // cuBLAS's workspace, fixed so that captured graphs do not allocate
  struct Graph {
    cudaGraphExec_t exec = nullptr;
    uint64_t last_use = 0;  // graph_clock_ at its last launch
  };
  std::map<std::vector<int64_t>, Graph> graphs_;  // run_graph's, by key
  uint64_t graph_clock_ = 0;
  bool graphs_on_ = true;
  bool capturing_ = false;
};

// The cuBLAS math mode of every backend's handle: float32 products in float32 (TF32 tensor cores when `tf32`),
// and every product's reduction in float32 (CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION, DESIGN's float32
// accumulation; PyTorch's allow_bf16_reduced_precision_reduction = False).
cublasMath_t blas_math_mode(bool tf32);
// query_event: backend/cuda_support.hpp.
// The number of CUDA devices this process sees (0 without a driver or device: never throws); above the backend,
// device_count(DeviceKind::cuda) (backend.hpp).
int device_count();
// "NVIDIA H200" for device `index`.
std::string device_name(int index);
// "CUDA runtime 13.0, driver 13.0, cuBLAS 13.1.0".
std::string library_versions();
// "NVIDIA H200, CUDA runtime 13.0, driver 13.0, cuBLAS 13.1.0" for device `index`.
std::string device_description(int index);
}  // namespace dmuon::cuda

namespace dmuon {
// The process's backend for CUDA device `index` (created on first use, kept for the process): backend_for's
// cuda branch (src/backend/backend.cpp). Throws naming the device when this machine has no such device.
Backend& cuda_backend(int index);
}  // namespace dmuon
