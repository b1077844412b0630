// The production Orthogonalizer: newton_schulz_batched behind the optimizer's function type.
#include "dmuon/ns.hpp"

namespace dmuon {

Orthogonalizer ns_orthogonalizer(const NsOptions& options) {
  return [options](std::span<const float* const> u, std::span<float* const> o, int64_t rows, int64_t cols,
                   std::span<const std::string> names) { newton_schulz_batched(u, o, rows, cols, options, names); };
}

}  // namespace dmuon
