// tune_key_for (tune.hpp): what makes GPU timings comparable — the GPU model and the CUDA and cuBLAS versions.
#include "dmuon/error.hpp"
#include "dmuon/tune.hpp"
#ifdef DMUON_HAVE_CUDA
#include "backend/cuda/cuda_backend.hpp"
#endif

namespace dmuon {

TuneKey tune_key_for(Backend& backend, int threads) {
  if (backend.device() == DeviceKind::cpu) return current_tune_key(threads);
#ifdef DMUON_HAVE_CUDA
  if (auto* gpu = dynamic_cast<cuda::CudaBackend*>(&backend)) {
    TuneKey key;
    key.device = to_string(backend.device());
    key.dtype = "bfloat16";
    key.extra = {{"gpu", cuda::device_name(gpu->device_index())}, {"cuda", cuda::library_versions()}};
    return key;
  }
#endif
  DMUON_FAIL("no tuning key for the ", to_string(backend.device()), " backend ", backend.description());
}

}  // namespace dmuon
