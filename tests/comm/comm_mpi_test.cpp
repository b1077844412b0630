// Every collective against results known by formula, at odd sizes, with empty contributions, in
// every dtype the API offers; refusals of mismatched calls; node/cross groups; the two-stage
// reduce-scatter against the flat one. Run under mpirun at 1..4 ranks.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <thread>

#include "dmuon/comm.hpp"

namespace dmuon::comm {
namespace {

std::shared_ptr<Comm> make_world(VAlgorithm algo = VAlgorithm::per_owner, int ranks_per_node = 0,
                                 bool check_calls = false) {
  Options o = Options::from_env();
  o.v_algorithm = algo;
  o.ranks_per_node = ranks_per_node;
  o.check_calls = check_calls;
  return world(o);
}

// Odd, uneven per-rank counts with zeros: rank r contributes (3r + 1) mod 4 elements.
std::vector<int64_t> uneven_counts(int n) {
  std::vector<int64_t> c(n);
  for (int r = 0; r < n; ++r) c[r] = (3 * r + 1) % 4;
  return c;
}

template <typename T>
T value(int rank, int64_t i) {
  return static_cast<T>(1000 * rank + i);
}

template <typename T>
class CommTyped : public ::testing::Test {};
using Types = ::testing::Types<float, double, int64_t, uint8_t>;
TYPED_TEST_SUITE(CommTyped, Types);

TYPED_TEST(CommTyped, AllGatherConcatenatesRankBlocks) {
  using T = TypeParam;
  auto c = make_world();
  const int n = c->size(), me = c->rank();
  for (int64_t count : {0, 1, 7}) {
    std::vector<T> send(count), recv(count * n, T(-1));
    for (int64_t i = 0; i < count; ++i) send[i] = value<T>(me, i);
    c->all_gather<T>(send, recv).wait();
    int64_t wrong = 0;
    for (int r = 0; r < n; ++r)
      for (int64_t i = 0; i < count; ++i) wrong += recv[r * count + i] != value<T>(r, i);
    EXPECT_EQ(wrong, 0) << "count " << count;
  }
}

TYPED_TEST(CommTyped, AllGathervWithEmptyBlocksBothAlgorithms) {
  using T = TypeParam;
  for (auto algo : {VAlgorithm::per_owner, VAlgorithm::native}) {
    auto c = make_world(algo);
    const int n = c->size(), me = c->rank();
    auto counts = uneven_counts(n);
    int64_t total = 0;
    for (auto k : counts) total += k;
    std::vector<T> send(counts[me]), recv(total, T(-1));
    for (int64_t i = 0; i < counts[me]; ++i) send[i] = value<T>(me, i);
    c->template all_gatherv<T>(send, recv, counts).wait();
    int64_t wrong = 0, at = 0;
    for (int r = 0; r < n; ++r)
      for (int64_t i = 0; i < counts[r]; ++i) wrong += recv[at++] != value<T>(r, i);
    EXPECT_EQ(wrong, 0);
  }
}

TEST(Comm, AllGathervInPlace) {
  auto c = make_world();
  const int n = c->size(), me = c->rank();
  auto counts = uneven_counts(n);
  std::vector<int64_t> displ(n + 1, 0);
  for (int r = 0; r < n; ++r) displ[r + 1] = displ[r] + counts[r];
  for (auto algo : {VAlgorithm::per_owner, VAlgorithm::native}) {
    auto w = make_world(algo);
    std::vector<float> buf(displ[n], -1.f);
    for (int64_t i = 0; i < counts[me]; ++i) buf[displ[me] + i] = value<float>(me, i);
    w->all_gatherv<float>(std::span<const float>(buf.data() + displ[me], counts[me]), buf, counts).wait();
    for (int r = 0; r < n; ++r)
      for (int64_t i = 0; i < counts[r]; ++i) ASSERT_EQ(buf[displ[r] + i], value<float>(r, i));
  }
}

// Rank r sends x_i = r + i (integer valued): Σ_r = n(n−1)/2 + n·i exactly in every dtype.
TYPED_TEST(CommTyped, ReduceScattervSumAndAverageBothAlgorithms) {
  using T = TypeParam;
  for (auto algo : {VAlgorithm::per_owner, VAlgorithm::native}) {
    auto c = make_world(algo);
    const int n = c->size(), me = c->rank();
    auto counts = uneven_counts(n);
    std::vector<int64_t> displ(n + 1, 0);
    for (int r = 0; r < n; ++r) displ[r + 1] = displ[r] + counts[r];
    std::vector<T> send(displ[n]);
    for (int64_t i = 0; i < displ[n]; ++i) send[i] = static_cast<T>(me + i);
    std::vector<ReduceOp> ops = {ReduceOp::sum, ReduceOp::max};
    if (!std::is_integral_v<T>) ops.push_back(ReduceOp::average);
    for (ReduceOp op : ops) {
      std::vector<T> recv(counts[me], T(-1));
      c->template reduce_scatterv<T>(send, recv, counts, op).wait();
      int64_t wrong = 0;
      for (int64_t k = 0; k < counts[me]; ++k) {
        const int64_t i = displ[me] + k;
        const T sum = static_cast<T>(n * (n - 1) / 2 + n * i);
        const T expect = op == ReduceOp::sum ? sum : op == ReduceOp::max ? static_cast<T>(n - 1 + i) : sum / T(n);
        wrong += recv[k] != expect;
      }
      EXPECT_EQ(wrong, 0) << to_string(op);
    }
  }
}

TEST(Comm, ReduceScatterEqualBlocks) {
  auto c = make_world();
  const int n = c->size(), me = c->rank();
  const int64_t block = 5;
  std::vector<float> send(block * n), recv(block);
  for (int64_t i = 0; i < block * n; ++i) send[i] = static_cast<float>(me * i);
  c->reduce_scatter<float>(send, recv, ReduceOp::sum).wait();
  for (int64_t k = 0; k < block; ++k) EXPECT_EQ(recv[k], static_cast<float>((me * block + k) * n * (n - 1) / 2));
}

TYPED_TEST(CommTyped, BroadcastFromEveryRoot) {
  using T = TypeParam;
  auto c = make_world();
  for (int root = 0; root < c->size(); ++root) {
    std::vector<T> buf(9, T(-1));
    if (c->rank() == root)
      for (int64_t i = 0; i < 9; ++i) buf[i] = value<T>(root, i);
    c->broadcast<T>(buf, root).wait();
    for (int64_t i = 0; i < 9; ++i) ASSERT_EQ(buf[i], value<T>(root, i));
  }
}

TYPED_TEST(CommTyped, AllReduceSumMaxInPlace) {
  using T = TypeParam;
  auto c = make_world();
  const int n = c->size(), me = c->rank();
  for (int64_t count : {0, 1, 13}) {
    std::vector<T> send(count), sum(count), mx(count);
    for (int64_t i = 0; i < count; ++i) send[i] = static_cast<T>(me + i);
    c->all_reduce<T>(send, sum, ReduceOp::sum).wait();
    c->all_reduce<T>(send, mx, ReduceOp::max).wait();
    c->all_reduce<T>(std::span<T>(send), ReduceOp::min).wait();
    for (int64_t i = 0; i < count; ++i) {
      ASSERT_EQ(sum[i], static_cast<T>(n * (n - 1) / 2 + n * i));
      ASSERT_EQ(mx[i], static_cast<T>(n - 1 + i));
      ASSERT_EQ(send[i], static_cast<T>(i));
    }
  }
}

TEST(Comm, AllReduceAverageIsSumOverN) {
  auto c = make_world();
  const int n = c->size();
  std::vector<float> x(11);
  for (int64_t i = 0; i < 11; ++i) x[i] = static_cast<float>(c->rank() + i);
  c->all_reduce<float>(std::span<float>(x), ReduceOp::average).wait();
  for (int64_t i = 0; i < 11; ++i) EXPECT_EQ(x[i], static_cast<float>(n * (n - 1) / 2 + n * i) / float(n));
}

TEST(Comm, BadSizesAndOpsAreRefusedLocally) {
  auto c = make_world();
  const int n = c->size();
  std::vector<float> send(3), small(3 * n - 1);
  EXPECT_THROW(c->all_gather<float>(send, small), Error);
  std::vector<int64_t> counts(n, 3);
  counts[c->rank()] = 2;  // does not match my block
  std::vector<float> full(3 * n);
  EXPECT_THROW(c->all_gatherv<float>(send, full, counts), Error);
  EXPECT_THROW(c->broadcast<float>(send, n), Error);
  std::vector<int64_t> ints(2);
  try {
    c->all_reduce<int64_t>(std::span<int64_t>(ints), ReduceOp::average);
    FAIL() << "average of int64 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("average needs a floating dtype"), std::string::npos) << e.what();
  }
}

// With check_calls, rank 1 calling with float64 while the others use float32 throws on every
// rank, naming both calls.
TEST(Comm, MixedDtypesAreRefusedOnEveryRankWithCallChecks) {
  auto c = make_world(VAlgorithm::per_owner, 0, true);
  if (c->size() < 2) GTEST_SKIP() << "needs two ranks";
  std::string message;
  try {
    if (c->rank() == 1) {
      std::vector<double> s(4), r(4 * c->size());
      c->all_gather<double>(s, r).wait();
    } else {
      std::vector<float> s(4), r(4 * c->size());
      c->all_gather<float>(s, r).wait();
    }
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("collective calls differ across ranks"), std::string::npos) << message;
  EXPECT_NE(message.find("all_gather(float32"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 1 called all_gather(float64"), std::string::npos) << message;
  // Counts that disagree across ranks are caught too.
  message.clear();
  try {
    std::vector<int64_t> counts(c->size(), 2);
    if (c->rank() == 1) counts[0] = 3;  // rank 1 believes rank 0 sends 3
    int64_t total = 0;
    for (auto k : counts) total += k;
    std::vector<float> s(counts[c->rank()]), r(total);
    c->all_gatherv<float>(s, r, counts).wait();
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("per-rank counts hash"), std::string::npos) << message;
}

TEST(Comm, NodeAndCrossGroupsFromRanksPerNode) {
  setenv("DMUON_RANKS_PER_NODE", "2", 1);
  auto c = world();  // Options::from_env sees the variable
  unsetenv("DMUON_RANKS_PER_NODE");
  const int n = c->size(), me = c->rank();
  EXPECT_EQ(c->node().rank(), me % 2);
  EXPECT_EQ(c->node().size(), std::min(2, n - (me / 2) * 2));
  EXPECT_EQ(c->cross().rank(), me / 2);
  const Topology& t = c->topology();
  EXPECT_EQ(t.uniform, n % 2 == 0 || n == 1);
  EXPECT_EQ(t.two_level(), n == 4);
  for (int r = 0; t.uniform && r < n; ++r) EXPECT_EQ(t.rank_at[(r / 2) * t.ranks_per_node + r % 2], r);
  // A collective on each group: sums of world ranks within the node and across nodes.
  int64_t node_sum = me, cross_sum = me;
  c->node().all_reduce<int64_t>(std::span<int64_t>(&node_sum, 1), ReduceOp::sum).wait();
  c->cross().all_reduce<int64_t>(std::span<int64_t>(&cross_sum, 1), ReduceOp::sum).wait();
  int64_t expect_node = 0, expect_cross = 0;
  for (int r = 0; r < n; ++r) {
    if (r / 2 == me / 2) expect_node += r;
    if (r % 2 == me % 2) expect_cross += r;
  }
  EXPECT_EQ(node_sum, expect_node);
  EXPECT_EQ(cross_sum, expect_cross);
}

// Integer-valued floats: every summation order is exact, so two-stage equals flat bit for bit.
// Non-integer data: equal within the float32 bound n·eps·Σ|x|.
TEST(Comm, TwoStageReduceScattervEqualsFlat) {
  auto c = make_world(VAlgorithm::per_owner, 2);
  if (!c->topology().two_level()) GTEST_SKIP() << "needs a two-level topology (np 4 with 2 ranks per node)";
  const int n = c->size(), me = c->rank();
  auto counts = uneven_counts(n);
  counts[n - 1] += 6;
  std::vector<int64_t> displ(n + 1, 0);
  for (int r = 0; r < n; ++r) displ[r + 1] = displ[r] + counts[r];
  for (bool integer : {true, false}) {
    std::vector<float> send(displ[n]);
    for (int64_t i = 0; i < displ[n]; ++i)
      send[i] = integer ? static_cast<float>((me + 1) * (i + 3) % 17) : std::sin(0.37f * (me + 1) * (i + 1)) / 3.f;
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::average}) {
      std::vector<float> flat(counts[me]), staged(counts[me]);
      c->reduce_scatterv<float>(send, flat, counts, op).wait();
      reduce_scatterv_two_stage(*c, send.data(), staged.data(), counts, DType::f32, op).wait();
      for (int64_t k = 0; k < counts[me]; ++k) {
        if (integer) {
          ASSERT_EQ(staged[k], flat[k]) << "element " << k << " op " << to_string(op);
        } else {
          const double bound = n * 1.2e-7 * n / 3.0;  // n ranks, |x| ≤ 1/3
          ASSERT_NEAR(staged[k], flat[k], bound) << "element " << k;
        }
      }
    }
  }
}

// Two two-stage reduce-scatters in flight, waited in opposite orders on alternate nodes: their
// deferred second stages must still be posted in creation order on every rank (else the cross-node
// collectives would pair A on one rank with B on another).
TEST(Comm, DeferredStagesPostInCreationOrderWhateverTheWaitOrder) {
  auto c = make_world(VAlgorithm::native, 2, true);
  if (!c->topology().two_level()) GTEST_SKIP() << "needs a two-level topology (np 4 with 2 ranks per node)";
  const int n = c->size(), me = c->rank();
  std::vector<int64_t> counts_a(n, 3), counts_b(n, 5);
  std::vector<float> send_a(3 * n), send_b(5 * n), out_a(3), out_b(5);
  for (int64_t i = 0; i < 3 * n; ++i) send_a[i] = static_cast<float>(me + i);
  for (int64_t i = 0; i < 5 * n; ++i) send_b[i] = static_cast<float>(2 * me + i);
  Work a = reduce_scatterv_two_stage(*c, send_a.data(), out_a.data(), counts_a, DType::f32, ReduceOp::sum);
  Work b = reduce_scatterv_two_stage(*c, send_b.data(), out_b.data(), counts_b, DType::f32, ReduceOp::sum);
  if (c->cross().rank() % 2 == 0) {  // opposite orders on the two ends of each cross-node pair
    b.wait();
    a.wait();
  } else {
    a.wait();
    b.wait();
  }
  for (int64_t k = 0; k < 3; ++k) EXPECT_EQ(out_a[k], static_cast<float>(n * (n - 1) / 2 + n * (3 * me + k)));
  for (int64_t k = 0; k < 5; ++k) EXPECT_EQ(out_b[k], static_cast<float>(n * (n - 1) + n * (5 * me + k)));
}

// A Work dropped while its collective is in flight: MPI cannot cancel a collective, so dropping the
// last handle waits for it, and recv holds every block once the handle is gone. Rank 0 posts
// 200 ms late, so on the other ranks the all-gather is surely in flight when they drop it.
TEST(Comm, DroppingAWorkInFlightWaitsForIt) {
  auto c = make_world();
  const int n = c->size(), me = c->rank();
  if (n == 1) GTEST_SKIP() << "needs a peer that posts late";
  std::vector<int64_t> send(3), recv(3 * n, -1);
  for (int64_t i = 0; i < 3; ++i) send[i] = value<int64_t>(me, i);
  if (me == 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  { Work dropped = c->all_gather<int64_t>(send, recv); }
  int64_t wrong = 0;
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < 3; ++i) wrong += recv[3 * r + i] != value<int64_t>(r, i);
  EXPECT_EQ(wrong, 0);
}

// Hidden child of comm_timeout_test: rank 1 never arrives at the all-reduce (it sleeps); the
// others must time out (DMUON_COMM_TIMEOUT_S), print the error and exit non-zero.
TEST(CommTimeoutChild, DISABLED_PeerNeverArrives) {
  auto c = world();
  if (c->rank() == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(120));
    std::_Exit(0);
  }
  float x = 1;
  try {
    c->all_reduce<float>(std::span<float>(&x, 1), ReduceOp::sum).wait();
  } catch (const Error& e) {
    std::fprintf(stderr, "rank %d: %s\n", c->rank(), e.what());
    std::fflush(stderr);
    std::_Exit(3);
  }
  std::_Exit(0);
}

}  // namespace
}  // namespace dmuon::comm
