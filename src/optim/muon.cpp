// The production Orthogonalizer (Newton–Schulz from src/ns) and the single-process Muon. Kept apart
// from optimizer.cpp so code that supplies its own Orthogonalizer does not link the NS engine.
#include "dmuon/ns.hpp"
#include "dmuon/optim.hpp"

namespace dmuon {

Orthogonalizer ns_orthogonalizer(const NsOptions& options) {
  return [options](std::span<const float* const> u, std::span<float* const> o, int64_t rows, int64_t cols,
                   std::span<const std::string> names) { newton_schulz_batched(u, o, rows, cols, options, names); };
}

Muon::Muon(std::vector<ParamRef> params, OptimizerOptions options)
    : Optimizer(std::move(params), options, ns_orthogonalizer(options.muon.ns)) {}

Muon::Muon(std::vector<ParamRef> params, OptimizerOptions options, Orthogonalizer orth)
    : Optimizer(std::move(params), std::move(options), std::move(orth)) {}

}  // namespace dmuon
