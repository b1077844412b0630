// DMuon and MuonGatherCompute against single-process Muon, at every world size the suite runs
// (1..4): a model of mixed shapes (wide, tall, square, tiny matrices, a matrix moved to AdamW, 1-D
// and 2-D elementwise parameters), 20 steps of seeded random gradients that differ on every rank and
// average to the reference's, steps above and below the clipping bound, standard and Gram NS: the
// weights, the reported gradient norm and every optimizer state buffer. Plus where NS runs (each Muon
// matrix once, on its planned owner), DMuon's refusals, the non-finite policies and checkpoints across
// world sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
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
  o.clip_grad_norm = 4.0;  // see step_scale
  return o;
}

// options(standard) with per-matrix options: NorMuon on l.wide (β2 0.95) and on l.q and l.tall (β2 0.9, spectral
// scale, cautious weight decay, split Newton–Schulz by 2 heads of rows: 4×8 and 7×6 blocks); 6 Polar Express steps
// and 1.5× the scale on out.wide (l.wide's shape: another batch), split by columns into 4 + 10 (blocks of other
// scales, gathered on the owner), NorMuon (a v of its own per column block); l.k and l.tiny keep the defaults. The NorMuon matrices' rows and the split matrices'
// blocks straddle the even layout's shards.
OptimizerOptions recipe_options() {
  OptimizerOptions o = options(NsAlgo::standard);
  MuonMatrixOptions normuon = o.muon, clipped = o.muon, polar = o.muon;
  normuon.variant = MuonVariant::normuon;
  clipped.variant = MuonVariant::normuon, clipped.normuon_beta2 = 0.9, clipped.scale = MuonScale::spectral;
  clipped.cautious_wd = true, clipped.split_heads = 2;
  polar.ns.steps = 6, polar.ns.coeffs = NsCoeffs::polar_express, polar.extra_scale_factor = 1.5;
  polar.split_sizes = {4, 10}, polar.split_dim = 1, polar.variant = MuonVariant::normuon;
  o.muon_rules = {{"l.wide", normuon}, {"re:l\\.(q|tall)", clipped}, {"out.wide", polar}};
  return o;
}

// The mean gradient's scale at step t: 504 N(0,1) values have norm about 22, so steps at scale 1 clip
// and every third step (norm about 2.2) does not. A reduction that summed over D ranks instead of
// averaging would clip those too (norm 2.2·D), and would scale the optimizer state by D.
float step_scale(int t) { return t % 3 == 1 ? 0.1f : 1.0f; }

// Seeded N(0,1) values, n of them.
std::vector<double> normal_values(uint32_t seed, int64_t n) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> d;
  std::vector<double> g(n);
  for (double& x : g) x = d(rng);
  return g;
}

// The mean gradient of parameter p at step t: what the single-process reference is given.
std::vector<float> gradient(int p, int t, int64_t n) {
  std::vector<float> g(n);
  const std::vector<double> z = normal_values(1000 * t + p, n);
  for (int64_t i = 0; i < n; ++i) g[i] = static_cast<float>(step_scale(t) * z[i]);
  return g;
}

// Rank r's gradient of parameter p at step t among `ranks`: the mean gradient plus a rank's own
// deviation e_r − mean(e) of the same size, so every rank's differs and their mean is the mean gradient.
std::vector<float> rank_gradient(int p, int t, int64_t n, int r, int ranks) {
  std::vector<float> g = gradient(p, t, n);
  std::vector<double> mean(n, 0.0), mine;
  for (int q = 0; q < ranks; ++q) {
    const std::vector<double> e = normal_values(7919 * (t + 1) + 101 * p + 13 * q + 5, n);
    for (int64_t i = 0; i < n; ++i) mean[i] += e[i] / ranks;
    if (q == r) mine = e;
  }
  for (int64_t i = 0; i < n; ++i) g[i] += static_cast<float>(step_scale(t) * (mine[i] - mean[i]));
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
                                                   shard::ShardOptions{layout, mode, ReduceOp::average, true},
                                                   owners);
  test::ToyModel init(specs(), 7);
  for (int p = 0; p < sp->registry().size(); ++p) sp->load_full(p, init.values[p]);
  return sp;
}

// Forward and backward through the hooks; every rank contributes its own gradient (rank_gradient),
// which the hooks average over ranks. `poison` puts a NaN into element 0 of parameter `poison` on the
// last rank.
void backward(shard::ShardedParams& sp, int t, int poison = -1, const comm::Comm& comm = *world()) {
  const int rank = comm.rank();
  test::hook_pass(sp, [&](int p, DeviceSpan<float> view) {
    const std::span<float> g = view.host();
    const std::vector<float> v = rank_gradient(p, t, g.size(), rank, comm.size());
    std::copy(v.begin(), v.end(), g.begin());
    if (p == poison && rank == comm.size() - 1) g[0] = std::numeric_limits<float>::quiet_NaN();
  });
}

