// Sharded parameters across ranks: registration checks, gathered views, gradient reduction to
// owners in both layouts and all modes, Z2 = Z3, two-stage = single-stage, shard updates reaching
// every rank through the next gather; destruction with operations in flight. Run under mpirun at
// 1..4 ranks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <memory>

#include "dmuon/plan.hpp"  // default_owners
#include "dmuon/shard.hpp"

namespace dmuon::shard {
namespace {


ParamSpec matrix(std::string name, int64_t r, int64_t c, int unit) {
  return {std::move(name), {r, c}, ParamRole::matrix, unit};
}
ParamSpec vec(std::string name, int64_t n, int unit) { return {std::move(name), {n}, ParamRole::elementwise, unit}; }

// Odd sizes; unit 2 is a single matrix, so at 2+ ranks some ranks own nothing in it, and at 4
// ranks there are more ranks than matrices in unit 1.
ParamRegistry model() {
  ParamRegistry reg;
  for (auto s : {vec("embed", 13, 0), matrix("l.q", 5, 3, 1), vec("l.norm", 7, 1), matrix("l.up", 9, 5, 1),
                 matrix("l.down", 5, 9, 1), vec("l.bias", 3, 1), matrix("head", 4, 4, 2)})
    reg.add(s);
  return reg;
}

float initial(int p, int64_t i) { return static_cast<float>(100 * p + i); }
// Rank r's gradient: integer valued, so sums are exact in any order.
float int_grad(int rank, int p, int64_t i) { return static_cast<float>((rank + 1) * (p + i % 7)); }
// Non-integer gradient, for comparisons between modes that must agree bit for bit anyway.
float real_grad(int rank, int p, int64_t i) { return std::sin(0.1f * (rank + 1) + 0.37f * p + 0.011f * i); }

std::unique_ptr<ShardedParams> make(std::shared_ptr<comm::Comm> c, Layout layout, Mode mode,
                                    ReduceOp op = ReduceOp::sum, bool two_stage = true) {
  const ParamRegistry reg = model();
  std::vector<int> owners;  // the even layout places none
  if (layout == Layout::owner_aligned) owners = default_owners(reg.specs(), c->size());
  auto sp = std::make_unique<ShardedParams>(std::move(c), reg, ShardOptions{layout, mode, op, two_stage}, owners);
  for (int p = 0; p < sp->registry().size(); ++p) {
    std::vector<float> v(sp->registry().specs()[p].numel());
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = initial(p, i);
    sp->load_full(p, v);
  }
  return sp;
}

// One forward and backward through the hooks; checks the views; returns nothing, leaves shard_grads.
template <typename Grad>
void step(ShardedParams& sp, int rank, Grad grad, int64_t* wrong_views) {
  const auto& specs = sp.registry().specs();
  auto check_views = [&](int u) {
    for (int p : sp.layout(u).params) {
      auto v = sp.param(p).host();
      for (int64_t i = 0; i < specs[p].numel(); ++i) *wrong_views += v[i] != initial(p, i);
    }
  };
  for (int u = 0; u < sp.num_units(); ++u) {
    sp.before_forward(u);
    check_views(u);
    sp.after_forward(u);
  }
  for (int u = sp.num_units() - 1; u >= 0; --u) {
    sp.before_backward(u);
    check_views(u);
    for (int p : sp.layout(u).params) {
      auto g = sp.grad(p).host();
      for (int64_t i = 0; i < specs[p].numel(); ++i) g[i] = grad(rank, p, i);
    }
    sp.after_backward(u);
  }
  sp.finish_backward();
}

struct Case {
  Layout layout;
  Mode mode;
};
const Case kCases[] = {{Layout::even, Mode::z3},
                       {Layout::even, Mode::z2},
                       {Layout::owner_aligned, Mode::z3},
                       {Layout::owner_aligned, Mode::z2},
                       {Layout::owner_aligned, Mode::replicated}};

// With both v-collective algorithms of the communicator (native MPI and per-owner).
TEST(Shard, ViewsEqualRegisteredValuesAndShardGradsAreTheExactSumOrMean) {
  for (auto algo : {comm::VAlgorithm::native, comm::VAlgorithm::per_owner}) {
    comm::Options options = comm::Options::from_env();
    options.v_algorithm = algo;
    auto c = comm::world(options);
    const int n = c->size(), me = c->rank();
    for (const Case& k : kCases) {
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::average}) {
        auto sp = make(c, k.layout, k.mode, op);
        int64_t wrong_views = 0, wrong_grads = 0, checked = 0;
        step(*sp, me, int_grad, &wrong_views);
        for (int u = 0; u < sp->num_units(); ++u) {
          auto g = sp->shard_grads(u).host();
          for (const LocalPiece& pc : sp->local_pieces(u)) {
            for (int64_t j = 0; j < pc.length; ++j) {
              const int64_t i = pc.offset_in_param + j;
              float sum = 0;
              for (int r = 0; r < n; ++r) sum += int_grad(r, pc.param, i);
              const float expect = op == ReduceOp::sum ? sum : sum / static_cast<float>(n);
              wrong_grads += g[pc.offset_in_shard + j] != expect;
              ++checked;
            }
          }
        }
        const std::string what = std::string(k.layout == Layout::even ? "even" : "owner_aligned") + " mode " +
                                 std::to_string(static_cast<int>(k.mode)) + " " + std::string(to_string(op));
        EXPECT_EQ(wrong_views, 0) << what;
        EXPECT_EQ(wrong_grads, 0) << what;
        // Every element's reduced gradient is checked on exactly one rank.
        int64_t all_checked = checked;
        c->all_reduce<int64_t>(std::span<int64_t>(&all_checked, 1), ReduceOp::sum).wait();
        EXPECT_EQ(all_checked, 13 + 15 + 7 + 45 + 45 + 3 + 16) << what;
      }
    }
  }
}

