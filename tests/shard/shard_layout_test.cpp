// Pure layout arithmetic (no MPI): coverage, alignment, explicit small cases.
#include "dmuon/shard_layout.hpp"

#include <gtest/gtest.h>

#include "dmuon/error.hpp"
#include "dmuon/plan.hpp"  // default_owners

namespace dmuon::shard {
namespace {

ParamSpec matrix(std::string name, int64_t r, int64_t c, int unit) {
  return {std::move(name), {r, c}, ParamRole::matrix, unit};
}
ParamSpec vec(std::string name, int64_t n, int unit) { return {std::move(name), {n}, ParamRole::elementwise, unit}; }

// unit 0: embedding; unit 1: a layer with norms and matrices of odd sizes; unit 2: one matrix.
std::vector<ParamSpec> model() {
  return {vec("embed", 11, 0),       matrix("l.q", 5, 3, 1), vec("l.norm", 7, 1),    matrix("l.up", 9, 5, 1),
          matrix("l.down", 5, 9, 1), vec("l.bias", 3, 1),    matrix("head", 4, 4, 2)};
}

// Every element of every unit parameter appears in exactly one rank's pieces, at a shard offset
// consistent with the packed segments; shards tile the packed buffer.
void expect_exact_cover(const std::vector<ParamSpec>& specs, const UnitLayout& l) {
  std::vector<std::vector<int>> seen(specs.size());
  for (int p : l.params) seen[p].assign(specs[p].numel(), 0);
  ASSERT_EQ(l.shard_offset.size(), static_cast<std::size_t>(l.world_size + 1));
  ASSERT_EQ(l.shard_offset[0], 0);
  for (int r = 0; r < l.world_size; ++r) {
    ASSERT_LE(l.shard_offset[r], l.shard_offset[r + 1]);
    int64_t expect_at = 0;
    for (const LocalPiece& pc : l.local_pieces(r)) {
      EXPECT_EQ(pc.offset_in_shard, expect_at) << "pieces are in shard order without gaps";
      expect_at += pc.length;
      for (int64_t i = 0; i < pc.length; ++i) ++seen[pc.param][pc.offset_in_param + i];
    }
    EXPECT_EQ(expect_at, l.shard_size(r));
  }
  for (int p : l.params)
    for (int c : seen[p]) EXPECT_EQ(c, 1) << specs[p].name;
  int64_t at = 0;
  for (const Segment& s : l.segments) {
    EXPECT_EQ(s.offset_in_packed, at);
    at += s.length;
  }
  EXPECT_EQ(at, l.total());
}

TEST(ShardLayout, EvenSplit) {
  EXPECT_EQ(even_split(10, 3), (std::vector<int64_t>{4, 3, 3}));
  EXPECT_EQ(even_split(2, 4), (std::vector<int64_t>{1, 1, 0, 0}));
  EXPECT_EQ(even_split(0, 2), (std::vector<int64_t>{0, 0}));
  EXPECT_THROW(even_split(5, 0), Error);
}

TEST(ShardLayout, EvenLayoutCoversEveryElementOnce) {
  auto specs = model();
  for (int d = 1; d <= 7; ++d)
    for (int u = 0; u < 3; ++u) expect_exact_cover(specs, even_layout(specs, u, d));
}

TEST(ShardLayout, EvenLayoutExplicitPieces) {
  // unit 1 = q(15) norm(7) up(45) down(45) bias(3) = 115 elements; 3 ranks: 39, 38, 38.
  auto l = even_layout(model(), 1, 3);
  EXPECT_EQ(l.shard_sizes(), (std::vector<int64_t>{39, 38, 38}));
  EXPECT_EQ(l.local_pieces(0), (std::vector<LocalPiece>{{1, 0, 15, 0}, {2, 0, 7, 15}, {3, 0, 17, 22}}));
  EXPECT_EQ(l.local_pieces(1), (std::vector<LocalPiece>{{3, 17, 28, 0}, {4, 0, 10, 28}}));
  EXPECT_EQ(l.local_pieces(2), (std::vector<LocalPiece>{{4, 10, 35, 0}, {5, 0, 3, 35}}));
}

TEST(ShardLayout, OwnerAlignedKeepsMatricesWholeInTheOwnersShard) {
  auto specs = model();
  for (int d = 1; d <= 7; ++d) {
    auto owners = default_owners(specs, d);
    for (int u = 0; u < 3; ++u) {
      auto l = owner_aligned_layout(specs, owners, u, d);
      expect_exact_cover(specs, l);
      int64_t pool = 0;
      for (int p : l.params)
        if (specs[p].role == ParamRole::elementwise) pool += specs[p].numel();
      const auto pool_split = even_split(pool, d);
      for (int r = 0; r < d; ++r) {
        int64_t elementwise_here = 0;
        for (const LocalPiece& pc : l.local_pieces(r)) {
          if (specs[pc.param].role == ParamRole::matrix) {
            EXPECT_EQ(owners[pc.param], r) << specs[pc.param].name;
            EXPECT_EQ(pc.offset_in_param, 0);
            EXPECT_EQ(pc.length, specs[pc.param].numel());
          } else {
            elementwise_here += pc.length;
          }
        }
        EXPECT_EQ(elementwise_here, pool_split[r]) << "elementwise parameters split evenly";
      }
    }
  }
}

TEST(ShardLayout, OwnerAlignedExplicitPieces) {
  auto specs = model();
  // q → 1, up → 0, down → 1; pool = norm(7) + bias(3) = 10 → chunks 5, 5.
  std::vector<int> owners = {-1, 1, -1, 0, 1, -1, 0};
  auto l = owner_aligned_layout(specs, owners, 1, 2);
  EXPECT_EQ(l.local_pieces(0), (std::vector<LocalPiece>{{3, 0, 45, 0}, {2, 0, 5, 45}}));
  EXPECT_EQ(l.local_pieces(1), (std::vector<LocalPiece>{{1, 0, 15, 0}, {4, 0, 45, 15}, {2, 5, 2, 60}, {5, 0, 3, 62}}));
  EXPECT_EQ(l.shard_sizes(), (std::vector<int64_t>{50, 65}));
  auto norm = l.segments_of(2);
  ASSERT_EQ(norm.size(), 2u);
  EXPECT_EQ(norm[0].offset_in_packed, 45);
  EXPECT_EQ(norm[1].offset_in_packed, 50 + 60);
}

TEST(ShardLayout, OwnerAlignedRejectsABadOwnerNamingTheParameter) {
  auto specs = model();
  std::vector<int> owners = {-1, 0, -1, 5, 0, -1, 0};
  try {
    owner_aligned_layout(specs, owners, 1, 2);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("l.up"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dmuon::shard
