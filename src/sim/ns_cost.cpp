// Newton–Schulz time on one device: the kernels src/ns/newton_schulz.cpp issues for one matrix (its
// matrix products and its memory passes: norm, scale, copies), each on a roofline and each paying one
// launch. Products: compute at ns_flops·ns_efficiency scaled by how many SMs the output tiles fill,
// capped by memory traffic; a symmetric product takes the full product's time / the profile's speedup.
// Passes move their bytes at memory bandwidth. With batched kernels a batch of same-shape matrices runs
// each operation once for the whole batch; otherwise (the CPU, and the plain engine) matrix by matrix.
#include <algorithm>
#include <cmath>
#include <vector>

#include "dmuon/sim.hpp"

namespace dmuon::sim {

namespace {

constexpr int kSteps = 5;
constexpr double kTile = 128;  // output tile edge of a tensor-core GEMM kernel

enum class Product { full, syrk, sym_gemm };

// One kernel: C(M×N) = A(M×K)·B(K×N) when `elements` is 0, else a pass moving `elements` values
// (reads plus writes).
struct Kernel {
  double m = 0, n = 0, k = 0;
  Product product = Product::full;
  double elements = 0;
};
Kernel gemm(double m, double n, double k, Product p) { return {m, n, k, p, 0}; }
Kernel pass(double elements) { return {0, 0, 0, Product::full, elements}; }

// Seconds of one kernel on `batch` matrices at once, without its launch.
double kernel_time_s(const Kernel& g, int batch, const HardwareProfile& hw) {
  const double bpe = hw.ns_bytes_per_element;
  if (g.elements > 0) return batch * g.elements * bpe / hw.hbm_bytes_per_s;
  const double flops = batch * 2 * g.m * g.n * g.k;
  const double tiles = batch * std::ceil(g.m / kTile) * std::ceil(g.n / kTile);
  const double occupancy = std::min(1.0, tiles / hw.sm_count);
  const double compute = flops / (hw.ns_flops * hw.ns_efficiency * occupancy);
  const double bytes = batch * bpe * (g.m * g.k + g.k * g.n + g.m * g.n);
  const double full = std::max(compute, bytes / hw.hbm_bytes_per_s);
  switch (g.product) {
    case Product::syrk: return full / hw.syrk_speedup;
    case Product::sym_gemm: return full / hw.sym_gemm_speedup;
    case Product::full: break;
  }
  return full;
}

// Around either recurrence on X (m×n, m ≤ n): ‖U‖ (one read), X = U (copy), X /= ‖U‖ (scale); at the end
// O = result (copy).
void add_normalise_and_copy_out(std::vector<Kernel>& out, double m, double n) {
  out.insert(out.begin(), {pass(m * n), pass(2 * m * n), pass(2 * m * n)});
  out.push_back(pass(2 * m * n));
}

// Standard recurrence: A = XXᵀ, B = bA + cA·A (B = A copied, then accumulated), Y = X copied, X = aY + B·X.
std::vector<Kernel> standard_kernels(double m, double n, bool symmetric) {
  const Product sym = symmetric ? Product::syrk : Product::full;
  std::vector<Kernel> out;
  for (int t = 0; t < kSteps; ++t) {
    out.push_back(gemm(m, m, n, sym));
    out.push_back(pass(2 * m * m));
    out.push_back(gemm(m, m, m, sym));
    out.push_back(pass(2 * m * n));
    out.push_back(gemm(m, n, m, Product::full));
  }
  add_normalise_and_copy_out(out, m, n);
  return out;
}

// Gram recurrence with a restart at step 2 (DESIGN 2.2), as gram_recurrence issues it.
std::vector<Kernel> gram_kernels(double m, double n) {
  const int restart = 2;
  std::vector<Kernel> out{gemm(m, m, n, Product::syrk)};  // R = XXᵀ
  bool have_q = false;
  for (int t = 0; t < kSteps; ++t) {
    if (t == restart) {
      out.push_back(gemm(m, n, m, Product::full));  // X = Q·X
      out.push_back(gemm(m, m, n, Product::syrk));  // R = XXᵀ
      have_q = false;
    }
    out.push_back(pass(2 * m * m));                   // Z = R (copy)
    out.push_back(gemm(m, m, m, Product::syrk));      // Z = bZ + cR·R
    out.push_back(pass(2 * m * m));                   // Q = Z or T = Q (copy)
    if (have_q) {
      out.push_back(gemm(m, m, m, Product::sym_gemm));  // Q = Q·Z + aQ
    } else {
      out.push_back(pass(2 * m));  // Q += aI
    }
    have_q = true;
    if (t < kSteps - 1 && t + 1 != restart) {
      out.push_back(pass(2 * m * m));                   // T = R
      out.push_back(gemm(m, m, m, Product::sym_gemm));  // RZ = R·Z + aR
      out.push_back(pass(2 * m * m));                   // R = RZ
      out.push_back(gemm(m, m, m, Product::sym_gemm));  // R = Z·RZ + aRZ
    }
  }
  out.push_back(gemm(m, n, m, Product::full));  // O = Q·X
  add_normalise_and_copy_out(out, m, n);
  return out;
}

NsCost sequence_cost(const std::vector<Kernel>& kernels, int batch, const HardwareProfile& hw) {
  // Without batched kernels the matrices run one after another: `batch` times one matrix.
  const int together = hw.batched_kernels ? batch : 1;
  const double repeats = static_cast<double>(batch) / together;
  NsCost c;
  for (const Kernel& k : kernels) (k.elements > 0 ? c.passes_s : c.products_s) += repeats * kernel_time_s(k, together, hw);
  c.kernels = static_cast<int>(kernels.size());
  c.launch_s = repeats * c.kernels * hw.kernel_launch_s;
  c.total_s = c.products_s + c.passes_s + c.launch_s;
  return c;
}

NsCost times(NsCost c, double k) {
  c.total_s *= k;
  c.products_s *= k;
  c.passes_s *= k;
  c.launch_s *= k;
  return c;
}

}  // namespace

NsCost ns_cost(int64_t rows, int64_t cols, int batch, NsEngine engine, const HardwareProfile& hw) {
  const double m = static_cast<double>(std::min(rows, cols));
  const double n = static_cast<double>(std::max(rows, cols));
  if (batch <= 0 || m == 0) return {};
  if (engine == NsEngine::plain) {
    // The public reference: one matrix per call, full GEMMs.
    return times(sequence_cost(standard_kernels(m, n, false), 1, hw), batch);
  }
  const NsCost standard = sequence_cost(standard_kernels(m, n, true), batch, hw);
  const NsCost gram = sequence_cost(gram_kernels(m, n), batch, hw);
  return gram.total_s < standard.total_s ? gram : standard;
}

double ns_time_s(int64_t rows, int64_t cols, int batch, NsEngine engine, const HardwareProfile& hw) {
  return ns_cost(rows, cols, batch, engine, hw).total_s;
}

}  // namespace dmuon::sim