TEST(Shard, OwnerAlignedShardHoldsWholeMatricesOfItsOwner) {
  auto c = comm::world();
  auto sp = make(c, Layout::owner_aligned, Mode::z3);
  const auto& specs = sp->registry().specs();
  for (int u = 0; u < sp->num_units(); ++u) {
    int64_t mine = 0;
    for (const LocalPiece& pc : sp->local_pieces(u)) {
      if (specs[pc.param].role != ParamRole::matrix) continue;
      EXPECT_EQ(sp->owners()[pc.param], c->rank());
      EXPECT_EQ(pc.length, specs[pc.param].numel());
      ++mine;
    }
    int64_t owned = 0;
    for (int p : sp->layout(u).params) owned += specs[p].role == ParamRole::matrix && sp->owners()[p] == c->rank();
    EXPECT_EQ(mine, owned);
  }
}

// Z2 and Z3 (and the even/owner-aligned layouts, element by element) give identical gradients.
TEST(Shard, Z2AndZ3AreBitIdentical) {
  auto c = comm::world();
  for (Layout layout : {Layout::even, Layout::owner_aligned}) {
    std::vector<std::vector<float>> grads[2];
    for (int z = 0; z < 2; ++z) {
      auto sp = make(c, layout, z == 0 ? Mode::z3 : Mode::z2, ReduceOp::average);
      int64_t wrong_views = 0;
      step(*sp, c->rank(), real_grad, &wrong_views);
      EXPECT_EQ(wrong_views, 0);
      for (int u = 0; u < sp->num_units(); ++u) {
        auto g = sp->shard_grads(u).host();
        grads[z].emplace_back(g.begin(), g.end());
      }
    }
    EXPECT_EQ(grads[0], grads[1]);
  }
}

