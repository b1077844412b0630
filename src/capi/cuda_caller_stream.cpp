// The C ABI's CUDA calls (cuda_caller_stream.hpp).
#include "capi/cuda_caller_stream.hpp"

#include <cuda_runtime_api.h>

#include <string>

#include "backend/cuda_support.hpp"
#include "capi/abi_calls.hpp"

namespace dmuon::capi {

namespace {

// The thread's current CUDA device, put back on scope exit (the backend makes its own device current).
class CurrentDeviceKept {
 public:
  CurrentDeviceKept() { DMUON_CUDA_CHECK(cudaGetDevice(&device_)); }
  ~CurrentDeviceKept() {
    if (cudaSetDevice(device_) != cudaSuccess) (void)cudaGetLastError();
  }
  CurrentDeviceKept(const CurrentDeviceKept&) = delete;
  CurrentDeviceKept& operator=(const CurrentDeviceKept&) = delete;

 private:
  int device_ = 0;
};

// `waiter` waits for the work queued on `signaller` so far (an event recorded there; the host does not wait).
void order_after(cudaStream_t waiter, cudaStream_t signaller) {
  cudaEvent_t event = nullptr;
  DMUON_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  const cudaError_t recorded = cudaEventRecord(event, signaller);
  const cudaError_t waited = recorded == cudaSuccess ? cudaStreamWaitEvent(waiter, event, 0) : recorded;
  cudaEventDestroy(event);  // released once the wait is satisfied
  DMUON_CUDA_CHECK(waited);
}

}  // namespace

int cuda_devices() {
  static const int count = device_count(DeviceKind::cuda);
  return count;
}

int cuda_device_of(std::span<const void* const> pointers, const std::function<std::string(size_t)>& name_of) {
  int device = -1;
  for (size_t i = 0; i < pointers.size(); ++i) {
    cudaPointerAttributes attributes{};
    const cudaError_t rc = cudaPointerGetAttributes(&attributes, pointers[i]);
    if (rc != cudaSuccess) (void)cudaGetLastError();
    const bool on_device = rc == cudaSuccess && (attributes.type == cudaMemoryTypeDevice ||
                                                 attributes.type == cudaMemoryTypeManaged);
    DMUON_CHECK(on_device, name_of(i), " is not CUDA device memory (",
                rc != cudaSuccess ? cudaGetErrorString(rc)
                                  : attributes.type == cudaMemoryTypeHost ? "pinned host memory" : "host memory",
                "): device cuda takes device pointers");
    if (device < 0) device = attributes.device;
    DMUON_CHECK(attributes.device == device, name_of(i), " is on cuda:", attributes.device, ", ", name_of(0),
                " on cuda:", device, ": one call takes one device's memory");
  }
  DMUON_CHECK(device >= 0, "no pointers to find the CUDA device from");
  return device;
}

void on_caller_stream(int device, void* stream, const std::function<void(Backend&)>& work) {
  CurrentDeviceKept kept;
  Backend& backend = backend_for(DeviceKind::cuda, device);
  const auto queue = static_cast<cudaStream_t>(backend.native_queue());
  const auto caller = static_cast<cudaStream_t>(stream);
  DMUON_CUDA_CHECK(cudaSetDevice(device));
  run_joined(backend, {[&] { order_after(queue, caller); }, [&] { order_after(caller, queue); }}, work);
}

}  // namespace dmuon::capi
