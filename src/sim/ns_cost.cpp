// Newton–Schulz time on an accelerator: each GEMM of the recurrence on a roofline (compute at
// ns_flops·ns_efficiency scaled by how many SMs its output tiles fill, capped by HBM traffic),
// plus one kernel launch per GEMM (a batched GEMM runs the whole batch in one launch).
#include <algorithm>
#include <cmath>
#include <vector>

#include "dmuon/sim.hpp"

namespace dmuon::sim {

namespace {

constexpr int kSteps = 5;
constexpr double kTile = 128;  // output tile edge of a tensor-core GEMM kernel
constexpr double kBytesPerElement = 2;  // bf16 operands

// C(M×N) = A(M×K)·B(K×N) for `batch` matrices; symmetric: only the upper triangle is computed.
struct Gemm {
  double m, n, k;
  bool symmetric;
};

double gemm_time_s(const Gemm& g, int batch, const HardwareProfile& hw) {
  const double share = g.symmetric ? 0.5 : 1.0;
  const double flops = batch * share * 2 * g.m * g.n * g.k;
  const double tiles = batch * share * std::ceil(g.m / kTile) * std::ceil(g.n / kTile);
  const double occupancy = std::min(1.0, tiles / hw.sm_count);
  const double compute = flops / (hw.ns_flops * hw.ns_efficiency * occupancy);
  const double bytes = batch * kBytesPerElement * (g.m * g.k + g.k * g.n + share * g.m * g.n);
  return std::max(compute, bytes / hw.hbm_bytes_per_s) + hw.kernel_launch_s;
}

double sequence_time_s(const std::vector<Gemm>& gemms, int batch, const HardwareProfile& hw) {
  double t = 0;
  for (const Gemm& g : gemms) t += gemm_time_s(g, batch, hw);
  return t;
}

// Standard recurrence on m×n (m ≤ n): A = XXᵀ, B = bA + cA·A, X = aX + B·X per step.
std::vector<Gemm> standard_gemms(double m, double n, bool symmetric) {
  std::vector<Gemm> out;
  for (int t = 0; t < kSteps; ++t) {
    out.push_back({m, m, n, symmetric});
    out.push_back({m, m, m, symmetric});
    out.push_back({m, n, m, false});
  }
  return out;
}

// Gram recurrence with a restart at step 2 (DESIGN 2.2), symmetric products throughout.
std::vector<Gemm> gram_gemms(double m, double n) {
  const int restart = 2;
  std::vector<Gemm> out{{m, m, n, true}};  // R = XXᵀ
  bool have_q = false;
  for (int t = 0; t < kSteps; ++t) {
    if (t == restart) {
      out.push_back({m, n, m, false});  // X = Q·X
      out.push_back({m, m, n, true});   // R = XXᵀ
      have_q = false;
    }
    out.push_back({m, m, m, true});                 // Z = bR + cR·R
    if (have_q) out.push_back({m, m, m, true});     // Q = Q·Z + aQ
    have_q = true;
    if (t < kSteps - 1 && t + 1 != restart) {
      out.push_back({m, m, m, true});  // RZ = R·Z + aR
      out.push_back({m, m, m, true});  // R = Z·RZ + aRZ
    }
  }
  out.push_back({m, n, m, false});  // O = Q·X
  return out;
}

// The normalisation X = U/‖U‖: two passes over the matrix, one launch each.
double normalise_time_s(double m, double n, int batch, const HardwareProfile& hw) {
  return 2 * (batch * m * n * 2 * kBytesPerElement / hw.hbm_bytes_per_s + hw.kernel_launch_s);
}

}  // namespace

double ns_time_s(int64_t rows, int64_t cols, int batch, NsEngine engine, const HardwareProfile& hw) {
  const double m = static_cast<double>(std::min(rows, cols));
  const double n = static_cast<double>(std::max(rows, cols));
  if (batch <= 0 || m == 0) return 0;
  if (engine == NsEngine::plain) {
    // One matrix per kernel: the batch runs one after another.
    return batch * (sequence_time_s(standard_gemms(m, n, false), 1, hw) + normalise_time_s(m, n, 1, hw));
  }
  const double standard = sequence_time_s(standard_gemms(m, n, true), batch, hw);
  const double gram = sequence_time_s(gram_gemms(m, n), batch, hw);
  return std::min(standard, gram) + normalise_time_s(m, n, batch, hw);
}

}  // namespace dmuon::sim