// DMUON_RANKS_PER_NODE=2 at 4 ranks makes two nodes: reduce_grads runs in two stages (in
// replicated mode: two-stage reduce-scatter + all-gather). Integer gradients: equal to the
// single-stage result bit for bit, in every layout and mode.
TEST(Shard, TwoStageReduceEqualsSingleStage) {
  setenv("DMUON_RANKS_PER_NODE", "2", 1);
  auto two_nodes = comm::world();
  unsetenv("DMUON_RANKS_PER_NODE");
  EXPECT_EQ(two_nodes->topology().two_level(), two_nodes->size() == 4);
  for (const Case& k : kCases) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::average}) {
      std::vector<std::vector<float>> grads[2];
      for (int staged = 0; staged < 2; ++staged) {
        auto sp = make(two_nodes, k.layout, k.mode, op, staged == 1);
        int64_t wrong_views = 0;
        step(*sp, two_nodes->rank(), int_grad, &wrong_views);
        for (int u = 0; u < sp->num_units(); ++u) {
          auto g = sp->shard_grads(u).host();
          grads[staged].emplace_back(g.begin(), g.end());
        }
      }
      EXPECT_EQ(grads[0], grads[1]);
    }
  }
}

// The optimizer's round trip: each rank changes its shard; the next gather shows every change.
TEST(Shard, ShardUpdatesReachEveryRankThroughTheNextGather) {
  auto c = comm::world();
  for (const Case& k : kCases) {
    auto sp = make(c, k.layout, k.mode);
    for (int u = 0; u < sp->num_units(); ++u) {
      auto shard = sp->shard_params(u).host();
      for (const LocalPiece& pc : sp->local_pieces(u))
        for (int64_t j = 0; j < pc.length; ++j) shard[pc.offset_in_shard + j] += 0.5f + pc.param;
    }
    int64_t wrong = 0;
    for (int u = 0; u < sp->num_units(); ++u) {
      sp->before_forward(u);
      for (int p : sp->layout(u).params) {
        auto v = sp->param(p).host();
        for (int64_t i = 0; i < static_cast<int64_t>(v.size()); ++i) wrong += v[i] != initial(p, i) + 0.5f + p;
      }
      sp->after_forward(u);
    }
    EXPECT_EQ(wrong, 0) << "layout " << static_cast<int>(k.layout) << " mode " << static_cast<int>(k.mode);
  }
}

// The world communicator, with every gather and reduce of ShardedParams slowed down: its Work
// reports completion only after kPolls tests, so an operation is reliably still in flight when
// the code under test moves on, at every world size (one rank included). Counts the operations
// whose handle died before they completed.
class SlowComm : public comm::Comm {
 public:
  static inline int in_flight = 0;  // started, neither completed nor destroyed
  static inline int abandoned = 0;  // destroyed before completing

