// The float64 Newton–Schulz reference (ns_reference.hpp, Keller coefficients, 5 steps) as an
// Orthogonalizer, for optimizer tests that must not depend on the fast NS paths.
#pragma once

#include <span>
#include <string>

#include "dmuon/optim.hpp"
#include "ns_reference.hpp"

namespace dmuon::test {

inline Orthogonalizer reference_orthogonalizer() {
  return [](std::span<const float* const> u, std::span<float* const> o, int64_t rows, int64_t cols,
            std::span<const std::string>) {
    const std::vector<NsStep> schedule = ns_schedule(NsCoeffs::keller, 5);
    for (size_t i = 0; i < u.size(); ++i) {
      const std::vector<float> x = to_floats(standard_ns_reference(from_floats(u[i], rows, cols), schedule, 1.0));
      std::copy(x.begin(), x.end(), o[i]);
    }
  };
}

}  // namespace dmuon::test
