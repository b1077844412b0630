// What every backend shares (backend.hpp): views, owned buffers, names, and the choice of backend.
#include "dmuon/backend.hpp"

#include <atomic>
#include <chrono>
#include <string>
#include <utility>

#include "dmuon/error.hpp"

namespace dmuon {

std::string to_string(DeviceKind device) {
  switch (device) {
    case DeviceKind::cpu: return "cpu";
    case DeviceKind::cuda: return "cuda";
    case DeviceKind::record: return "record";
  }
  return "?";
}

DeviceKind parse_device_kind(const std::string& name) {
  if (name == "cpu") return DeviceKind::cpu;
  if (name == "cuda") return DeviceKind::cuda;
  DMUON_FAIL("unknown device '", name, "' (valid: cpu, cuda)");
}

DType ns_default_dtype_rule(bool bf16_units, const char* forced) {
  if (forced == nullptr || *forced == '\0') return bf16_units ? DType::bf16 : DType::f32;
  const std::string value = forced;
  if (value == "bf16") return DType::bf16;
  DMUON_CHECK(value == "f32", "DMUON_NS_DEFAULT_DTYPE must be bf16 or f32 (or unset: the machine's default), got '",
              value, "'");
  return DType::f32;
}

bool ns_bf16_candidate_rule(bool bf16_products, const char* forced) {
  if (forced == nullptr || *forced == '\0') return bf16_products;
  return ns_default_dtype_rule(false, forced) == DType::bf16;
}

MatView MatView::matrix(int64_t i) const {
  DMUON_CHECK(i >= 0 && i < count, "matrix ", i, " of a batch of ", count);
  MatView v = *this;
  v.data = static_cast<char*>(data) + i * batch_stride * static_cast<int64_t>(dtype_size(dtype));
  v.count = 1;
  return v;
}

MatView MatView::first(int64_t n) const {
  DMUON_CHECK(n >= 0 && n <= count, "the first ", n, " matrices of a batch of ", count);
  MatView v = *this;
  v.count = n;
  return v;
}

float* MatView::f32() const {
  DMUON_CHECK(dtype == DType::f32, "a ", to_string(dtype), " view used as float32");
  return static_cast<float*>(data);
}

MatView f32_view(DeviceKind device, float* data, int64_t rows, int64_t cols, int64_t count) {
  return {data, device, DType::f32, rows, cols, cols, count, rows * cols};
}

void Backend::run_graph(const std::vector<int64_t>&, const std::function<void()>& fn) { fn(); }

double Backend::time_queued(const std::function<void()>& enqueue) {
  synchronize();
  const auto start = std::chrono::steady_clock::now();
  enqueue();
  synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

ParallelismScope::ParallelismScope(Backend& backend, int n) : backend_(backend), previous_(backend.parallelism()) {
  if (n > 0 && n != previous_) backend_.set_parallelism(n);
}

ParallelismScope::~ParallelismScope() {
  if (backend_.parallelism() != previous_) backend_.set_parallelism(previous_);
}

namespace {
// Every live Buffer's bytes and their most since the last reset (buffer_bytes).
MemoryCounter buffers;

size_t bytes_of(int64_t size, DType dtype) { return static_cast<size_t>(size) * dtype_size(dtype); }
}  // namespace

void MemoryCounter::allocated(size_t bytes) {
  const size_t now = live_.fetch_add(bytes) + bytes;
  size_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
}

MemoryCount MemoryCounter::read(bool reset_peak) {
  MemoryCount out{live_.load(), peak_.load()};
  if (reset_peak) peak_ = out.live;
  return out;
}

MemoryCount buffer_bytes(bool reset_peak) { return buffers.read(reset_peak); }

Buffer::Buffer(Backend& backend, DType dtype, int64_t size) : backend_(&backend), size_(size), dtype_(dtype) {
  DMUON_CHECK(size >= 0, "buffer of negative size ", size);
  if (size > 0) {
    data_ = backend.allocate(bytes_of(size, dtype));
    buffers.allocated(bytes_of(size, dtype));
  }
}

Buffer::~Buffer() {
  if (data_) {
    backend_->deallocate(data_);
    buffers.freed(bytes_of(size_, dtype_));
  }
}

Buffer::Buffer(Buffer&& other) noexcept
    : backend_(other.backend_), data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)),
      dtype_(other.dtype_) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    if (data_) {
      backend_->deallocate(data_);
      buffers.freed(bytes_of(size_, dtype_));
    }
    backend_ = other.backend_;
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    dtype_ = other.dtype_;
  }
  return *this;
}

float* Buffer::f32() const {
  DMUON_CHECK(dtype_ == DType::f32, "a ", to_string(dtype_), " buffer used as float32");
  return static_cast<float*>(data_);
}

MatView Buffer::view(int64_t rows, int64_t cols, int64_t count, int64_t offset) const {
  DMUON_CHECK(rows >= 0 && cols >= 0 && count >= 0 && offset >= 0 && offset + count * rows * cols <= size_,
              count, " matrices of ", rows, "x", cols, " from element ", offset, " do not fit a buffer of ", size_);
  return {static_cast<char*>(data_) + offset * static_cast<int64_t>(dtype_size(dtype_)),
          backend_ ? backend_->device() : DeviceKind::cpu,
          dtype_,
          rows,
          cols,
          cols,
          count,
          rows * cols};
}

void Buffer::upload(std::span<const float> values, int64_t offset) {
  DMUON_CHECK(offset >= 0 && offset + static_cast<int64_t>(values.size()) <= size_, "upload of ", values.size(),
              " values at ", offset, " into a buffer of ", size_);
  if (!values.empty()) backend_->copy_from_host(f32() + offset, values.data(), values.size_bytes());
}

void Buffer::download(std::span<float> values, int64_t offset) const {
  DMUON_CHECK(offset >= 0 && offset + static_cast<int64_t>(values.size()) <= size_, "download of ", values.size(),
              " values at ", offset, " from a buffer of ", size_);
  if (!values.empty()) backend_->copy_to_host(values.data(), f32() + offset, values.size_bytes());
}

int cpu_device_count();  // 1 (src/backend/cpu), or 0 in the GPU-only build (no_cpu_backend.cpp)
#ifdef DMUON_HAVE_CUDA
Backend& cuda_backend(int index);  // src/backend/cuda
namespace cuda {
int device_count();  // src/backend/cuda
}
#endif

int device_count(DeviceKind device) {
  switch (device) {
    case DeviceKind::cpu: return cpu_device_count();
    case DeviceKind::cuda:
#ifdef DMUON_HAVE_CUDA
      return cuda::device_count();
#else
      return 0;
#endif
    case DeviceKind::record: return 1;
  }
  return 0;
}

Backend& backend_for(DeviceKind device, int index) {
  switch (device) {
    case DeviceKind::cpu: return cpu_backend();
    case DeviceKind::cuda:
#ifdef DMUON_HAVE_CUDA
      return cuda_backend(index);
#else
      DMUON_FAIL("device cuda:", index, " was asked for, but this build of dmuon has no CUDA backend "
                 "(configure with -DDMUON_CUDA=ON on a machine with the CUDA toolkit)");
#endif
    case DeviceKind::record: break;
  }
  DMUON_FAIL("no shared backend for device '", to_string(device), "' (make a RecordingBackend instead)");
}

}  // namespace dmuon
