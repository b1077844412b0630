// The float64 Newton–Schulz reference (ns_reference.hpp, Keller coefficients, 5 steps) as an
// Orthogonalizer, for optimizer tests that must not depend on the fast NS paths.
#pragma once

#include <span>
#include <string>

#include "dmuon/ns.hpp"
#include "ns_reference.hpp"

namespace dmuon::test {

inline Orthogonalizer reference_orthogonalizer() {
  return [](Backend&, std::span<const MatView> u, std::span<const MatView> o, std::span<const std::string>,
            double* norms) {
    const std::vector<NsStep> schedule = ns_schedule(NsCoeffs::keller, 5);
    for (size_t i = 0; i < u.size(); ++i) {
      const MatD in = from_floats(u[i].f32(), u[i].rows, u[i].cols);
      if (norms) norms[i] = frobenius(in);
      const std::vector<float> x = to_floats(standard_ns_reference(in, schedule, 1.0));
      std::copy(x.begin(), x.end(), o[i].f32());
    }
  };
}

}  // namespace dmuon::test
