// time_on (device_timing.hpp): CUDA events on a CUDA backend, the steady clock elsewhere.
#include "dmuon/device_timing.hpp"

#include <chrono>

#ifdef DMUON_HAVE_CUDA
#include "backend/cuda/cuda_backend.hpp"
#endif

namespace dmuon {

double time_on(Backend& backend, const std::function<void()>& enqueue) {
#ifdef DMUON_HAVE_CUDA
  if (auto* gpu = dynamic_cast<cuda::CudaBackend*>(&backend)) return gpu->time_on_device(enqueue);
#endif
  backend.synchronize();
  const auto start = std::chrono::steady_clock::now();
  enqueue();
  backend.synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace dmuon
