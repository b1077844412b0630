// Central finite-difference checks of hand-written backward passes (float32 forward, float64 loss).
//
// For a scalar f(x) computed from float32 outputs and summed in double, the numerical derivative
// (f(x+h) − f(x−h)) / (x₊ − x₋) — with x₊, x₋ the float32 values actually stored — differs from the
// true derivative by truncation, about h²·|f'''|/6, and by float32 rounding of f, about ε_f / h.
// With h = 1e-2·max(1, |x|) the truncation part is h²·|f'''/f'|/6 relative, under rtol = 1e-3 while
// |f'''/f'| ≤ 60 (true of these smooth layers at O(1) inputs); ε_f ≤ noise_scale·√K·u (u = 2⁻²⁴, K the
// longest float32 reduction, noise_scale = Σ|terms of f|: the statistical, not worst-case, growth of K
// roundings) gives atol = ε_f / h. Measured on the tests here, errors stay under 7% of that tolerance.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

namespace dmuon::test {

struct GradCheck {
  double noise_scale = 1.0;  // Σ |terms| of f at x, for the rounding allowance
  int64_t reduction = 1;     // K: longest float32 sum behind one output
  int max_checks = 0;        // 0: every element; else an evenly spaced subset of that many
};

struct GradCheckReport {
  int64_t checked = 0, failures = 0;
  double worst_excess = 0;  // max |num − g| / tolerance
};

// Perturbs x[i] (restored afterwards) and compares with analytic[i]. f must read x.
inline GradCheckReport check_gradient(const std::string& what, std::vector<float>& x,
                                      const std::vector<float>& analytic, const std::function<double()>& f,
                                      const GradCheck& opt) {
  constexpr double kU = 0x1.0p-24;
  constexpr double kRtol = 1e-3;
  const int64_t n = static_cast<int64_t>(x.size());
  const int64_t stride = opt.max_checks > 0 ? std::max<int64_t>(1, n / opt.max_checks) : 1;
  GradCheckReport report;
  for (int64_t i = 0; i < n; i += stride) {
    const float x0 = x[i];
    const double h = 1e-2 * std::max(1.0, std::fabs(static_cast<double>(x0)));
    const float xp = static_cast<float>(x0 + h), xm = static_cast<float>(x0 - h);
    x[i] = xp;
    const double fp = f();
    x[i] = xm;
    const double fm = f();
    x[i] = x0;
    const double step = static_cast<double>(xp) - static_cast<double>(xm);
    const double numerical = (fp - fm) / step;
    const double atol = opt.noise_scale * std::sqrt(static_cast<double>(opt.reduction)) * kU / (step / 2);
    const double tol = atol + kRtol * std::fabs(numerical);
    const double err = std::fabs(numerical - analytic[i]);
    report.checked++;
    report.worst_excess = std::max(report.worst_excess, err / tol);
    if (err > tol) {
      if (report.failures < 5) {
        ADD_FAILURE() << what << "[" << i << "]: analytic " << analytic[i] << " vs numerical " << numerical
                      << " (|diff| " << err << " > tol " << tol << ")";
      }
      report.failures++;
    }
  }
  return report;
}

}  // namespace dmuon::test
