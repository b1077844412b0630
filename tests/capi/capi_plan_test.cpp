// The C ABI's owner planner (dmuon_plan_owners_blocks, include/dmuon/dmuon_c.h) called through libdmuon_c as a
// foreign caller calls it, against the C++ planner it wraps (plan.hpp make_plan over make_plan_items' ns_blocks)
// given the same blocks: the same owners; costing split matrices whole (dmuon_plan_owners) gives a plan whose
// block-costed makespan is longer; every wrong argument is refused naming the matrix.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "dmuon/dmuon_c.h"
#include "dmuon/optim.hpp"
#include "dmuon/plan.hpp"

namespace dmuon {
namespace {

// Qwen2.5-0.5B's attention, `layers` layers of q (896×896, 14 heads of 64 rows), k and v (128×896, 2 heads of 64
// rows) and o (896×896, 14 heads of 64 columns), or with `fused` of qkv (1152×896 in blocks of 896, 128 and 128 rows)
// and o, in ParamSpec form as the C ABI builds them (one unit a matrix), and each matrix's blocks by muon_blocks (the
// C++ block rule).
struct Attention {
  std::vector<ParamSpec> params;
  std::vector<std::vector<MatrixBlock>> blocks;
};

Attention attention(int layers, bool fused = false) {
  Attention out;
  const auto add = [&](int64_t rows, int64_t cols, MuonMatrixOptions split) {
    const int i = static_cast<int>(out.params.size());
    out.params.push_back({"matrix" + std::to_string(i), {rows, cols}, ParamRole::matrix, i});
    out.blocks.push_back(muon_blocks(rows, cols, split, out.params.back().name));
  };
  const auto heads = [](int64_t count, int dim) {
    MuonMatrixOptions split;
    split.split_heads = count;
    split.split_dim = dim;
    return split;
  };
  for (int l = 0; l < layers; ++l) {
    if (fused) {
      MuonMatrixOptions qkv;
      qkv.split_sizes = {896, 128, 128};
      add(1152, 896, qkv);
    } else {
      add(896, 896, heads(14, 0));
      add(128, 896, heads(2, 0));
      add(128, 896, heads(2, 0));
    }
    add(896, 896, heads(14, 1));
  }
  return out;
}

// The C ABI's arguments for `a` with flop costs: shapes, and per matrix its block count and block shapes.
struct Call {
  std::vector<int64_t> rows, cols, counts, block_rows, block_cols;
};

Call call_of(const Attention& a) {
  Call c;
  for (size_t i = 0; i < a.params.size(); ++i) {
    c.rows.push_back(a.params[i].rows());
    c.cols.push_back(a.params[i].cols());
    c.counts.push_back(static_cast<int64_t>(a.blocks[i].size()));
    for (const MatrixBlock& b : a.blocks[i]) {
      c.block_rows.push_back(b.rows);
      c.block_cols.push_back(b.cols);
    }
  }
  return c;
}

std::vector<int> abi_owners(const Call& c, int ranks, const char* balancer, bool blocks) {
  std::vector<int32_t> owners(c.rows.size(), -1);
  const int64_t n = static_cast<int64_t>(c.rows.size());
  const int code = blocks ? dmuon_plan_owners_blocks(n, c.rows.data(), c.cols.data(), c.counts.data(),
                                                     c.block_rows.data(), c.block_cols.data(), ranks, balancer,
                                                     "flop", nullptr, 1, 2.0, owners.data(), nullptr)
                          : dmuon_plan_owners(n, c.rows.data(), c.cols.data(), ranks, balancer, "flop", nullptr, 1,
                                              2.0, owners.data(), nullptr);
  EXPECT_EQ(code, DMUON_OK) << dmuon_last_error();
  return {owners.begin(), owners.end()};
}

// The block-costed plan of these owners (each rank's predicted time with the matrices costed as their blocks).
Plan block_costed(const Attention& a, int ranks, const std::vector<int>& owners) {
  return plan_from_owners(a.params, make_plan_items(a.params, ranks, relative_flop_batch_time(), a.blocks), ranks,
                          owners, PlanOptions{});
}

TEST(CapiPlan, BlockOwnersAreThePlannersGivenTheSameBlocks) {
  for (const auto& [layers, fused] : {std::pair{3, false}, std::pair{24, false}, std::pair{5, true}}) {
    const Attention a = attention(layers, fused);
    for (const int ranks : {3, 4, 5}) {
      for (const Balancer balancer : {Balancer::rr, Balancer::lpt}) {
        PlanOptions options;
        options.balancer = balancer;
        const std::vector<int> want =
            make_plan(a.params, make_plan_items(a.params, ranks, relative_flop_batch_time(), a.blocks), ranks,
                      options).owner;
        EXPECT_EQ(abi_owners(call_of(a), ranks, to_string(balancer).c_str(), true), want)
            << layers << (fused ? " fused" : "") << " layers, " << ranks << " ranks, " << to_string(balancer);
      }
    }
  }
}

TEST(CapiPlan, CostingSplitMatricesWholeBalancesTheirBlocksWorse) {
  // 24 layers on 5 ranks: costed whole, q and o (896³ flops each) dwarf k and v (128²·896), so LPT spreads q and o
  // alone; costed as their 64-row blocks, q and o are 7 times k and v. The whole-costed plan's block-costed
  // makespan is longer than the block-costed plan's (figures in the planning docs).
  const Attention a = attention(24);
  const Call c = call_of(a);
  const std::vector<int> whole = abi_owners(c, 5, "lpt", false);
  const std::vector<int> blocks = abi_owners(c, 5, "lpt", true);
  EXPECT_NE(whole, blocks);
  const Plan whole_plan = block_costed(a, 5, whole), blocks_plan = block_costed(a, 5, blocks);
  EXPECT_GT(whole_plan.makespan_s, 1.1 * blocks_plan.makespan_s);
  // No block counts (all 0) is dmuon_plan_owners: every matrix whole.
  Call unsplit = c;
  unsplit.counts.assign(c.counts.size(), 0);
  EXPECT_EQ(abi_owners(unsplit, 5, "lpt", true), whole);
}

// dmuon_plan_owners_blocks' return code and message for a call of `c` on 2 ranks.
std::pair<int, std::string> refused(const Call& c, bool counts = true, bool shapes = true) {
  std::vector<int32_t> owners(c.rows.size());
  const int code = dmuon_plan_owners_blocks(static_cast<int64_t>(c.rows.size()), c.rows.data(), c.cols.data(),
                                            counts ? c.counts.data() : nullptr, shapes ? c.block_rows.data() : nullptr,
                                            shapes ? c.block_cols.data() : nullptr, 2, "lpt", "flop", nullptr, 1, 2.0,
                                            owners.data(), nullptr);
  return {code, code == DMUON_OK ? "" : dmuon_last_error()};
}

TEST(CapiPlan, WrongBlocksAreRefusedNamingTheMatrix) {
  const Call good = call_of(attention(1));  // q (14 blocks), k, v (2 each), o (14)
  EXPECT_EQ(refused(good).first, DMUON_OK);
  using Refusal = std::pair<int, std::string>;
  const auto invalid = [](const std::string& message) { return Refusal{DMUON_ERR_INVALID, message}; };
  EXPECT_EQ(refused(good, false), invalid("dmuon_plan_owners_blocks: block_counts must be given"));
  EXPECT_EQ(refused(good, true, false),
            invalid("dmuon_plan_owners_blocks: block_rows and block_cols must be given (matrix 0 has 14 blocks)"));
  Call c = good;
  c.counts[1] = -1;
  EXPECT_EQ(refused(c), invalid("dmuon_plan_owners_blocks: matrix 1 has -1 blocks"));
  c = good;
  c.block_cols[15] = 0;  // k's second block
  EXPECT_EQ(refused(c), invalid("dmuon_plan_owners_blocks: matrix 1's block 1 has shape 64x0"));
  c = good;
  c.counts[2] = 1;  // v: one 64×896 block of its 128×896 (and o's blocks shift by one)
  EXPECT_EQ(refused(c), invalid("dmuon_plan_owners_blocks: matrix 2 (128x896, 114688 elements) has blocks of 57344 "
                                "elements"));
  c = good;
  c.rows[3] = 0;
  EXPECT_EQ(refused(c), invalid("dmuon_plan_owners_blocks: matrix 3 has shape 0x896"));
}

}  // namespace
}  // namespace dmuon