// Every parameter's full value, gathered.
std::vector<std::vector<float>> full_values(shard::ShardedParams& sp) {
  std::vector<std::vector<float>> out(sp.registry().size());
  for (int u = 0; u < sp.num_units(); ++u) {
    sp.gather(u);
    sp.wait(u);
    for (int p : sp.layout(u).params) out[p] = sp.param(p).to_host();
    sp.release(u);
  }
  return out;
}

// dst's gradients ← step t's.
void set_gradients(test::ToyModel& m, int t) {
  for (size_t p = 0; p < m.grads.size(); ++p) assign(m.grads[p], gradient(p, t, m.grads[p].size()));
}

// Every optimizer state buffer of a rank's pieces: (param, kind) -> (offset, values). The values
// themselves (kind "param") are compared through full_values.
using State = std::map<std::pair<std::string, std::string>, std::pair<int64_t, std::vector<float>>>;
State state_of(Optimizer& o) {
  State out;
  for (const StateSlice& s : o.state_slices())
    if (s.kind != "param") out[{s.param, s.kind}] = {s.offset, std::vector<float>(s.data, s.data + s.count)};
  return out;
}

// Single-process Muon for `steps` steps from the same start: its weights, state, and the gradient
// norm it reported at each update.
struct Reference {
  test::ToyModel model{specs(), 7};
  State state;
  std::vector<double> grad_norms;
};
Reference reference(NsAlgo algo, int steps, int poison_step = -1, int poison = -1,
                    const std::optional<OptimizerOptions>& given = std::nullopt) {
  Reference ref;
  test::ToyModel& m = ref.model;
  OptimizerOptions o = given ? *given : options(algo);
  o.nonfinite = NonFinitePolicy::skip;
  Muon muon(m.refs(), o);
  for (int t = 0; t < steps; ++t) {
    set_gradients(m, t);
    if (t == poison_step) m.grads[poison][0] = std::numeric_limits<float>::quiet_NaN();
    muon.step();
    ref.grad_norms.push_back(muon.last_grad_norm());
  }
  ref.state = state_of(muon);
  return ref;
}

// The brute-force norm of step t's mean gradient over every parameter, in double.
double mean_gradient_norm(int t) {
  double sq = 0;
  for (size_t p = 0; p < specs().size(); ++p)
    for (float g : gradient(p, t, specs()[p].numel())) sq += double(g) * g;
  return std::sqrt(sq);
}

// This rank's pieces of every state buffer against the same range of the reference's whole buffers,
// ‖x − ref‖ / ‖ref‖ ≤ 1e-5 per buffer (as expect_equal_model, for the same reasons).
void expect_equal_state(Optimizer& o, const State& ref, const std::string& what) {
  for (const auto& [key, piece] : state_of(o)) {
    ASSERT_TRUE(ref.count(key)) << what << ": the reference has no " << key.first << " " << key.second;
    const auto& [offset, values] = piece;
    const std::vector<float>& whole = ref.at(key).second;
    double d = 0, n = 0;
    for (size_t i = 0; i < values.size(); ++i) {
      d += std::pow(double(values[i]) - whole[offset + i], 2);
      n += std::pow(double(whole[offset + i]), 2);
    }
    EXPECT_LE(std::sqrt(d), 1e-5 * std::sqrt(n)) << what << ": " << key.first << " " << key.second << " ["
                                                 << offset << ", +" << values.size() << ") on rank " << o.rank();
  }
}

// ‖x − ref‖ / ‖ref‖ ≤ 1e-5 per tensor: float32 rounding of 20 steps (a few ulps per step) through
// NS, which may amplify an ulp-level change of the clipping factor (a norm summed in another
// order) by up to a^5 ≈ 490 along small singular values.
void expect_equal_model(const std::vector<std::vector<float>>& x, const test::ToyModel& ref, const std::string& what) {
  ASSERT_EQ(x.size(), ref.values.size()) << what;
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
    const Reference ref = reference(algo, kSteps);
    for (const Case& c : kCases) {
      const std::string what = std::string(c.name) + (algo == NsAlgo::gram ? ", gram" : ", standard");
      auto sp = sharded(c.layout, c.mode);
      auto opt = make_optimizer(c, *sp, options(algo));
      int unclipped = 0;
      for (int t = 0; t < kSteps; ++t) {
        backward(*sp, t);
        ASSERT_TRUE(opt->step());
        const double norm = mean_gradient_norm(t);
        unclipped += norm < options(algo).clip_grad_norm;
        EXPECT_NEAR(opt->last_grad_norm(), norm, 1e-5 * norm) << what << " step " << t;
        EXPECT_NEAR(opt->last_grad_norm(), ref.grad_norms[t], 1e-5 * norm) << what << " step " << t;
      }
      EXPECT_GE(unclipped, kSteps / 4) << "too few steps below the clipping bound";
      expect_equal_model(full_values(*sp), ref.model, what);
      expect_equal_state(*opt, ref.state, what);
    }
  }
}

