// Newton–Schulz time on one device: the kernels the NS engine issues for one matrix (its matrix products and
// its memory passes: norm, scale, copies), recorded by running it on the recording backend
// (backend_record.hpp), each on a roofline and each paying one launch. Products: compute at ns_flops·ns_efficiency scaled by how many SMs the output tiles fill,
// capped by memory traffic; a symmetric product takes the full product's time / the profile's speedup.
// Passes move their bytes at memory bandwidth. With batched kernels a batch of same-shape matrices runs
// each operation once for the whole batch; otherwise (the CPU, and the plain engine) matrix by matrix.
#include <algorithm>
#include <cmath>
#include <vector>

#include "dmuon/backend_record.hpp"
#include "dmuon/ns.hpp"
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

// The kernels newton_schulz_batched issues for one rows×cols matrix (the real engine on the recording
// backend), as roofline kernels: products keep their shape and kind, passes the float32 elements they move.
std::vector<Kernel> engine_kernels(int64_t rows, int64_t cols, const NsOptions& options) {
  std::vector<Kernel> out;
  for (const KernelCall& c : ns_kernel_calls(rows, cols, 1, options)) {
    switch (c.kind) {
      case KernelCall::Kind::gemm: out.push_back(gemm(c.m, c.n, c.k, Product::full)); break;
      case KernelCall::Kind::syrk: out.push_back(gemm(c.m, c.n, c.k, Product::syrk)); break;
      case KernelCall::Kind::symmetric_gemm: out.push_back(gemm(c.m, c.n, c.k, Product::sym_gemm)); break;
      case KernelCall::Kind::pass: out.push_back(pass(c.bytes / sizeof(float) / c.count)); break;
    }
  }
  return out;
}

NsOptions engine_options(NsAlgo algo, bool symmetric) {
  NsOptions o;
  o.algo = algo;
  o.symmetric = symmetric;
  o.steps = kSteps;
  return o;
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
  if (batch <= 0 || rows <= 0 || cols <= 0) return {};
  if (engine == NsEngine::plain) {
    // The public reference: one matrix per call, full GEMMs.
    return times(sequence_cost(engine_kernels(rows, cols, engine_options(NsAlgo::standard, false)), 1, hw), batch);
  }
  const NsCost standard = sequence_cost(engine_kernels(rows, cols, engine_options(NsAlgo::standard, true)), batch, hw);
  const NsCost gram = sequence_cost(engine_kernels(rows, cols, engine_options(NsAlgo::gram, true)), batch, hw);
  return gram.total_s < standard.total_s ? gram : standard;
}

double ns_time_s(int64_t rows, int64_t cols, int batch, NsEngine engine, const HardwareProfile& hw) {
  return ns_cost(rows, cols, batch, engine, hw).total_s;
}

}  // namespace dmuon::sim
