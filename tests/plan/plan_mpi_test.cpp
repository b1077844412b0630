// Identical plans on every rank: rr and lpt computed independently on each rank; milp through
// plan_across_ranks (rank 0 solves, broadcasts the owners, the others expand them).
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>
#include <unistd.h>
#include <vector>

#include "dmuon/comm.hpp"
#include "dmuon/models.hpp"
#include "dmuon/plan.hpp"
#include "dmuon/plan_across_ranks.hpp"
#include "dmuon/tune.hpp"
#include "test_data.hpp"

namespace dmuon {
namespace {

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// True on every rank when `values` is bit-identical on all ranks.
bool same_on_all_ranks(const std::vector<int>& values) {
  std::vector<int> root = values;
  int n = static_cast<int>(root.size());
  MPI_Bcast(&n, 1, MPI_INT, 0, MPI_COMM_WORLD);
  root.resize(n);
  MPI_Bcast(root.data(), n, MPI_INT, 0, MPI_COMM_WORLD);
  int same = root == values ? 1 : 0, all = 0;
  MPI_Allreduce(&same, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

bool same_on_all_ranks(double value) {
  int bits[2];
  std::memcpy(bits, &value, sizeof value);
  return same_on_all_ranks(std::vector<int>(bits, bits + 2));
}

struct Model {
  std::vector<ParamSpec> params;
  std::vector<PlanItem> items;
};

Model small_model(int ranks) {
  Model m;
  m.params = load_model_manifest(test::data_path("../../models/qwen2.5-0.5b.json"), 3);
  m.items = make_plan_items(m.params, ranks, relative_flop_batch_time());
  return m;
}

// The owners rr and lpt should give, worked out here apart from src/plan: items in descending order of
// size (rr) or time (lpt), equal keys by parameter index; rr deals them out in turn, lpt puts each on
// the least-loaded rank (the lowest of equals) whose bytes stay within `cap` (any rank when none can).
std::vector<int> expected_owners(const Model& m, int ranks, Balancer b, int64_t cap) {
  const auto key = [&](const PlanItem& it) { return b == Balancer::rr ? double(it.rows * it.cols) : it.time_s; };
  std::vector<PlanItem> order = m.items;
  std::sort(order.begin(), order.end(), [&](const PlanItem& x, const PlanItem& y) {
    return key(x) != key(y) ? key(x) > key(y) : x.param < y.param;
  });
  std::vector<int> owner(m.params.size(), -1);
  std::vector<double> load(ranks, 0);
  std::vector<int64_t> bytes(ranks, 0);
  for (size_t k = 0; k < order.size(); ++k) {
    int r = static_cast<int>(k % ranks);
    if (b == Balancer::lpt) {
      r = -1;
      for (int q = 0; q < ranks; ++q)
        if (bytes[q] + order[k].bytes <= cap && (r < 0 || load[q] < load[r])) r = q;
      if (r < 0) r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    }
    owner[order[k].param] = r;
    load[r] += order[k].time_s;
    bytes[r] += order[k].bytes;
  }
  return owner;
}

// rr and lpt need no communication: every rank computes the owners itself, and each rank's are the
// owners worked out above, so all ranks agree (at more ranks than exist too: a pure function of inputs).
TEST(PlanMpi, DeterministicBalancersAgreeWithoutCommunication) {
  const int ranks = world_size() + 2;
  auto m = small_model(ranks);
  for (Balancer b : {Balancer::rr, Balancer::lpt}) {
    PlanOptions o;
    o.balancer = b;
    const Plan plan = make_plan(m.params, m.items, ranks, o);
    EXPECT_EQ(plan.owner, expected_owners(m, ranks, b, memory_cap_bytes(m.items, ranks, o.memory_slack)))
        << to_string(b) << " on rank " << world_rank();
    EXPECT_TRUE(same_on_all_ranks(plan.owner)) << to_string(b);
    EXPECT_TRUE(same_on_all_ranks(plan.makespan_s)) << to_string(b);
  }
}

TEST(PlanMpi, MilpSolvedOnRankZeroAndBroadcastIsIdentical) {
  const int ranks = world_size();
  auto m = small_model(ranks);
  PlanOptions o;
  o.balancer = Balancer::milp;
  o.time_limit_s = 0.5;
  const Plan plan = plan_across_ranks(*comm::world(), m.params, m.items, o);
  EXPECT_TRUE(same_on_all_ranks(plan.owner));
  EXPECT_TRUE(same_on_all_ranks(plan.makespan_s));
  // Every Muon matrix has exactly one owner, and this rank's batches are exactly what it owns.
  int mine = 0;
  for (const auto& it : m.items) mine += plan.owner[it.param] == world_rank() ? 1 : 0;
  int in_batches = 0;
  for (const auto& b : plan.per_rank[world_rank()].batches) in_batches += static_cast<int>(b.params.size());
  EXPECT_EQ(mine, in_batches);
  int total = 0;
  MPI_Allreduce(&mine, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_EQ(total, static_cast<int>(m.items.size()));
}

// make_plan fails on rank 0 only (the MILP time limit is checked there; the other ranks never
// solve): every rank throws at once with rank 0's reason instead of waiting for owners.
TEST(PlanMpi, FailureOnRankZeroReachesEveryRank) {
  auto m = small_model(world_size());
  PlanOptions o;
  o.balancer = Balancer::milp;
  o.time_limit_s = -1;
  std::string message;
  try {
    plan_across_ranks(*comm::world(), m.params, m.items, o);
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("MILP time limit must be positive, got -1 s"), std::string::npos) << message;
  if (world_rank() != 0) {
    EXPECT_NE(message.find("rank 0 could not make the owner plan"), std::string::npos) << message;
  }
}

// Rank 0 tunes (real timings of two tiny shapes, one round) and writes the cache; every rank returns
// the same entries, the cache file holds them, and a second call is served from the file.
TEST(TuneMpi, RankZeroTunesAndEveryRankGetsTheSameEntries) {
  std::string dir;
  if (world_rank() == 0)  // rank 0's name for a folder every rank sees (save creates it)
    dir = (std::filesystem::temp_directory_path() / ("dmuon-tune-mpi-" + std::to_string(getpid()))).string();
  std::vector<int> name(dir.begin(), dir.end());
  int n = static_cast<int>(name.size());
  MPI_Bcast(&n, 1, MPI_INT, 0, MPI_COMM_WORLD);
  name.resize(n);
  MPI_Bcast(name.data(), n, MPI_INT, 0, MPI_COMM_WORLD);
  dir.assign(name.begin(), name.end());
  TuneSessionOptions o;
  o.cache_path = dir + "/tune.json";
  o.rounds = 1;
  const std::vector<TuneRequest> requests = {{8, 16, 2}, {16, 8, 1}};
  const auto entries = tune_across_ranks(*comm::world(), requests, o);
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_TRUE(same_on_all_ranks(entries[0].seconds));
  EXPECT_TRUE(same_on_all_ranks(entries[1].seconds));
  EXPECT_TRUE(same_on_all_ranks(std::vector<int>{static_cast<int>(entries[0].options.algo), entries[0].options.tiles,
                                                 entries[0].options.symmetric ? 1 : 0}));
  EXPECT_EQ(entries[1].rows, 16);
  if (world_rank() == 0) {
    std::string warning;
    const TuneCache saved = TuneCache::load(o.cache_path, current_tune_key(o.threads), &warning);
    EXPECT_EQ(warning, "");
    ASSERT_NE(saved.find(8, 16, 2), nullptr);
    EXPECT_EQ(saved.find(8, 16, 2)->seconds, entries[0].seconds);
  }
  const auto again = tune_across_ranks(*comm::world(), requests, o);  // from the file: the same times
  EXPECT_EQ(again[0].seconds, entries[0].seconds);
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

// The cache path names a file that is not a tuning cache: rank 0 refuses to replace it, before tuning,
// and every rank throws with its reason.
TEST(TuneMpi, FailureOnRankZeroReachesEveryRank) {
  TuneSessionOptions o;
  o.cache_path = std::string(DMUON_TEST_DATA_DIR) + "/README.md";
  o.rounds = 1;
  std::string message;
  try {
    tune_across_ranks(*comm::world(), {{8, 8, 1}}, o);
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("README.md is not a dmuon tuning cache; refusing to replace it"), std::string::npos)
      << message;
  if (world_rank() != 0) {
    EXPECT_NE(message.find("rank 0 could not tune Newton-Schulz (cache " + o.cache_path + ")"), std::string::npos)
        << message;
  }
}

// A cache that cannot be written (its folder would be under a file) is a warning on rank 0: every rank
// still gets the tuned entries.
TEST(TuneMpi, UnwritableCacheWarnsAndTunesInMemory) {
  TuneSessionOptions o;
  o.cache_path = "/dev/null/dmuon/tune.json";
  o.rounds = 1;
  std::vector<std::string> warnings;
  o.warn = [&](const std::string& w) { warnings.push_back(w); };
  const auto entries = tune_across_ranks(*comm::world(), {{8, 8, 1}}, o);
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_TRUE(same_on_all_ranks(entries[0].seconds));
  if (world_rank() == 0) {
    ASSERT_EQ(warnings.size(), 1u);
    EXPECT_NE(warnings[0].find("/dev/null/dmuon/tune.json cannot be written"), std::string::npos) << warnings[0];
    EXPECT_NE(warnings[0].find("serve this run only"), std::string::npos) << warnings[0];
  } else {
    EXPECT_TRUE(warnings.empty());
  }
}

}  // namespace
}  // namespace dmuon