// Per-matrix options and NorMuon (recipe_options) in every layout and mode: the owner normalizes each NorMuon
// matrix whole, gather-then-compute every rank that holds a piece; weights and every state buffer (normuon.v, whole
// where a piece is held) equal single-process Muon's with the same rules.
TEST(DistributedMuon, PerMatrixOptionsAndNorMuonEqualSingleProcessMuon) {
  constexpr int kSteps = 10;
  const Reference ref = reference(NsAlgo::standard, kSteps, -1, -1, recipe_options());
  ASSERT_TRUE(ref.state.count({"l.q", "normuon.v"}) && ref.state.count({"out.wide", "normuon.v"}) &&
              !ref.state.count({"l.k", "normuon.v"}));
  for (const Case& c : kCases) {
    auto sp = sharded(c.layout, c.mode);
    auto opt = make_optimizer(c, *sp, recipe_options());
    for (int t = 0; t < kSteps; ++t) {
      backward(*sp, t);
      ASSERT_TRUE(opt->step());
    }
    expect_equal_model(full_values(*sp), ref.model, std::string(c.name) + ", recipe");
    expect_equal_state(*opt, ref.state, std::string(c.name) + ", recipe");
  }
}

// NS runs once per Muon matrix: DMuon on its planned owner only (the owners ShardedParams holds), so
// each rank's last_stats count is its share of the plan and the counts add up to the Muon matrices;
// gather-then-compute on every rank.
TEST(DistributedMuon, EachMatrixIsOrthogonalizedOnceOnItsOwner) {
  const std::vector<ParamSpec> all = specs();
  for (const Case& c : kCases) {
    auto sp = sharded(c.layout, c.mode);
    std::vector<double> times(all.size(), 0);  // per parameter: how often this rank orthogonalized it
    const Orthogonalizer ns = ns_orthogonalizer(NsOptions{});
    const Orthogonalizer counting = [&](Backend& backend, std::span<const MatView> u, std::span<const MatView> o,
                                        std::span<const std::string> names, double* norms) {
      for (const std::string& name : names)
        for (size_t p = 0; p < all.size(); ++p) times[p] += all[p].name == name;
      ns(backend, u, o, names, norms);
    };
    std::unique_ptr<Optimizer> opt;
    if (c.gather_compute) opt = std::make_unique<MuonGatherCompute>(world(), *sp, options(NsAlgo::standard), counting);
    else opt = std::make_unique<DMuon>(world(), *sp, options(NsAlgo::standard), counting);
    backward(*sp, 0);
    ASSERT_TRUE(opt->step());
    const int me = world()->rank();
    int64_t muon = 0, mine = 0;
    for (size_t p = 0; p < all.size(); ++p) {
      if (opt->group_of(all[p].name) != OptimGroup::muon) {
        EXPECT_EQ(times[p], 0) << c.name << ": " << all[p].name << " is AdamW's, on rank " << me;
        continue;
      }
      ++muon;
      const bool here = c.gather_compute || sp->owners()[p] == me;
      mine += here;
      EXPECT_EQ(times[p], here ? 1 : 0) << c.name << ": " << all[p].name << " on rank " << me;
    }
    EXPECT_EQ(muon, 6);
    EXPECT_EQ(opt->last_stats().ns_matrices, mine) << c.name << " on rank " << me;
    std::vector<double> counted = {double(opt->last_stats().ns_matrices)};
    world()->all_reduce<double>(counted, ReduceOp::sum).wait();
    EXPECT_EQ(counted[0], c.gather_compute ? muon * world()->size() : muon) << c.name;
    world()->all_reduce<double>(times, ReduceOp::sum).wait();
    for (size_t p = 0; p < all.size(); ++p) {
      if (opt->group_of(all[p].name) == OptimGroup::muon && !c.gather_compute) {
        EXPECT_EQ(times[p], 1) << c.name << ": " << all[p].name << " orthogonalized " << times[p] << " times";
      }
    }
  }
}

