// tune_key_for (tune.hpp): what makes GPU timings comparable — the GPU model and the CUDA and cuBLAS versions.
#include "dmuon/error.hpp"
#include "dmuon/tune.hpp"

namespace dmuon {

TuneKey tune_key_for(Backend& backend, int threads) {
  if (backend.device() == DeviceKind::cpu) return current_tune_key(threads);
  DMUON_CHECK(backend.device() == DeviceKind::cuda, "no tuning key for the ", to_string(backend.device()),
              " backend ", backend.description());
  const DeviceProperties device = backend.properties();
  TuneKey key;
  key.device = to_string(backend.device());
  key.dtype = "bfloat16";
  key.extra = {{"gpu", device.name}, {"cuda", device.versions}};
  return key;
}

}  // namespace dmuon
