// The tuned Orthogonalizer (tune.hpp): per call, the cached kernel and compute dtype of its (shape, batch).
#include <cstdlib>
#include <utility>

#include "dmuon/tune.hpp"

namespace dmuon {

NsOptions tuned_options(const std::vector<TuneEntry>& entries, int64_t rows, int64_t cols, int batch,
                        const NsOptions& defaults) {
  const TuneEntry* best = nullptr;
  for (const TuneEntry& e : entries) {
    if (e.rows != rows || e.cols != cols) continue;
    const int d = std::abs(e.batch - batch);
    const int best_d = best ? std::abs(best->batch - batch) : 0;
    if (!best || d < best_d || (d == best_d && e.batch < best->batch)) best = &e;
  }
  if (!best) return defaults;
  NsOptions o = defaults;  // the math (coeffs, steps, safety) is the caller's; the kernel is tuned
  o.algo = best->options.algo;
  o.restarts = best->options.restarts;
  o.symmetric = best->options.symmetric;
  o.tiles = best->options.tiles;
  o.batch_mode = best->options.batch_mode;
  o.threads = best->options.threads;
  o.dtype = best->options.dtype;
  return o;
}

Orthogonalizer tuned_orthogonalizer(std::vector<TuneEntry> entries, NsOptions defaults,
                                    std::function<void(NsOptions&)> adjust) {
  return [entries = std::move(entries), defaults = std::move(defaults), adjust = std::move(adjust)](
             Backend& backend, std::span<const MatView> u, std::span<const MatView> o,
             std::span<const std::string> names, double* norms) {
    if (u.empty()) return;
    NsOptions options = tuned_options(entries, u[0].rows, u[0].cols, static_cast<int>(u.size()), defaults);
    if (adjust) adjust(options);
    newton_schulz_batched(backend, u, o, options, names, norms);
  };
}

}  // namespace dmuon
