// The recording backend replays the real Newton–Schulz engine: the flops it records equal the closed forms of
// DESIGN 2.1 (standard: 4m²n + 2m³ per step with full products) and 2.2/2.3 (Gram with restart [2]: 8m²n + 28m³
// for 5 steps with full products; SYRK and upper-triangle tiles for the symmetric ones), for wide and tall
// inputs, and a batch records its matrices' calls.
#include <gtest/gtest.h>

#include <algorithm>

#include "dmuon/backend_record.hpp"
#include "dmuon/ns.hpp"

namespace dmuon {
namespace {

double syrk_flops(double m, double k) { return m * (m + 1) * k; }  // upper triangle with the diagonal
// The upper block triangle of an m×m product with inner size m in `tiles` block rows (DESIGN 2.3).
double tiled_flops(int64_t m, int tiles) {
  const int64_t t = std::min<int64_t>(tiles, m);
  double f = 0;
  for (int64_t i = 0; i < t; ++i) {
    const int64_t lo = m * i / t, hi = m * (i + 1) / t;
    f += 2.0 * double(hi - lo) * double(m - lo) * double(m);
  }
  return f;
}

NsOptions options(NsAlgo algo, bool symmetric, int tiles = 8) {
  NsOptions o;
  o.algo = algo;
  o.symmetric = symmetric;
  o.tiles = tiles;
  o.restarts = {2};
  return o;
}

struct Shape {
  int64_t rows, cols;
};
const Shape kShapes[] = {{96, 96}, {64, 256}, {256, 64}, {50, 410}, {33, 33}};

TEST(RecordedFlops, StandardEqualsDesign21) {
  for (const Shape s : kShapes) {
    const double m = double(std::min(s.rows, s.cols)), n = double(std::max(s.rows, s.cols));
    const auto full = ns_kernel_calls(s.rows, s.cols, 1, options(NsAlgo::standard, false));
    EXPECT_DOUBLE_EQ(total_flops(full), 5 * (4 * m * m * n + 2 * m * m * m)) << s.rows << "x" << s.cols;
    EXPECT_DOUBLE_EQ(total_flops(full), standard_ns_flops(s.rows, s.cols, 5));
    // With SYRK for X·Xᵀ and A·A: the same products, the symmetric ones at (m+1)/2m of their cost.
    const auto sym = ns_kernel_calls(s.rows, s.cols, 1, options(NsAlgo::standard, true));
    EXPECT_DOUBLE_EQ(total_flops(sym), 5 * (syrk_flops(m, n) + syrk_flops(m, m) + 2 * m * m * n));
    EXPECT_DOUBLE_EQ(total_flops(sym, true), total_flops(full));
  }
}

TEST(RecordedFlops, GramEqualsDesign22) {
  for (const Shape s : kShapes) {
    const int64_t mi = std::min(s.rows, s.cols);
    const double m = double(mi), n = double(std::max(s.rows, s.cols));
    const auto full = ns_kernel_calls(s.rows, s.cols, 1, options(NsAlgo::gram, false));
    EXPECT_DOUBLE_EQ(total_flops(full), 8 * m * m * n + 28 * m * m * m) << s.rows << "x" << s.cols;
    for (const int tiles : {1, 3, 8}) {
      // R = XXᵀ twice (start, restart) as SYRK, Q·X twice (restart, end), Z = bR + cR² five times as SYRK,
      // Q·Z three times and the two products of the R update three times as tiled products.
      const auto sym = ns_kernel_calls(s.rows, s.cols, 1, options(NsAlgo::gram, true, tiles));
      EXPECT_DOUBLE_EQ(total_flops(sym),
                       2 * syrk_flops(m, n) + 4 * m * m * n + 5 * syrk_flops(m, m) + 9 * tiled_flops(mi, tiles))
          << s.rows << "x" << s.cols << " tiles " << tiles;
      EXPECT_DOUBLE_EQ(total_flops(sym, true), total_flops(full));
    }
  }
}

// DESIGN 2.3's table in units of m³ (5 steps, symmetric products at half cost) is the large-m, many-tile limit.
TEST(RecordedFlops, ApproachTheDesignCostTable) {
  const int64_t m = 512;
  const double m3 = double(m) * m * m;
  const struct {
    int alpha;
    double standard_full, standard_sym, gram_sym;
  } table[] = {{1, 30, 20, 20}, {2, 50, 35, 26}, {4, 90, 65, 38}, {8, 170, 125, 62}};
  for (const auto& row : table) {
    const int64_t n = row.alpha * m;
    EXPECT_NEAR(total_flops(ns_kernel_calls(m, n, 1, options(NsAlgo::standard, false))) / m3, row.standard_full, 1e-9);
    EXPECT_NEAR(total_flops(ns_kernel_calls(m, n, 1, options(NsAlgo::standard, true))) / m3, row.standard_sym,
                0.01 * row.standard_sym);
    EXPECT_NEAR(total_flops(ns_kernel_calls(m, n, 1, options(NsAlgo::gram, true, 64))) / m3, row.gram_sym,
                0.02 * row.gram_sym);
  }
}

TEST(RecordedCalls, BatchesRunEveryMatrixAndBatchedBackendsMergeThem) {
  const NsOptions o = options(NsAlgo::gram, true, 4);
  const auto one = ns_kernel_calls(40, 120, 1, o);
  const auto each = ns_kernel_calls(40, 120, 6, o);     // one matrix per call, as on the CPU
  const auto merged = ns_kernel_calls(40, 120, 6, o, 6);  // one call per product for the batch, as on a GPU
  EXPECT_DOUBLE_EQ(total_flops(each), 6 * total_flops(one));
  EXPECT_DOUBLE_EQ(total_flops(merged), 6 * total_flops(one));
  size_t products_one = 0, products_merged = 0;
  for (const auto& c : one) products_one += c.kind != KernelCall::Kind::pass;
  for (const auto& c : merged) {
    if (c.kind == KernelCall::Kind::pass) continue;
    ++products_merged;
    EXPECT_EQ(c.count, 6);
  }
  EXPECT_EQ(products_merged, products_one);
}

}  // namespace
}  // namespace dmuon