// Ownership-dependent paths forced at every world size: 9 matrices of one shape over two units (more
// than ranks) and a bias per unit, owners dealt out round-robin, so every rank of up to 4 owns several
// matrices of one batch, within a unit and across units. In every mode DMuon equals single-process Muon
// (20 steps' tolerance of expect_equal_model covers these 5), and each rank orthogonalizes its share.
std::vector<ParamSpec> crowded_specs() {
  std::vector<ParamSpec> out;
  for (int i = 0; i < 9; ++i) {
    out.push_back({"m" + std::to_string(i), {5, 7}, ParamRole::matrix, i < 5 ? 0 : 1});
    if (i == 4 || i == 8) out.push_back({"bias" + std::to_string(i / 4), {3}, ParamRole::elementwise, i < 5 ? 0 : 1});
  }
  return out;
}

TEST(DistributedMuon, OwnersOfSeveralSameShapeMatricesEqualSingleProcessMuon) {
  constexpr int kSteps = 5;
  const std::vector<ParamSpec> all = crowded_specs();
  const int ranks = world()->size(), me = world()->rank();
  PlanOptions round_robin;
  round_robin.balancer = Balancer::rr;
  const std::vector<int> owners =
      make_plan(all, make_plan_items(all, ranks, relative_flop_batch_time()), ranks, round_robin).owner;
  const int64_t share = std::count(owners.begin(), owners.end(), me);
  EXPECT_GE(share, 2) << "rank " << me << " owns fewer than two matrices of the batch";
  test::ToyModel ref(all, 7);
  Muon muon(ref.refs(), options(NsAlgo::standard));
  for (int t = 0; t < kSteps; ++t) {
    set_gradients(ref, t);
    ASSERT_TRUE(muon.step());
  }
  for (const Mode mode : {Mode::z3, Mode::z2, Mode::replicated}) {
    const std::string what = "rr owners, mode " + std::to_string(int(mode));
    shard::ParamRegistry reg;
    for (const ParamSpec& s : all) reg.add(s);
    shard::ShardedParams sp(world(), reg, {Layout::owner_aligned, mode, ReduceOp::average, true}, owners);
    const test::ToyModel init(all, 7);
    for (int p = 0; p < sp.registry().size(); ++p) sp.load_full(p, init.values[p]);
    DMuon opt(world(), sp, options(NsAlgo::standard));
    for (int t = 0; t < kSteps; ++t) {
      backward(sp, t);
      ASSERT_TRUE(opt.step());
      EXPECT_EQ(opt.last_stats().ns_matrices, share) << what << " step " << t << " on rank " << me;
    }
    expect_equal_model(full_values(sp), ref, what);
  }
}

