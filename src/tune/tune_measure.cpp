// The autotuner's clock: newton_schulz_batched timed on fixed random Gaussian inputs.
#include <chrono>
#include <memory>
#include <random>
#include <tuple>

#include "dmuon/error.hpp"
#include "dmuon/tune.hpp"

namespace dmuon {

namespace {

// Inputs and outputs of one (shape, batch), reused across candidates.
struct TimerState {
  int64_t rows = 0, cols = 0;
  int batch = 0;
  std::vector<std::vector<float>> in, out;  // batch × (rows·cols)
  std::vector<const float*> in_ptr;
  std::vector<float*> out_ptr;

  void prepare(int64_t r, int64_t c, int b) {
    rows = r, cols = c, batch = b;
    std::mt19937 rng(1234);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    in.assign(b, std::vector<float>(static_cast<size_t>(r * c)));
    out.assign(b, std::vector<float>(static_cast<size_t>(r * c)));
    in_ptr.clear();
    out_ptr.clear();
    for (int i = 0; i < b; ++i) {
      for (auto& x : in[i]) x = normal(rng);
      in_ptr.push_back(in[i].data());
      out_ptr.push_back(out[i].data());
    }
  }
};

}  // namespace

MeasureFn make_ns_timer() {
  auto state = std::make_shared<TimerState>();
  return [state](const NsOptions& options, int64_t rows, int64_t cols, int batch) {
    DMUON_CHECK(rows > 0 && cols > 0 && batch > 0, "cannot time shape ", rows, "x", cols, " batch ", batch);
    auto run = [&] { newton_schulz_batched(state->in_ptr, state->out_ptr, rows, cols, options); };
    if (std::tie(state->rows, state->cols, state->batch) != std::tie(rows, cols, batch)) {
      state->prepare(rows, cols, batch);
      run();  // warm-up: first touch of the buffers, BLAS thread start, workspaces
    }
    const auto t0 = std::chrono::steady_clock::now();
    run();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
}

}  // namespace dmuon