  explicit SlowComm(std::shared_ptr<comm::Comm> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const comm::Options& options() const override { return inner_->options(); }
  comm::Comm& node() override { return inner_->node(); }
  comm::Comm& cross() override { return inner_->cross(); }
  const comm::Topology& topology() const override { return inner_->topology(); }
  comm::Work all_gather_raw(const void* send, int64_t count, void* recv, DType t) override {
    return slow(inner_->all_gather_raw(send, count, recv, t));
  }
  comm::Work all_gatherv_raw(const void* send, void* recv, std::span<const int64_t> counts, DType t) override {
    return slow(inner_->all_gatherv_raw(send, recv, counts, t));
  }
  comm::Work reduce_scatterv_raw(const void* send, void* recv, std::span<const int64_t> counts, DType t,
                                 ReduceOp op) override {
    return slow(inner_->reduce_scatterv_raw(send, recv, counts, t, op));
  }
  comm::Work broadcast_raw(void* buf, int64_t count, DType t, int root) override {
    return slow(inner_->broadcast_raw(buf, count, t, root));
  }
  comm::Work all_reduce_raw(const void* send, void* recv, int64_t count, DType t, ReduceOp op) override {
    return slow(inner_->all_reduce_raw(send, recv, count, t, op));
  }

 private:
  class SlowWork : public comm::WorkState {
   public:
    explicit SlowWork(comm::Work inner) : inner_(std::move(inner)) { ++in_flight; }
    ~SlowWork() override {
      if (complete_) return;
      --in_flight;
      ++abandoned;
    }
    bool test() override {
      if (complete_) return true;
      complete_ = ++polls_ > kPolls && inner_.test();
      if (complete_) --in_flight;
      return complete_;
    }
    std::string describe() const override { return "slowed " + inner_.describe(); }

   private:
    static constexpr int kPolls = 50;
    comm::Work inner_;
    int polls_ = 0;
    bool complete_ = false;
  };
  comm::Work slow(comm::Work inner) {
    return comm::Work(std::make_shared<SlowWork>(std::move(inner)), inner_->options().timeout_s);
  }
  std::shared_ptr<comm::Comm> inner_;
};

// An error thrown between the hooks, with a prefetched gather (after before_forward(0)) or a
// gradient reduce (after after_backward(last)) in flight: destroying the ShardedParams completes
// it before freeing the buffers it writes into, instead of abandoning it under MPI.
TEST(Shard, DestructionCompletesOperationsStillInFlight) {
  auto slow = std::make_shared<SlowComm>(comm::world());
  for (bool in_backward : {false, true}) {
    SlowComm::abandoned = 0;
    int in_flight_at_error = 0;
    try {
      auto sp = make(slow, Layout::owner_aligned, Mode::z3);
      const int last = sp->num_units() - 1;
      if (in_backward) {
        for (int u = 0; u <= last; ++u) {
          sp->before_forward(u);
          sp->after_forward(u);
        }
        sp->before_backward(last);
        sp->after_backward(last);  // starts the last unit's reduce
      } else {
        sp->before_forward(0);  // starts unit 1's gather
      }
      in_flight_at_error = SlowComm::in_flight;
      throw Error("model failed");
    } catch (const Error& e) {
      EXPECT_STREQ(e.what(), "model failed");
    }
    EXPECT_GE(in_flight_at_error, 1) << "nothing was in flight: the test proves nothing";
    EXPECT_EQ(SlowComm::abandoned, 0) << (in_backward ? "reduce" : "gather") << " abandoned in flight";
    EXPECT_EQ(SlowComm::in_flight, 0);
  }
}

TEST(Shard, MisuseIsReportedNamingTheParameter) {
  auto c = comm::world();
  auto sp = make(c, Layout::owner_aligned, Mode::z3);
  try {
    sp->param(3);
    FAIL() << "ungathered view accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'l.up' of unit 1 is not gathered"), std::string::npos) << e.what();
  }
  EXPECT_THROW(sp->grad(0), Error);
  EXPECT_THROW(sp->shard_grads(0), Error);
  std::vector<float> wrong_size(3);
  EXPECT_THROW(sp->load_full(1, wrong_size), Error);
  ParamRegistry reg;
  reg.add(vec("a", 3, 0));
  EXPECT_THROW(reg.add(vec("a", 4, 0)), Error);
  EXPECT_THROW(reg.add(vec("b", 0, 0)), Error);
}

// The last rank registers a different shape for parameter #1: every rank throws, naming it.
TEST(Shard, RegistrationMismatchIsReportedOnEveryRank) {
  auto c = comm::world();
  if (c->size() < 2) GTEST_SKIP() << "needs two ranks";
  const int last = c->size() - 1;
  for (int variant = 0; variant < 2; ++variant) {
    ParamRegistry reg;
    reg.add(vec("a", 3, 0));
    if (variant == 0) {
      reg.add(c->rank() == last ? matrix("w", 8, 4, 0) : matrix("w", 4, 8, 0));
    } else if (c->rank() != last) {
      reg.add(matrix("w", 4, 8, 0));  // the last rank misses it
    }
    std::string message;
    try {
      ShardedParams sp(c, reg, ShardOptions{}, default_owners(reg.specs(), c->size()));
    } catch (const Error& e) {
      message = e.what();
    }
    EXPECT_NE(message.find("parameter registration differs across ranks at parameter #1"), std::string::npos)
        << message;
    if (variant == 0) {
      EXPECT_NE(message.find("registered 'w' shape [4x8] matrix unit 0"), std::string::npos) << message;
      EXPECT_NE(message.find("rank " + std::to_string(last) + " registered 'w' shape [8x4]"), std::string::npos)
          << message;
    } else {
      EXPECT_NE(message.find("rank " + std::to_string(last) + " registered nothing (1 parameters registered)"),
                std::string::npos)
          << message;
    }
  }
}

}  // namespace
}  // namespace dmuon::shard