// DMuon refuses, on every rank alike, the even layout (it splits matrices) and a parameter of role
// elementwise moved into the Muon group (the owner-aligned layout splits it).
TEST(DistributedMuon, DMuonRefusesLayoutsThatSplitItsMatrices) {
  const auto refusal = [](auto make) -> std::string {
    try {
      make();
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  auto even = sharded(Layout::even, Mode::z3);
  EXPECT_NE(refusal([&] { DMuon d(world(), *even, options(NsAlgo::standard)); })
                .find("DMuon needs the owner-aligned layout (the even layout splits matrices"),
            std::string::npos);
  auto owned = sharded(Layout::owner_aligned, Mode::z3);
  OptimizerOptions o = options(NsAlgo::standard);
  o.rules.insert(o.rules.begin(), GroupRule{"embed", OptimGroup::muon});
  EXPECT_NE(refusal([&] { DMuon d(world(), *owned, o); })
                .find("parameter 'embed' is in the Muon group but its role is elementwise"),
            std::string::npos);
  // The same options are fine for the gather variant on the even layout, which holds whole matrices' pieces.
  EXPECT_EQ(refusal([&] { MuonGatherCompute g(world(), *even, o); }), "(no error)");
}

TEST(DistributedMuon, NonFiniteGradientSkipsOnEveryRank) {
  const int poison = 3;  // l.q: owned by one rank, whose NaN every rank must hear about
  const Reference ref = reference(NsAlgo::standard, 6, 2, poison);
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
    expect_equal_model(full_values(*sp), ref.model, c.name);
    expect_equal_state(*opt, ref.state, c.name);
  }
}

// The rank whose shard holds the NaN (after the reduce: l.q's owner under DMuon, the holder of its first
// element in the even layout) names the parameter and itself; every other rank says another rank did.
TEST(DistributedMuon, NonFiniteGradientFailsOnEveryRank) {
  const int poison = 3;  // l.q, unit 1; the NaN is its element 0
  const int me = world()->rank();
  for (const Case& c : kCases) {
    auto sp = sharded(c.layout, c.mode);
    int holder = -1;
    for (int r = 0; r < world()->size(); ++r)
      for (const shard::LocalPiece& piece : sp->layout(1).local_pieces(r))
        if (piece.param == poison && piece.offset_in_param == 0) holder = r;
    ASSERT_GE(holder, 0) << c.name;
    if (!c.gather_compute) {
      EXPECT_EQ(holder, sp->owners()[poison]) << c.name;
    }
    auto opt = make_optimizer(c, *sp, options(NsAlgo::standard));
    backward(*sp, 0, poison);
    try {
      opt->step();
      ADD_FAILURE() << c.name << ": a NaN gradient must raise on every rank";
    } catch (const Error& e) {
      const std::string want =
          me == holder ? "non-finite gradient in parameter 'l.q' on rank " + std::to_string(me) + " at update 1"
                       : "non-finite gradient on another rank at update 1 (that rank's error names the parameter); "
                         "this is rank " + std::to_string(me);
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << c.name << ": " << e.what();
    }
  }
}

// Plain Muon and recipe_options (NorMuon's v in the checkpoint).
TEST(DistributedMuon, CheckpointResumesBitIdenticallyAndAtOneRank) {
  test::TempDir tmp;
  const std::string dir = test::shared_folder(tmp);
  for (const bool recipe : {false, true})
  for (const Case& c : kCases) {
    const OptimizerOptions o = recipe ? recipe_options() : options(NsAlgo::standard);
    const std::string what = std::string(c.name) + (recipe ? ", recipe" : "");
    auto straight_sp = sharded(c.layout, c.mode);
    auto straight = make_optimizer(c, *straight_sp, o);
    auto first_sp = sharded(c.layout, c.mode);
    auto first = make_optimizer(c, *first_sp, o);
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
    auto resumed = make_optimizer(c, *resumed_sp, o);
    load_checkpoint(dir, *resumed);
    for (int t = 4; t < 8; ++t) {
      backward(*resumed_sp, t);
      resumed->step();
    }
    EXPECT_EQ(full_values(*resumed_sp), full_values(*straight_sp)) << what;
    EXPECT_EQ(state_of(*resumed), state_of(*straight)) << what;
    EXPECT_EQ(resumed->updates(), 8);
    // Resume in one process (world size 1, whole tensors) on every rank: the reference continued.
    test::ToyModel alone(specs(), 99);
    Muon single(alone.refs(), o);
    load_checkpoint(dir, single);
    for (int t = 4; t < 8; ++t) {
      set_gradients(alone, t);
      single.step();
    }
    expect_equal_model(full_values(*straight_sp), alone, what + " resumed at 1 rank");
    std::vector<double> barrier = {0};
    world()->all_reduce<double>(barrier, ReduceOp::sum).wait();  // all have read it before the next save
  }
}

// A corrupt file that only the last rank reads: every rank refuses the checkpoint (the last naming
// the file), and no rank's parameters change.
TEST(DistributedMuon, CorruptCheckpointIsRefusedOnEveryRank) {
  test::TempDir tmp;
  const std::string dir = test::shared_folder(tmp);
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
  world()->all_reduce<double>(barrier, ReduceOp::sum).wait();  // corrupted before anyone loads
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
  world()->all_reduce<double>(barrier, ReduceOp::sum).wait();
}

// Save at the world size D with the gather-compute baseline (even layout), resume at ⌈D/2⌉ ranks
// with DMuon (owner-aligned), save again, resume in one process: the uninterrupted single-process
// run, within the tolerance of expect_equal_model. At 4 ranks this is 4 → 2 → 1 (at 3, the groups
// are ranks {0, 1} and {2}).
TEST(DistributedMuon, CheckpointReshardsToHalfThenOneRank) {
  test::TempDir tmp;
  const std::string dir = test::shared_folder(tmp);
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
  const test::ToyModel ref = reference(NsAlgo::standard, 12).model;
  expect_equal_model(alone.values, ref, "saved at " + std::to_string(world()->size()) + ", resumed at " +
                                      std::to_string(half_size) + " then 1");
  std::vector<double> barrier = {0};
  world()->all_reduce<double>(barrier, ReduceOp::sum).wait();  // all done before the folder goes
}

}  // namespace
}  // namespace dmuon
