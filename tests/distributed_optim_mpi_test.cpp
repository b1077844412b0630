// DMuon and MuonGatherCompute against single-process Muon, at every world size the suite runs
// (1..4): a model of mixed shapes (wide, tall, square, tiny matrices, a matrix moved to AdamW, 1-D
// and 2-D elementwise parameters), 20 steps of seeded random gradients, clipping by the global norm,
// standard and Gram NS; plus the non-finite policies and checkpoints across world sizes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>

#include "dmuon/atomic_file.hpp"
#include "dmuon/checkpoint.hpp"
#include "dmuon/distributed_optim.hpp"
#include "dmuon/plan.hpp"  // default_owners
#include "test_data.hpp"
#include "hook_pass.hpp"
#include "test_world.hpp"
#include "toy_model.hpp"

namespace dmuon {
namespace {

using shard::Layout;
using shard::Mode;

using test::world;

// Units: 0 embeddings; 1 a layer with every kind of shape; 2 a head (a matrix moved to AdamW by a
// rule) and one more wide matrix (batched with unit 1's). Two 8×8 matrices share a batch too.
std::vector<ParamSpec> specs() {
  return {{"embed", {11, 6}, ParamRole::elementwise, 0},   {"l.wide", {6, 14}, ParamRole::matrix, 1},
          {"l.tall", {14, 6}, ParamRole::matrix, 1},       {"l.q", {8, 8}, ParamRole::matrix, 1},
          {"l.k", {8, 8}, ParamRole::matrix, 1},           {"l.tiny", {2, 3}, ParamRole::matrix, 1},
          {"l.norm", {7}, ParamRole::elementwise, 1},      {"l.bias", {5}, ParamRole::elementwise, 1},
          {"head", {5, 8}, ParamRole::matrix, 2},          {"out.wide", {6, 14}, ParamRole::matrix, 2}};
}

OptimizerOptions options(NsAlgo algo) {
  OptimizerOptions o;
  o.muon.weight_decay = 0.01;
  o.muon.ns.algo = algo;
  o.adamw.weight_decay = 0.1;
  o.rules = {{"head", OptimGroup::adamw}};
  o.clip_grad_norm = 4.0;  // below the gradients' norm (504 N(0,1) values: about 22), so every step clips
  return o;
}

// Seeded random gradient of parameter p at step t, the same on every rank.
std::vector<float> gradient(int p, int t, int64_t n) {
  std::mt19937 rng(1000 * t + p);
  std::normal_distribution<float> d;
  std::vector<float> g(n);
  for (float& x : g) x = d(rng);
  return g;
}

// dst ← src in place (optimizers hold the buffers' addresses).
void assign(std::vector<float>& dst, const std::vector<float>& src) { std::copy(src.begin(), src.end(), dst.begin()); }

// The distributed run's model over `comm` (default: the world): the registry, loaded with the toy
// model's initial values.
std::unique_ptr<shard::ShardedParams> sharded(Layout layout, Mode mode, std::shared_ptr<comm::Comm> comm = world()) {
  shard::ParamRegistry reg;
  for (const ParamSpec& s : specs()) reg.add(s);
  std::vector<int> owners;  // the even layout places none
  if (layout == Layout::owner_aligned) owners = default_owners(reg.specs(), comm->size());
  auto sp = std::make_unique<shard::ShardedParams>(std::move(comm), reg,
                                                   shard::ShardOptions{layout, mode, comm::ReduceOp::sum, true},
                                                   owners);
  test::ToyModel init(specs(), 7);
  for (int p = 0; p < sp->registry().size(); ++p) sp->load_full(p, init.values[p]);
  return sp;
}

// Forward and backward through the hooks; rank 0 alone contributes gradient t (a sum over ranks
// of it and zeros is exact, so every variant sees the same reduced gradient). `poison` puts a NaN
// into parameter `poison` on the last rank.
void backward(shard::ShardedParams& sp, int t, int poison = -1, const comm::Comm& comm = *world()) {
  const int rank = comm.rank();
  test::hook_pass(sp, [&](int p, std::span<float> g) {
    const std::vector<float> v = gradient(p, t, g.size());
    for (size_t i = 0; i < g.size(); ++i) g[i] = rank == 0 ? v[i] : 0.0f;
    if (p == poison && rank == comm.size() - 1) g[0] = std::numeric_limits<float>::quiet_NaN();
  });
}

// Every parameter's full value, gathered.
std::vector<std::vector<float>> full_values(shard::ShardedParams& sp) {
  std::vector<std::vector<float>> out(sp.registry().size());
  for (int u = 0; u < sp.num_units(); ++u) {
    sp.gather(u);
    sp.wait(u);
    for (int p : sp.layout(u).params) out[p].assign(sp.param(p).begin(), sp.param(p).end());
    sp.release(u);
  }
  return out;
}

// dst's gradients ← step t's.
void set_gradients(test::ToyModel& m, int t) {
  for (size_t p = 0; p < m.grads.size(); ++p) assign(m.grads[p], gradient(p, t, m.grads[p].size()));
}

// Single-process Muon for `steps` steps from the same start.
test::ToyModel reference(NsAlgo algo, int steps, int poison_step = -1, int poison = -1) {
  test::ToyModel m(specs(), 7);
  OptimizerOptions o = options(algo);
  o.nonfinite = NonFinitePolicy::skip;
  Muon muon(m.refs(), o);
  for (int t = 0; t < steps; ++t) {
    set_gradients(m, t);
    if (t == poison_step) m.grads[poison][0] = std::numeric_limits<float>::quiet_NaN();
    muon.step();
  }
  return m;
}

// ‖x − ref‖ / ‖ref‖ ≤ 1e-5 per tensor: float32 rounding of 20 steps (a few ulps per step) through
// NS, which may amplify an ulp-level change of the clipping factor (a norm summed in another
// order) by up to a^5 ≈ 490 along small singular values.
void expect_equal_model(const std::vector<std::vector<float>>& x, const test::ToyModel& ref, const std::string& what) {
  for (size_t p = 0; p < x.size(); ++p) {
    double d = 0, n = 0;
    for (size_t i = 0; i < x[p].size(); ++i) {
      d += std::pow(double(x[p][i]) - ref.values[p][i], 2);
      n += std::pow(double(ref.values[p][i]), 2);
    }
    EXPECT_LE(std::sqrt(d / n), 1e-5) << what << ": parameter " << ref.specs[p].name << " on rank " << world()->rank();
  }
}

struct Case {
  const char* name;
  Layout layout;
  Mode mode;
  bool gather_compute;
};
const Case kCases[] = {{"DMuon z3", Layout::owner_aligned, Mode::z3, false},
                       {"DMuon z2", Layout::owner_aligned, Mode::z2, false},
                       {"DMuon replicated", Layout::owner_aligned, Mode::replicated, false},
                       {"MuonGatherCompute z3", Layout::even, Mode::z3, true},
                       {"MuonGatherCompute replicated", Layout::even, Mode::replicated, true}};

std::unique_ptr<Optimizer> make_optimizer(const Case& c, shard::ShardedParams& sp, OptimizerOptions o) {
  if (c.gather_compute) return std::make_unique<MuonGatherCompute>(world(), sp, o);
  return std::make_unique<DMuon>(world(), sp, o);
}

TEST(DistributedMuon, EqualsSingleProcessMuon) {
  constexpr int kSteps = 20;
  for (NsAlgo algo : {NsAlgo::standard, NsAlgo::gram}) {
    const test::ToyModel ref = reference(algo, kSteps);
    for (const Case& c : kCases) {
      auto sp = sharded(c.layout, c.mode);
      auto opt = make_optimizer(c, *sp, options(algo));
      for (int t = 0; t < kSteps; ++t) {
        backward(*sp, t);
        ASSERT_TRUE(opt->step());
      }
      expect_equal_model(full_values(*sp), ref, std::string(c.name) + (algo == NsAlgo::gram ? ", gram" : ", standard"));
    }
  }
}

TEST(DistributedMuon, NonFiniteGradientSkipsOnEveryRank) {
  const int poison = 3;  // l.q: owned by one rank, whose NaN every rank must hear about
  const test::ToyModel ref = reference(NsAlgo::standard, 6, 2, poison);
  for (const Case& c : kCases) {
    auto sp = sharded(c.layout, c.mode);
    OptimizerOptions o = options(NsAlgo::standard);
    o.nonfinite = NonFinitePolicy::skip;
    auto opt = make_optimizer(c, *sp, o);
    for (int t = 0; t < 6; ++t) {
      backward(*sp, t, t == 2 ? poison : -1);
      EXPECT_EQ(opt->step(), t != 2) << c.name << " step " << t;
    }
    EXPECT_EQ(opt->skipped_steps(), 1) << c.name;
    EXPECT_EQ(opt->updates(), 5) << c.name;
    expect_equal_model(full_values(*sp), ref, c.name);
  }
}

TEST(DistributedMuon, NonFiniteGradientFailsOnEveryRank) {
  for (const Case& c : kCases) {
    auto sp = sharded(c.layout, c.mode);
    auto opt = make_optimizer(c, *sp, options(NsAlgo::standard));
    backward(*sp, 0, 3);
    try {
      opt->step();
      ADD_FAILURE() << c.name << ": a NaN gradient must raise on every rank";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_TRUE(what.find("non-finite gradient in parameter 'l.q' on rank") != std::string::npos ||
                  what.find("non-finite gradient on another rank") != std::string::npos)
          << what;
    }
  }
}

// A folder every rank sees: rank 0 makes it and broadcasts its path.
std::string shared_folder(test::TempDir& mine) {
  std::vector<uint8_t> path(4096, 0);
  if (world()->rank() == 0) std::copy(mine.path().begin(), mine.path().end(), path.begin());
  world()->broadcast<uint8_t>(path, 0).wait();
  return std::string(reinterpret_cast<const char*>(path.data()));
}

TEST(DistributedMuon, CheckpointResumesBitIdenticallyAndAtOneRank) {
  test::TempDir tmp;
  const std::string dir = shared_folder(tmp);
  for (const Case& c : kCases) {
    auto straight_sp = sharded(c.layout, c.mode);
    auto straight = make_optimizer(c, *straight_sp, options(NsAlgo::standard));
    auto first_sp = sharded(c.layout, c.mode);
    auto first = make_optimizer(c, *first_sp, options(NsAlgo::standard));
    for (int t = 0; t < 8; ++t) {
      backward(*straight_sp, t);
      straight->step();
      if (t < 4) {
        backward(*first_sp, t);
        first->step();
      }
    }
    save_checkpoint(dir, *first);
    // Resume at this world size, in fresh buffers: bit-identical to the uninterrupted run.
    auto resumed_sp = sharded(c.layout, c.mode);
    auto resumed = make_optimizer(c, *resumed_sp, options(NsAlgo::standard));
    load_checkpoint(dir, *resumed);
    for (int t = 4; t < 8; ++t) {
      backward(*resumed_sp, t);
      resumed->step();
    }
    EXPECT_EQ(full_values(*resumed_sp), full_values(*straight_sp)) << c.name;
    EXPECT_EQ(resumed->updates(), 8);
    // Resume in one process (world size 1, whole tensors) on every rank: the reference continued.
    test::ToyModel alone(specs(), 99);
    Muon single(alone.refs(), options(NsAlgo::standard));
    load_checkpoint(dir, single);
    for (int t = 4; t < 8; ++t) {
      set_gradients(alone, t);
      single.step();
    }
    expect_equal_model(full_values(*straight_sp), alone, std::string(c.name) + " resumed at 1 rank");
    std::vector<double> barrier = {0};
    world()->all_reduce<double>(barrier, comm::ReduceOp::sum).wait();  // all have read it before the next save
  }
}

// A corrupt file that only the last rank reads: every rank refuses the checkpoint (the last naming
// the file), and no rank's parameters change.
TEST(DistributedMuon, CorruptCheckpointIsRefusedOnEveryRank) {
  test::TempDir tmp;
  const std::string dir = shared_folder(tmp);
  const int last = world()->size() - 1;
  auto sp = sharded(Layout::owner_aligned, Mode::z3);
  DMuon saved(world(), *sp, options(NsAlgo::standard));
  backward(*sp, 0);
  saved.step();
  save_checkpoint(dir, saved);
  if (world()->rank() == last) {
    char name[32];
    std::snprintf(name, sizeof name, "/rank-%05d.safetensors", last);
    std::string bytes = read_file(dir + name);
    bytes[bytes.size() - 1] ^= 0x01;
    write_file_atomically(dir + name, bytes);
  }
  std::vector<double> barrier = {0};
  world()->all_reduce<double>(barrier, comm::ReduceOp::sum).wait();  // corrupted before anyone loads
  auto fresh_sp = sharded(Layout::owner_aligned, Mode::z3);
  DMuon fresh(world(), *fresh_sp, options(NsAlgo::standard));
  const auto before = full_values(*fresh_sp);
  try {
    load_checkpoint(dir, fresh);
    ADD_FAILURE() << "a corrupt checkpoint loaded on rank " << world()->rank();
  } catch (const Error& e) {
    const std::string what = e.what();
    if (world()->rank() == last) {
      EXPECT_NE(what.find("checksum mismatch"), std::string::npos) << what;
    } else {
      EXPECT_NE(what.find("failed on another rank"), std::string::npos) << what;
    }
  }
  EXPECT_EQ(full_values(*fresh_sp), before);
  EXPECT_EQ(fresh.updates(), 0);
  world()->all_reduce<double>(barrier, comm::ReduceOp::sum).wait();
}

// Save at the world size D with the gather-compute baseline (even layout), resume at ⌈D/2⌉ ranks
// with DMuon (owner-aligned), save again, resume in one process: the uninterrupted single-process
// run, within the tolerance of expect_equal_model. At 4 ranks this is 4 → 2 → 1 (at 3, the groups
// are ranks {0, 1} and {2}).
TEST(DistributedMuon, CheckpointReshardsToHalfThenOneRank) {
  test::TempDir tmp;
  const std::string dir = shared_folder(tmp);
  const int half_size = (world()->size() + 1) / 2;
  comm::Options split = comm::Options::from_env();
  split.ranks_per_node = half_size;  // node() is then the group of ranks [k·half, (k+1)·half)
  static std::shared_ptr<comm::Comm> grouped = comm::world(split);
  std::shared_ptr<comm::Comm> half(grouped, &grouped->node());
  const int group = world()->rank() / half_size;
  const OptimizerOptions o = options(NsAlgo::standard);

  auto full_sp = sharded(Layout::even, Mode::z3);
  MuonGatherCompute full(world(), *full_sp, o);
  for (int t = 0; t < 4; ++t) {
    backward(*full_sp, t);
    full.step();
  }
  save_checkpoint(dir + "/full", full);

  auto half_sp = sharded(Layout::owner_aligned, Mode::z2, half);
  DMuon resumed(half, *half_sp, o);
  EXPECT_EQ(resumed.world_size(), std::min(half_size, world()->size() - group * half_size));
  load_checkpoint(dir + "/full", resumed);
  for (int t = 4; t < 8; ++t) {
    backward(*half_sp, t, -1, *half);
    resumed.step();
  }
  save_checkpoint(dir + "/half" + std::to_string(group), resumed);

  test::ToyModel alone(specs(), 99);
  Muon single(alone.refs(), o);
  load_checkpoint(dir + "/half" + std::to_string(group), single);
  for (int t = 8; t < 12; ++t) {
    set_gradients(alone, t);
    single.step();
  }
  EXPECT_EQ(single.updates(), 12);
  const test::ToyModel ref = reference(NsAlgo::standard, 12);
  expect_equal_model(alone.values, ref, "saved at " + std::to_string(world()->size()) + ", resumed at " +
                                      std::to_string(half_size) + " then 1");
  std::vector<double> barrier = {0};
  world()->all_reduce<double>(barrier, comm::ReduceOp::sum).wait();  // all done before the folder goes
}

}  // namespace
}  // namespace dmuon
