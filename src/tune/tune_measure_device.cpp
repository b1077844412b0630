// The autotuner's clock on a device backend (tune.hpp: make_ns_timer(Backend&)): newton_schulz_batched on
// fixed random Gaussian inputs in the backend's memory, each candidate in its own compute dtype, timed with
// Backend::time_queued (CUDA events on a GPU, so the time is the device's, not the host's queueing).
#include <algorithm>
#include <memory>
#include <random>
#include <tuple>

#include "dmuon/error.hpp"
#include "dmuon/tune.hpp"

namespace dmuon {

namespace {

// Inputs and outputs of one (shape, batch) on the backend, reused across candidates.
struct DeviceTimerState {
  int64_t rows = 0, cols = 0;
  int batch = 0;
  Buffer in, out, norms;
  std::vector<MatView> u, o;
  std::vector<NsOptions> warmed;  // the candidates run once on this shape already

  void prepare(Backend& backend, int64_t r, int64_t c, int b) {
    rows = r, cols = c, batch = b;
    std::mt19937 rng(1234);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> host(static_cast<size_t>(r * c * b));
    for (float& x : host) x = normal(rng);
    in = Buffer(backend, DType::f32, r * c * b);
    out = Buffer(backend, DType::f32, r * c * b);
    norms = Buffer(backend, DType::f32, 2 * b);  // b doubles: the non-finite check stays on the device
    in.upload(host);
    u.clear();
    o.clear();
    warmed.clear();
    for (int i = 0; i < b; ++i) {
      u.push_back(in.view(r, c, 1, i * r * c));
      o.push_back(out.view(r, c, 1, i * r * c));
    }
  }
};

}  // namespace

MeasureFn make_ns_timer(Backend& backend) {
  auto state = std::make_shared<DeviceTimerState>();
  Backend* be = &backend;
  return [state, be](const NsOptions& options, int64_t rows, int64_t cols, int batch) {
    DMUON_CHECK(rows > 0 && cols > 0 && batch > 0, "cannot time shape ", rows, "x", cols, " batch ", batch);
    auto run = [&] {
      newton_schulz_batched(*be, state->u, state->o, options, {}, reinterpret_cast<double*>(state->norms.data()));
    };
    if (std::tie(state->rows, state->cols, state->batch) != std::tie(rows, cols, batch))
      state->prepare(*be, rows, cols, batch);
    // Each candidate's first run is a warm-up, not timed: it allocates its workspace, lets cuBLAS pick its
    // kernels and, on a GPU, captures and instantiates its CUDA graph, which a timing would count as work.
    if (std::find(state->warmed.begin(), state->warmed.end(), options) == state->warmed.end()) {
      run();
      state->warmed.push_back(options);
    }
    return be->time_queued(run);
  };
}

}  // namespace dmuon
