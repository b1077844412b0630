// Single-process optimizers: AdamW and Muon against the public reference code's golden tensors and,
// over several steps, a float64 reference written here from docs/design.md section 1; parameter groups,
// accumulation, clipping and the non-finite gradient policy.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <thread>

#include "dmuon/error.hpp"
#include "dmuon/optim.hpp"
#include "ns_reference.hpp"
#include "reference_orthogonalizer.hpp"
#include "test_data.hpp"
#include "toy_model.hpp"

namespace dmuon {
namespace {

constexpr double kEps = FLT_EPSILON;

// |x − ref| ≤ atol + rtol·|ref| element-wise; reports the worst element.
void expect_close(const std::vector<float>& x, const std::vector<float>& ref, double atol, double rtol,
                  const std::string& what) {
  ASSERT_EQ(x.size(), ref.size()) << what;
  size_t worst = 0;
  double worst_excess = -1;
  for (size_t i = 0; i < x.size(); ++i) {
    const double excess = std::abs(double(x[i]) - ref[i]) - (atol + rtol * std::abs(double(ref[i])));
    if (excess > worst_excess) worst_excess = excess, worst = i;
  }
  EXPECT_LE(worst_excess, 0) << what << ": element " << worst << " is " << x[worst] << ", reference " << ref[worst];
}

TEST(AdamW, MatchesTorchGolden) {
  AdamWHyper h;
  h.lr = 1e-3, h.beta1 = 0.9, h.beta2 = 0.95, h.eps = 1e-8, h.weight_decay = 0.1;  // golden.json
  std::vector<float> p = test::load_golden("adamw_p0.npy").data;
  std::vector<float> m(p.size()), v(p.size());
  for (int t = 1; t <= 3; ++t) {
    const std::vector<float> g = test::load_golden("adamw_g" + std::to_string(t) + ".npy").data;
    adamw_step(p, g, 1.0f, m, v, t, h);
    // We round as torch does, so each step may differ by a few ulps of p and of the update (≤ lr).
    expect_close(p, test::load_golden("adamw_p" + std::to_string(t) + ".npy").data, 4 * t * kEps * h.lr, 4 * t * kEps,
                 "AdamW step " + std::to_string(t));
  }
}

// A small model: two matrices and a bias.
struct Model : test::ToyModel {
  explicit Model(uint32_t seed)
      : ToyModel({{"layers.0.w", {6, 4}, ParamRole::matrix, 0},
                  {"embed.weight", {5, 3}, ParamRole::matrix, 0},
                  {"layers.0.bias", {6}, ParamRole::elementwise, 0}},
                 seed) {}
};

// Muon golden (KellerJordan/Muon in float32) through the whole optimizer. Each step moves W by
// lr·s·O with |O_ij| ≤ 1, so an NS whose result differs from the golden's float32 NS by δ per element
// moves W by at most lr·s·δ per step. The golden's float32 NS is within about 1e-6 of float64 NS
// (tests/data/README.md): δ = 2e-6 for the float64 reference and the standard float32 recurrence;
// Gram NS adds its own 3.2e-6 on Gaussian inputs (DESIGN 2.2 table, fp32 restart [2]): δ = 1e-5.
void check_muon_golden(const std::string& name, Orthogonalizer orth, double ns_delta) {
  std::vector<float> w = test::load_golden("muon_" + name + "_w0.npy").data;
  const std::vector<int64_t> shape = test::load_golden("muon_" + name + "_w0.npy").shape;
  std::vector<float> g(w.size());
  OptimizerOptions opt;
  opt.muon.lr = 0.02, opt.muon.weight_decay = 0.01, opt.muon.momentum = 0.95, opt.muon.nesterov = true;
  Optimizer muon({{{name, shape, ParamRole::matrix, 0}, w.data(), g.data()}}, opt, std::move(orth));
  const double s = muon_scale(shape[0], shape[1], MuonScale::original);
  for (int t = 1; t <= 3; ++t) {
    const std::vector<float> gt = test::load_golden("muon_" + name + "_g" + std::to_string(t) + ".npy").data;
    std::copy(gt.begin(), gt.end(), g.begin());  // in place: the optimizer holds g's address
    ASSERT_TRUE(muon.step());
    expect_close(w, test::load_golden("muon_" + name + "_w" + std::to_string(t) + ".npy").data,
                 t * opt.muon.lr * s * ns_delta, 4 * t * kEps, name + " step " + std::to_string(t));
  }
}
Orthogonalizer engine(NsAlgo algo) {
  NsOptions ns;
  ns.algo = algo;
  return ns_orthogonalizer(ns);
}
TEST(Muon, MatchesKellerJordanGoldenWide) { check_muon_golden("w_wide", test::reference_orthogonalizer(), 2e-6); }
TEST(Muon, MatchesKellerJordanGoldenTall) { check_muon_golden("w_tall", test::reference_orthogonalizer(), 2e-6); }
TEST(Muon, StandardNsMatchesGolden) {
  for (const char* name : {"w_wide", "w_tall"}) check_muon_golden(name, engine(NsAlgo::standard), 2e-6);
}
TEST(Muon, GramNsMatchesGolden) {
  for (const char* name : {"w_wide", "w_tall"}) check_muon_golden(name, engine(NsAlgo::gram), 1e-5);
}
TEST(Muon, ClassUsesTheNsEngine) {
  // dmuon::Muon with default options equals an Optimizer given the same engine, bit for bit.
  Model a(8), b(8);
  Muon ma(a.refs(), OptimizerOptions{});
  Optimizer mb(b.refs(), OptimizerOptions{}, ns_orthogonalizer(NsOptions{}));
  for (int t = 0; t < 3; ++t) {
    a.set_grads(t), b.set_grads(t);
    ma.step(), mb.step();
  }
  EXPECT_EQ(a.values, b.values);
}

TEST(Muon, MomentumNesterovScaleAndDecayFollowTheDefinition) {
  MuonHyper h;
  h.momentum = 0.9, h.lr = 0.1, h.weight_decay = 0.5;
  std::vector<float> g = {1, -2}, mom = {0.5f, 0.5f}, u(2);
  muon_momentum(g, 2.0f, mom, u, h);  // g·2 = {2, −4}
  EXPECT_FLOAT_EQ(mom[0], 0.9f * 0.5f + 0.1f * 2);
  EXPECT_FLOAT_EQ(mom[1], 0.9f * 0.5f + 0.1f * -4);
  EXPECT_FLOAT_EQ(u[0], 0.1f * 2 + 0.9f * mom[0]);
  h.nesterov = false;
  muon_momentum(g, 1.0f, mom, u, h);
  EXPECT_EQ(u, mom);
  // The scale's table, which dmuon.torch's own muon_scale meets too (tests/python/torch_conventions_test.py).
  const nlohmann::json table = nlohmann::json::parse(std::ifstream(test::data_path("muon_scale.json")));
  ASSERT_GE(table.at("cases").size(), 4u);
  for (const auto& c : table.at("cases")) {
    const MuonScale kind = c.at("scale") == "original" ? MuonScale::original : MuonScale::match_rms_adamw;
    EXPECT_DOUBLE_EQ(muon_scale(c.at("rows").get<int64_t>(), c.at("cols").get<int64_t>(), kind), c.at("s").get<double>()) << c.dump();
  }
  std::vector<float> w = {1, 2}, o = {1, -1};
  muon_apply(w, o, h, 2.0);  // w·(1 − 0.05) − 0.1·2·o
  EXPECT_FLOAT_EQ(w[0], 0.95f - 0.2f);
  EXPECT_FLOAT_EQ(w[1], 1.9f + 0.2f);
}

TEST(ParamGroups, GlobAndRegexPatterns) {
  EXPECT_TRUE(name_matches("layers.*.mlp.*", "layers.3.mlp.up.weight"));
  EXPECT_FALSE(name_matches("layers.*.mlp.*", "layers.3.attn.q.weight"));
  EXPECT_TRUE(name_matches("embed?weight", "embed.weight"));
  EXPECT_FALSE(name_matches("embed", "embed.weight"));  // whole name
  EXPECT_TRUE(name_matches("re:layers\\.[0-9]+\\.attn\\..*", "layers.12.attn.q.weight"));
  EXPECT_FALSE(name_matches("re:layers\\.[0-9]+", "layers.12.attn"));
  EXPECT_FALSE(name_matches("a+b", "aab"));  // glob: '+' is literal
  EXPECT_THROW(name_matches("re:([", "x"), Error);
}

TEST(ParamGroups, RoleDefaultsAndRulesMoveParameters) {
  Model model(1);
  OptimizerOptions opt;
  opt.rules = {{"embed.*", OptimGroup::adamw}};
  Optimizer o(model.refs(), opt, test::reference_orthogonalizer());
  EXPECT_EQ(o.group_of("layers.0.w"), OptimGroup::muon);
  EXPECT_EQ(o.group_of("embed.weight"), OptimGroup::adamw);
  EXPECT_EQ(o.group_of("layers.0.bias"), OptimGroup::adamw);
  EXPECT_THROW(o.group_of("nope"), Error);
  opt.rules = {{"*bias", OptimGroup::muon}};
  try {
    Optimizer bad(model.refs(), opt, test::reference_orthogonalizer());
    FAIL() << "a 1-D parameter in the Muon group must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layers.0.bias"), std::string::npos) << e.what();
  }
}

// Every optimizer state buffer by "<param> <kind>" (muon.momentum, adamw.m, adamw.v; not the values).
std::map<std::string, std::vector<float>> state_of(Optimizer& o) {
  std::map<std::string, std::vector<float>> out;
  for (const StateSlice& s : o.state_slices())
    if (s.kind != "param") out[s.param + " " + s.kind].assign(s.data, s.data + s.count);
  return out;
}

// The optimizer state a and b hold agrees buffer by buffer within atol + rtol·|b|.
void expect_same_state(Optimizer& a, Optimizer& b, double atol, double rtol, const std::string& what) {
  const auto sa = state_of(a), sb = state_of(b);
  ASSERT_EQ(sa.size(), sb.size()) << what;
  for (const auto& [key, values] : sb) {
    ASSERT_TRUE(sa.count(key)) << what << ": no " << key;
    expect_close(sa.at(key), values, atol, rtol, what + ": " + key);
  }
}

// ‖g‖ in double over every parameter of a model.
double norm_of(const std::vector<std::vector<double>>& g) {
  double sq = 0;
  for (const auto& p : g)
    for (double x : p) sq += x * x;
  return std::sqrt(sq);
}

// Four micro-batches of 3 samples against one batch of 12 (the gradient of a batch is the mean of its
// samples' gradients), with clipping at 1 and step scales that put some updates above the bound and
// some below. AdamW and Muon hardly see a uniform scale of the gradient, so a sum over micro-batches
// instead of their mean would pass a comparison of weights alone; it cannot pass these: the norm the
// optimizer reports is the brute-force norm of the 12-sample mean, the steps below the bound are not
// clipped (a 4× larger sum would be), and every state buffer (Muon's momentum, AdamW's m and v, all
// linear or quadratic in the gradient's scale) equals the one-batch optimizer's.
TEST(Optimizer, AccumulatingFourMicroBatchesEqualsOneBigBatch) {
  const double clip = 1.0;
  const std::vector<float> step_scale = {2.0f, 0.15f, 1.0f, 0.1f};  // mean-gradient norms about 4.5 × scale
  Model big(2), micro(2);
  OptimizerOptions opt;
  opt.clip_grad_norm = clip;
  Optimizer ob(big.refs(), opt, test::reference_orthogonalizer());
  opt.accumulation_steps = 4;
  Optimizer om(micro.refs(), opt, test::reference_orthogonalizer());
  int below = 0;
  for (int t = 0; t < int(step_scale.size()); ++t) {
    std::vector<std::vector<double>> mean(big.specs.size());  // the 12-sample mean gradient, in double
    for (size_t p = 0; p < big.specs.size(); ++p)
      for (size_t i = 0; i < big.grads[p].size(); ++i) {
        float sum = 0;
        for (int j = 0; j < 12; ++j) sum += step_scale[t] * big.sample_grad(p, i, t, j);
        big.grads[p][i] = sum / 12;
        double exact = 0;
        for (int j = 0; j < 12; ++j) exact += double(step_scale[t]) * big.sample_grad(p, i, t, j);
        mean[p].push_back(exact / 12);
      }
    EXPECT_TRUE(ob.step());
    for (int mb = 0; mb < 4; ++mb) {
      for (size_t p = 0; p < micro.specs.size(); ++p)
        for (size_t i = 0; i < micro.grads[p].size(); ++i) {
          float sum = 0;
          for (int j = 0; j < 3; ++j) sum += step_scale[t] * micro.sample_grad(p, i, t, 3 * mb + j);
          micro.grads[p][i] = sum / 3;
        }
      EXPECT_EQ(om.step(), mb == 3);
    }
    const double norm = norm_of(mean);
    below += norm < clip;
    EXPECT_NEAR(om.last_grad_norm(), norm, 1e-6 * norm) << "step " << t;
    EXPECT_NEAR(ob.last_grad_norm(), norm, 1e-6 * norm) << "step " << t;
  }
  ASSERT_GE(below, 1);
  ASSERT_LT(below, int(step_scale.size()));
  EXPECT_EQ(om.updates(), 4);
  // The two gradient means differ by summation order (≲ 12 ulps of the gradient); AdamW divides by
  // sqrt(v) so a relative gradient change δ moves an element by about lr·δ, Muon by lr·s·|O|·δ/σ_min
  // of the momentum; 1e-5 relative over 4 steps covers both on these well-conditioned matrices. The
  // state is linear (momentum, m) or quadratic (v) in the gradient: its rounding is a few ulps.
  for (size_t p = 0; p < big.specs.size(); ++p) expect_close(micro.values[p], big.values[p], 1e-5, 1e-5, big.specs[p].name);
  expect_same_state(om, ob, 1e-9, 1e-5, "accumulated vs one batch");
}

// A non-finite gradient in one micro-batch skips that whole update on every call that completes it;
// the next update starts its accumulation afresh, so it equals an optimizer that never saw the
// poisoned micro-batches.
TEST(Optimizer, NonFiniteSkipWithAccumulationDropsTheWholeUpdate) {
  Model m(9), clean(9);
  OptimizerOptions opt;
  opt.nonfinite = NonFinitePolicy::skip;
  opt.accumulation_steps = 3;
  Optimizer o(m.refs(), opt, test::reference_orthogonalizer());
  Optimizer oc(clean.refs(), opt, test::reference_orthogonalizer());
  const auto micro_batch = [](Model& model, int t, int mb) {
    for (size_t p = 0; p < model.specs.size(); ++p)
      for (size_t i = 0; i < model.grads[p].size(); ++i) model.grads[p][i] = Model::sample_grad(p, i, t, mb);
  };
  const auto before = m.values;
  for (int mb = 0; mb < 3; ++mb) {  // update 0: micro-batch 1 holds an infinity
    micro_batch(m, 0, mb);
    if (mb == 1) m.grads[1][2] = std::numeric_limits<float>::infinity();
    EXPECT_FALSE(o.step()) << "micro-batch " << mb;
  }
  EXPECT_EQ(o.skipped_steps(), 1);
  EXPECT_EQ(o.updates(), 0);
  EXPECT_EQ(m.values, before);
  for (int t = 1; t <= 2; ++t)
    for (int mb = 0; mb < 3; ++mb) {
      micro_batch(m, t, mb), micro_batch(clean, t, mb);
      EXPECT_EQ(o.step(), mb == 2) << "update " << t << " micro-batch " << mb;
      EXPECT_EQ(oc.step(), mb == 2);
    }
  EXPECT_EQ(o.updates(), 2);
  EXPECT_EQ(o.skipped_steps(), 1);
  EXPECT_EQ(m.values, clean.values);
  expect_same_state(o, oc, 0, 0, "after a skipped update");
}

// last_stats counts the matrices handed to the Orthogonalizer in the last update and the time spent in
// it (an orthogonalizer that sleeps makes the time measurable without asserting on speed).
TEST(Optimizer, LastStatsCountOrthogonalizedMatricesAndTheirTime) {
  Model m(3);
  const Orthogonalizer ref = test::reference_orthogonalizer();
  int calls = 0;
  Optimizer opt(m.refs(), {}, [&](Backend& backend, std::span<const MatView> u, std::span<const MatView> o,
                                  std::span<const std::string> names, double* norms) {
    ++calls;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    ref(backend, u, o, names, norms);
  });
  EXPECT_EQ(opt.last_stats().ns_matrices, 0);
  m.set_grads(0);
  ASSERT_TRUE(opt.step());
  EXPECT_EQ(calls, 2);  // two shapes, one call each
  EXPECT_EQ(opt.last_stats().ns_matrices, 2);
  EXPECT_GE(opt.last_stats().ns_s, 2 * 0.002);
}

TEST(Optimizer, ClipsByGlobalNorm) {
  Model a(3), b(3);
  OptimizerOptions opt;
  opt.clip_grad_norm = 0.5;
  Optimizer oa(a.refs(), opt, test::reference_orthogonalizer());
  opt.clip_grad_norm = 0;
  Optimizer ob(b.refs(), opt, test::reference_orthogonalizer());
  double sq = 0;
  for (size_t p = 0; p < a.specs.size(); ++p)
    for (size_t i = 0; i < a.grads[p].size(); ++i) {
      a.grads[p][i] = a.sample_grad(p, i, 0, 0);
      sq += double(a.grads[p][i]) * a.grads[p][i];
    }
  const float factor = static_cast<float>(0.5 / (std::sqrt(sq) + 1e-6));
  for (size_t p = 0; p < a.specs.size(); ++p)
    for (size_t i = 0; i < a.grads[p].size(); ++i) b.grads[p][i] = a.grads[p][i] * factor;
  oa.step();
  ob.step();
  EXPECT_NEAR(oa.last_grad_norm(), std::sqrt(sq), 1e-12 * std::sqrt(sq));
  // The two factors may differ by an ulp (the norm is summed in another order). AdamW's first step
  // is invariant to the gradient's scale; NS nearly so, but amplifies a relative input change along
  // small singular values by up to its slope at 0, a^5 = 3.4445^5 ≈ 490, and |O| ≤ 1, s ≤ 1.3.
  const double muon_atol = 0.02 * 1.3 * 490 * 2 * kEps;
  for (size_t p = 0; p < a.specs.size(); ++p) expect_close(a.values[p], b.values[p], muon_atol, 4 * kEps, a.specs[p].name);
  // The weights after one step hardly see the factor (AdamW's first step and NS are scale-invariant);
  // the state does: momentum = (1 − β)·g·factor, m = (1 − β1)·g·factor, v = (1 − β2)·(g·factor)².
  expect_same_state(oa, ob, 0, 4 * kEps, "clipped vs prescaled");
  const auto state = state_of(oa);
  const std::vector<float>& m = state.at("layers.0.bias adamw.m");
  for (size_t i = 0; i < m.size(); ++i) EXPECT_FLOAT_EQ(m[i], 0.1f * (a.grads[2][i] * factor)) << i;
  const std::vector<float>& mom = state.at("layers.0.w muon.momentum");
  for (size_t i = 0; i < mom.size(); ++i) EXPECT_FLOAT_EQ(mom[i], 0.05f * (a.grads[0][i] * factor)) << i;
}

// Several steps whose gradient norms vary (some above the bound, some below) so AdamW's second moment
// and Muon's momentum mix gradients of different scales, and neither is invariant to the clip factor:
// clipping must equal feeding the unclipped optimizer g·min(1, c/(‖g‖ + 1e-6)), and differ from no clipping.
TEST(Optimizer, ClippingEqualsPrescaledGradientsOverSeveralSteps) {
  const double clip = 1.0;
  const std::vector<float> step_scale = {4.0f, 0.1f, 2.0f, 0.05f, 3.0f};  // ‖g‖ ≈ 4.7 × scale
  Model clipped(6), prescaled(6), unclipped(6);
  OptimizerOptions opt;
  opt.clip_grad_norm = clip;
  Optimizer oc(clipped.refs(), opt, test::reference_orthogonalizer());
  opt.clip_grad_norm = 0;
  Optimizer op(prescaled.refs(), opt, test::reference_orthogonalizer());
  Optimizer ou(unclipped.refs(), opt, test::reference_orthogonalizer());
  int clipped_steps = 0;
  for (size_t t = 0; t < step_scale.size(); ++t) {
    double sq = 0;
    for (size_t p = 0; p < clipped.specs.size(); ++p)
      for (size_t i = 0; i < clipped.grads[p].size(); ++i) {
        const float g = step_scale[t] * Model::sample_grad(p, i, int(t));
        clipped.grads[p][i] = unclipped.grads[p][i] = g;
        sq += double(g) * g;
      }
    const double norm = std::sqrt(sq);
    const float factor = norm > clip ? static_cast<float>(clip / (norm + 1e-6)) : 1.0f;
    clipped_steps += norm > clip;
    for (size_t p = 0; p < clipped.specs.size(); ++p)
      for (size_t i = 0; i < clipped.grads[p].size(); ++i) prescaled.grads[p][i] = clipped.grads[p][i] * factor;
    ASSERT_TRUE(oc.step());
    ASSERT_TRUE(op.step());
    ASSERT_TRUE(ou.step());
    EXPECT_NEAR(oc.last_grad_norm(), norm, 1e-12 * norm) << "step " << t;
  }
  ASSERT_GE(clipped_steps, 2);
  ASSERT_LT(clipped_steps, int(step_scale.size()));
  // As in ClipsByGlobalNorm, the two factors may differ by an ulp per step; each step adds at most
  // the Muon bound (NS slope a^5 ≈ 490 on a 2-ulp input change, lr 0.02, s ≤ 1.3) and AdamW's lr·δ.
  const double steps = double(step_scale.size());
  const double atol = steps * 0.02 * 1.3 * 490 * 2 * kEps, rtol = steps * 4 * kEps;
  double largest_effect = 0;
  for (size_t p = 0; p < clipped.specs.size(); ++p) {
    expect_close(clipped.values[p], prescaled.values[p], atol, rtol, clipped.specs[p].name);
    for (size_t i = 0; i < clipped.values[p].size(); ++i)
      largest_effect = std::max(largest_effect, std::abs(double(clipped.values[p][i]) - unclipped.values[p][i]));
  }
  // Clipping changes the result by far more than the tolerance above.
  EXPECT_GT(largest_effect, 100 * (atol + rtol * 4));
}

TEST(Optimizer, NonFiniteGradientRaisesNamingParameterAndRank) {
  Model m(4);
  Optimizer o(m.refs(), OptimizerOptions{}, test::reference_orthogonalizer());
  m.grads[2][1] = std::numeric_limits<float>::quiet_NaN();
  try {
    o.step();
    FAIL() << "a NaN gradient must raise under the default policy";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'layers.0.bias' on rank 0"), std::string::npos) << e.what();
  }
}

TEST(Optimizer, NonFiniteGradientSkipLeavesParametersAndCounts) {
  Model m(5);
  OptimizerOptions opt;
  opt.nonfinite = NonFinitePolicy::skip;
  Optimizer o(m.refs(), opt, test::reference_orthogonalizer());
  const auto before = m.values;
  m.grads[0][3] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(o.step());
  EXPECT_EQ(m.values, before);
  EXPECT_EQ(o.skipped_steps(), 1);
  EXPECT_EQ(o.updates(), 0);
  m.grads[0][3] = 0.5f;
  EXPECT_TRUE(o.step());
  EXPECT_EQ(o.updates(), 1);
  EXPECT_NE(m.values, before);
}

TEST(AdamW, ShardedEqualsWholeBitForBit) {
  // AdamW is elementwise: three optimizers on thirds of every tensor equal one on the whole tensors.
  Model whole(7), split(7);
  AdamW ow(whole.refs(), OptimizerOptions{});
  std::vector<std::unique_ptr<AdamW>> thirds;
  for (int r = 0; r < 3; ++r) thirds.push_back(std::make_unique<AdamW>(split.slice_refs(r, 3), OptimizerOptions{}));
  EXPECT_EQ(ow.group_of("layers.0.w"), OptimGroup::adamw);
  for (int t = 0; t < 4; ++t) {
    whole.set_grads(t);
    split.set_grads(t);
    ow.step();
    for (auto& o : thirds) o->step();
  }
  EXPECT_EQ(split.values, whole.values);
}

// set_lr(muon_lr, adamw_lr) sets each group's rate exactly: on a first step (no decay) a Muon matrix
// moves by −muon_lr·s·O (O what the orthogonalizer returned) and an AdamW element by
// −adamw_lr·g/(|g| + eps) (m̂ = g, v̂ = g²).
// The reference orthogonalizer, keeping each matrix's O by name in `out`.
Orthogonalizer recording_orthogonalizer(std::map<std::string, std::vector<float>>& out) {
  return [&out, ref = test::reference_orthogonalizer()](Backend& backend, std::span<const MatView> u,
                                                         std::span<const MatView> o, std::span<const std::string> names,
                                                         double* norms) {
    ref(backend, u, o, names, norms);
    for (size_t i = 0; i < names.size(); ++i) out[names[i]].assign(o[i].f32(), o[i].f32() + o[i].elements());
  };
}

TEST(Optimizer, SetLrSetsEachGroupsRate) {
  Model a(6);
  const auto start = a.values;
  Optimizer oa(a.refs(), OptimizerOptions{}, test::reference_orthogonalizer());
  oa.set_lr(0, 0);
  for (size_t p = 0; p < a.grads.size(); ++p)
    for (size_t i = 0; i < a.grads[p].size(); ++i) a.grads[p][i] = Model::sample_grad(p, i, 0);
  ASSERT_TRUE(oa.step());
  EXPECT_EQ(a.values, start);  // lr 0: nothing moves (no decay either)

  Model b(6);
  std::map<std::string, std::vector<float>> orthogonalized;
  Optimizer ob(b.refs(), OptimizerOptions{}, recording_orthogonalizer(orthogonalized));
  const double muon_lr = 0.05, adamw_lr = 0.003;  // neither group's default, and not each other's
  ob.set_lr(muon_lr, adamw_lr);
  for (size_t p = 0; p < b.grads.size(); ++p) std::copy(a.grads[p].begin(), a.grads[p].end(), b.grads[p].begin());
  ASSERT_TRUE(ob.step());
  for (size_t p = 0; p < b.specs.size(); ++p) {
    const ParamSpec& spec = b.specs[p];
    for (size_t i = 0; i < b.values[p].size(); ++i) {
      const double moved = double(b.values[p][i]) - start[p][i];
      double want;
      if (ob.group_of(spec.name) == OptimGroup::muon) {
        want = -muon_lr * muon_scale(spec.rows(), spec.cols(), MuonScale::original) * orthogonalized.at(spec.name)[i];
      } else {
        const double g = b.grads[p][i];
        want = -adamw_lr * g / (std::abs(g) + 1e-8);
      }
      EXPECT_NEAR(moved, want, 4 * kEps * (std::abs(start[p][i]) + std::abs(want))) << spec.name << "[" << i << "]";
    }
  }
}

// ---- several steps against an independent float64 reference ----
// The distributed optimizers are tested against the single-process one and share its kernels, so a
// wrong rule there (AdamW's step count, Nesterov, Muon's decoupled decay) would pass them all. Here the
// single-process optimizer runs 6 steps against a float64 reference written from docs/design.md
// section 1 and torch.optim.AdamW's definition; it shares nothing with the engine but the float64
// Newton–Schulz recurrence of DESIGN 2.1 (ns_reference.hpp, a test helper), given KellerJordan's
// coefficients here.
struct ReferenceOptimizer {
  OptimizerOptions o;
  std::vector<ParamSpec> specs;
  std::vector<bool> muon;                      // per parameter: in the Muon group
  std::vector<std::vector<double>> w, m, v;    // values, momentum (Muon) or first moment (AdamW), second moment
  int64_t t = 0;                               // AdamW's step count
  double largest_adam_ratio = 0;               // max |m̂/(√v̂ + ε)| seen, for the AdamW tolerance

  void step(const std::vector<std::vector<float>>& grads) {
    ++t;
    for (size_t p = 0; p < specs.size(); ++p) {
      const std::vector<float>& g = grads[p];
      std::vector<double>&W = w[p], &M = m[p], &V = v[p];
      if (muon[p]) {
        const MuonHyper& h = o.muon;
        const double beta = h.momentum;
        test::MatD u(specs[p].shape[0], specs[p].shape[1]);
        for (size_t i = 0; i < g.size(); ++i) {
          M[i] = beta * M[i] + (1 - beta) * g[i];
          u.v[i] = h.nesterov ? (1 - beta) * g[i] + beta * M[i] : M[i];
        }
        const test::MatD orth = test::standard_ns_reference(u, std::vector<NsStep>(5, {3.4445, -4.7750, 2.0315}), 1);
        const double s = std::sqrt(std::max(1.0, double(u.rows) / double(u.cols)));
        for (size_t i = 0; i < g.size(); ++i) W[i] = W[i] * (1 - h.lr * h.weight_decay) - h.lr * s * orth.v[i];
      } else {
        const AdamWHyper& h = o.adamw;
        const double bias1 = 1 - std::pow(h.beta1, double(t)), bias2 = 1 - std::pow(h.beta2, double(t));
        for (size_t i = 0; i < g.size(); ++i) {
          M[i] = h.beta1 * M[i] + (1 - h.beta1) * g[i];
          V[i] = h.beta2 * V[i] + (1 - h.beta2) * double(g[i]) * g[i];
          const double ratio = (M[i] / bias1) / (std::sqrt(V[i] / bias2) + h.eps);
          largest_adam_ratio = std::max(largest_adam_ratio, std::abs(ratio));
          W[i] = W[i] * (1 - h.lr * h.weight_decay) - (h.lr / bias1) * M[i] / (std::sqrt(V[i]) / std::sqrt(bias2) + h.eps);
        }
      }
    }
  }
};

// Tall (s = √(12/5)), wide (s = 1), a matrix sent to AdamW by a rule, and a bias; Gaussian gradients
// whose scale changes from step to step (so bias correction and momentum both matter).
TEST(Optimizer, SeveralStepsOfMuonAndAdamWEqualAFloat64Reference) {
  const std::vector<ParamSpec> specs = {{"layers.0.tall", {12, 5}, ParamRole::matrix, 0},
                                        {"layers.0.wide", {4, 10}, ParamRole::matrix, 0},
                                        {"embed.weight", {7, 3}, ParamRole::matrix, 0},
                                        {"layers.0.bias", {6}, ParamRole::elementwise, 0}};
  constexpr int kSteps = 6;
  const float step_scale[kSteps] = {1.0f, 0.3f, 2.0f, 0.5f, 1.5f, 0.1f};
  for (const bool nesterov : {true, false}) {
    const std::string what = nesterov ? "nesterov" : "plain momentum";
    OptimizerOptions opt;
    opt.rules = {{"embed.*", OptimGroup::adamw}};
    opt.muon.lr = 0.02, opt.muon.momentum = 0.9, opt.muon.nesterov = nesterov, opt.muon.weight_decay = 0.1;
    opt.muon.ns.algo = NsAlgo::standard;
    opt.adamw.lr = 0.01, opt.adamw.beta1 = 0.9, opt.adamw.beta2 = 0.95, opt.adamw.weight_decay = 0.05;
    test::ToyModel model(specs, 5);
    ReferenceOptimizer ref{opt, specs, {true, true, false, false}, {}, {}, {}};
    for (const auto& values : model.values) {
      ref.w.emplace_back(values.begin(), values.end());
      ref.m.emplace_back(values.size(), 0.0);
      ref.v.emplace_back(values.size(), 0.0);
    }
    Muon optimizer(model.refs(), opt);
    for (int t = 1; t <= kSteps; ++t) {
      std::mt19937 rng(100 + t);
      std::normal_distribution<float> normal;
      for (auto& g : model.grads)
        for (float& x : g) x = step_scale[t - 1] * normal(rng);
      ASSERT_TRUE(optimizer.step());
      ref.step(model.grads);
      // Muon: each step moves W by lr·s·O with the engine's float32 NS within δ = 2e-6 per element of
      // the float64 one (check_muon_golden above), plus a few ulps of W per step. AdamW: each step
      // rounds W and its update lr·r (|r| ≤ largest_adam_ratio) to a few ulps, as torch does.
      for (size_t p = 0; p < specs.size(); ++p) {
        const std::vector<float> expected(ref.w[p].begin(), ref.w[p].end());
        const std::string where = what + ": " + specs[p].name + " step " + std::to_string(t);
        if (ref.muon[p]) {
          const double s = std::sqrt(std::max(1.0, double(specs[p].shape[0]) / double(specs[p].shape[1])));
          expect_close(model.values[p], expected, t * opt.muon.lr * s * 2e-6, 4 * t * kEps, where);
        } else {
          expect_close(model.values[p], expected, 4 * t * kEps * opt.adamw.lr * ref.largest_adam_ratio, 4 * t * kEps,
                       where);
        }
      }
    }
    EXPECT_EQ(optimizer.updates(), kSteps);
  }
}

// ---- options per matrix and NorMuon ----

// Muon with per-matrix options against a float64 reference written from their definitions (docs/optimizers.md;
// tests/python/muon_reference.py: normuon_ref, update_scale, muon_apply_ref): layer 0's matrices run NorMuon
// (β2 0.9) with Moonlight's scale times 1.5 and cautious weight decay, layer 1's wide matrix (layer 0's shape,
// other options: its own batch) plain Muon. Newton–Schulz is the float64 reference for both, so O differs from
// the float64 O only by the float32 momentum's rounding: δ = 2e-6 per element, as in the test above. NorMuon
// multiplies row r by f_r = ratio/(√v_r + 1e-8), whose relative error is at most δ/rms_r (the row's RMS of O, in
// its v) plus the ratio's (a mean of those); |O_rj| ≤ √cols·rms_r, so Ô's error is at most f_r·δ·(1 + 2√cols).
TEST(Optimizer, PerMatrixOptionsAndNorMuonEqualAFloat64Reference) {
  const std::vector<ParamSpec> specs = {{"layers.0.tall", {12, 5}, ParamRole::matrix, 0},
                                        {"layers.0.wide", {4, 10}, ParamRole::matrix, 0},
                                        {"layers.1.wide", {4, 10}, ParamRole::matrix, 0},
                                        {"layers.0.bias", {6}, ParamRole::elementwise, 0}};
  OptimizerOptions opt;
  opt.muon.lr = 0.02, opt.muon.momentum = 0.9, opt.muon.weight_decay = 0.1;
  MuonMatrixOptions recipe = opt.muon;
  recipe.variant = MuonVariant::normuon, recipe.normuon_beta2 = 0.9;
  recipe.scale = MuonScale::match_rms_adamw, recipe.extra_scale_factor = 1.5, recipe.cautious_wd = true;
  opt.muon_rules = {{"layers.0.*", recipe}};
  test::ToyModel model(specs, 5);
  Optimizer optimizer(model.refs(), opt, test::reference_orthogonalizer());
  EXPECT_EQ(optimizer.muon_options_of("layers.0.tall"), recipe);
  EXPECT_EQ(optimizer.muon_options_of("layers.1.wide"), static_cast<const MuonMatrixOptions&>(opt.muon));

  constexpr double kDelta = 2e-6;
  const double beta = opt.muon.momentum, lr = opt.muon.lr, wd = opt.muon.weight_decay;
  std::vector<std::vector<double>> w, m(3), v(2);
  for (const auto& values : model.values) w.emplace_back(values.begin(), values.end());
  for (int p = 0; p < 3; ++p) m[p].assign(specs[p].numel(), 0.0);
  for (int p = 0; p < 2; ++p) v[p].assign(specs[p].rows(), 0.0);
  int cautious_kept = 0;
  for (int t = 1; t <= 5; ++t) {
    std::mt19937 rng(200 + t);
    std::normal_distribution<float> normal;
    for (auto& g : model.grads)
      for (float& x : g) x = normal(rng);
    ASSERT_TRUE(optimizer.step());
    for (int p = 0; p < 3; ++p) {
      const int64_t rows = specs[p].rows(), cols = specs[p].cols();
      const bool normuon = p < 2;
      test::MatD u(rows, cols);
      for (int64_t i = 0; i < rows * cols; ++i) {
        m[p][i] = beta * m[p][i] + (1 - beta) * model.grads[p][i];
        u.v[i] = (1 - beta) * model.grads[p][i] + beta * m[p][i];
      }
      std::vector<double> o = test::standard_ns_reference(u, ns_schedule(NsCoeffs::keller, 5), 1).v;
      double f_max = 1, largest_o = 0;
      if (normuon) {
        double o_sq = 0, y_sq = 0;
        std::vector<double> d(rows);
        for (int64_t r = 0; r < rows; ++r) {
          double sum = 0;
          for (int64_t j = 0; j < cols; ++j) sum += o[r * cols + j] * o[r * cols + j];
          v[p][r] = 0.9 * v[p][r] + 0.1 * sum / double(cols);
          d[r] = std::sqrt(v[p][r]) + 1e-8;
          o_sq += sum, y_sq += sum / (d[r] * d[r]);
        }
        const double ratio = std::sqrt(o_sq) / std::max(std::sqrt(y_sq), 1e-8);
        for (int64_t i = 0; i < rows * cols; ++i) largest_o = std::max(largest_o, std::abs(o[i]));
        f_max = 0;
        for (int64_t r = 0; r < rows; ++r) f_max = std::max(f_max, ratio / d[r]);
        for (int64_t i = 0; i < rows * cols; ++i) o[i] *= ratio / d[i / cols];
      }
      const double s = normuon ? 0.2 * std::sqrt(double(std::max(rows, cols))) * 1.5
                               : std::sqrt(std::max(1.0, double(rows) / double(cols)));
      for (int64_t i = 0; i < rows * cols; ++i) {
        const bool decays = !normuon || w[p][i] * o[i] >= 0;  // cautious weight decay on layer 0
        cautious_kept += !decays;
        w[p][i] = (decays ? w[p][i] * (1 - lr * wd) : w[p][i]) - lr * s * o[i];
      }
      const double per_step = lr * s * kDelta * (normuon ? f_max * (1 + 2 * std::sqrt(double(cols))) : 1);
      const std::string where = specs[p].name + " step " + std::to_string(t);
      expect_close(model.values[p], std::vector<float>(w[p].begin(), w[p].end()), t * per_step, 4 * t * kEps, where);
      if (normuon) {  // v = mean of O², each O within δ: 2·max|O|·δ per step, and float32's rounding
        const std::vector<float> got = state_of(optimizer).at(specs[p].name + " normuon.v");
        expect_close(got, std::vector<float>(v[p].begin(), v[p].end()), t * 2 * largest_o * kDelta, 4 * t * kEps,
                     where + " normuon.v");
      }
    }
  }
  EXPECT_GT(cautious_kept, 0) << "no element of layer 0 kept its weight from decay: cautious weight decay untested";
}

// The orthogonalizer's calls, by the names of the matrices in each.
Orthogonalizer call_recording_orthogonalizer(std::vector<std::vector<std::string>>& calls) {
  return [&calls, ns = ns_orthogonalizer(NsOptions{})](Backend& backend, std::span<const MatView> u,
                                                       std::span<const MatView> o, std::span<const std::string> names,
                                                       double* norms) {
    ns(backend, u, o, names, norms);
    calls.emplace_back(names.begin(), names.end());
  };
}

// A rule's Newton–Schulz (6 steps of Polar Express) gives its matrix, bit for bit, what an optimizer whose default
// is that setting gives it; the matrices no rule names equal the plain optimizer's; matrices of one shape share a
// Newton–Schulz call only when their Newton–Schulz settings are equal (q runs the rule's engine alone, k and v the
// optimizer's orthogonalizer together: v differs in its variant, which acts after the Newton–Schulz).
TEST(Optimizer, PerMatrixNewtonSchulzEqualsTheSettingOptimizerWideBitForBit) {
  const std::vector<ParamSpec> specs = {{"a.q", {8, 8}, ParamRole::matrix, 0},
                                        {"a.k", {8, 8}, ParamRole::matrix, 0},
                                        {"a.v", {8, 8}, ParamRole::matrix, 0}};
  OptimizerOptions plain;
  OptimizerOptions six = plain;
  six.muon.ns.steps = 6, six.muon.ns.coeffs = NsCoeffs::polar_express;
  OptimizerOptions ruled = plain;
  MuonMatrixOptions normuon = plain.muon;
  normuon.variant = MuonVariant::normuon;
  ruled.muon_rules = {{"a.q", six.muon}, {"a.v", normuon}};
  test::ToyModel a(specs, 3), b(specs, 3), c(specs, 3);
  std::vector<std::vector<std::string>> calls;
  Optimizer with_rules(a.refs(), ruled, call_recording_orthogonalizer(calls));
  Muon six_wide(b.refs(), six), plain_wide(c.refs(), plain);
  for (int t = 0; t < 3; ++t) {
    for (test::ToyModel* m : {&a, &b, &c}) m->set_grads(t);
    ASSERT_TRUE(with_rules.step() && six_wide.step() && plain_wide.step());
  }
  EXPECT_EQ(a.values[0], b.values[0]) << "a.q: the rule's 6 polar-express steps";
  EXPECT_EQ(a.values[1], c.values[1]) << "a.k: the defaults";
  EXPECT_NE(a.values[0], c.values[0]);
  EXPECT_NE(a.values[2], c.values[2]) << "a.v: NorMuon changes the update";
  EXPECT_EQ(with_rules.muon_options_of("a.q").ns.steps, 6);
  ASSERT_EQ(calls.size(), 3u) << "a.k and a.v together, for 3 steps";
  for (const auto& call : calls) EXPECT_EQ(call, (std::vector<std::string>{"a.k", "a.v"}));
}

// ---- split Newton–Schulz ----

// The reference splits by hand: each block of a split matrix is a parameter of its own ("name#b", the block's
// values and gradient copied out of the matrix), with the split matrix's options but no split. Its blocks' shapes
// give their scales; NorMuon's v is the block's rows of the matrix's.
struct HandSplit {
  std::vector<ParamSpec> specs;                   // every block of every matrix, in order
  std::vector<std::pair<size_t, MatrixBlock>> of;  // per block parameter: (its matrix, where in it)
  std::vector<MuonRule> rules;                     // each block parameter's options, without the split
};
HandSplit split_by_hand(const std::vector<ParamSpec>& specs, const std::vector<MuonRule>& rules,
                        const MuonMatrixOptions& defaults) {
  HandSplit h;
  for (size_t p = 0; p < specs.size(); ++p) {
    MuonMatrixOptions o = defaults;
    for (const MuonRule& r : rules)
      if (name_matches(r.pattern, specs[p].name)) {
        o = r.options;
        break;
      }
    const std::vector<MatrixBlock> blocks = muon_blocks(specs[p].rows(), specs[p].cols(), o, specs[p].name);
    o.split_heads = 0, o.split_sizes.clear(), o.split_dim = 0;
    for (size_t b = 0; b < blocks.size(); ++b) {
      const std::string name = specs[p].name + "#" + std::to_string(b);
      h.specs.push_back({name, {blocks[b].rows, blocks[b].cols}, ParamRole::matrix, 0});
      h.of.push_back({p, blocks[b]});
      h.rules.push_back({name, o});
    }
  }
  return h;
}

// values (the block parameter's, blk.rows×blk.cols) ↔ its block of `matrix` (cols columns).
void copy_block(std::vector<float>& block, std::vector<float>& matrix, int64_t cols, const MatrixBlock& blk,
                bool into_block) {
  for (int64_t r = 0; r < blk.rows; ++r)
    for (int64_t c = 0; c < blk.cols; ++c) {
      float& in_matrix = matrix[(blk.row0 + r) * cols + blk.col0 + c];
      float& in_block = block[r * blk.cols + c];
      (into_block ? in_block : in_matrix) = into_block ? in_matrix : in_block;
    }
}

// Split Newton–Schulz gives every matrix, bit for bit, what the same optimizer gives its blocks as parameters of their
// own (split_by_hand): q by 4 heads of rows, o by 4 heads of columns (its o.cols blocks gathered for the
// Newton–Schulz), a fused qkv by rows of sizes 4+2+2 and a gate by columns of sizes 3+4 (other shapes: other
// scales, spectral's √(rows/cols); the gate's per row), a NorMuon matrix by 2 heads of rows (v per block's rows) and
// one by 2 heads of columns (a v of its own per block and row, block-major: (2, rows)).
// Weights, momentum and NorMuon's v after 3 steps with weight decay. The blocks batch with the matrices and blocks of
// their shape (q's four 2×6 heads and qkv's k and v with the 2×6 matrix h, in one call), and a split matrix is refused where its split
// does not fit, naming it.
TEST(Optimizer, SplitNewtonSchulzEqualsTheBlocksAsParametersBitForBit) {
  const std::vector<ParamSpec> specs = {{"a.q", {8, 6}, ParamRole::matrix, 0},   {"a.o", {6, 8}, ParamRole::matrix, 0},
                                        {"a.qkv", {8, 6}, ParamRole::matrix, 0}, {"a.gate", {6, 7}, ParamRole::matrix, 0},
                                        {"a.n", {8, 6}, ParamRole::matrix, 0},   {"a.h", {2, 6}, ParamRole::matrix, 0},
                                        {"a.m", {6, 8}, ParamRole::matrix, 0}};
  OptimizerOptions opt;
  opt.muon.lr = 0.02, opt.muon.momentum = 0.9, opt.muon.weight_decay = 0.1;
  MuonMatrixOptions heads = opt.muon, columns = opt.muon, fused = opt.muon, gate = opt.muon, normuon = opt.muon,
                    normuon_columns = opt.muon;
  heads.split_heads = 4;
  columns.split_heads = 4, columns.split_dim = 1;
  fused.split_sizes = {4, 2, 2}, fused.scale = MuonScale::spectral;
  gate.split_sizes = {3, 4}, gate.split_dim = 1, gate.scale = MuonScale::spectral, gate.cautious_wd = true;
  normuon.split_heads = 2, normuon.variant = MuonVariant::normuon, normuon.normuon_beta2 = 0.9;
  normuon_columns = normuon, normuon_columns.split_dim = 1;
  opt.muon_rules = {{"a.q", heads},     {"a.o", columns}, {"a.qkv", fused},
                    {"a.gate", gate},   {"a.n", normuon}, {"a.m", normuon_columns}};
  test::ToyModel split(specs, 11);
  std::vector<std::vector<std::string>> calls;
  Optimizer with_split(split.refs(), opt, call_recording_orthogonalizer(calls));

  const HandSplit hand = split_by_hand(specs, opt.muon_rules, opt.muon);
  OptimizerOptions by_hand = opt;
  by_hand.muon_rules = hand.rules;
  test::ToyModel blocks(hand.specs, 1);
  for (size_t b = 0; b < hand.specs.size(); ++b) {
    const auto& [p, blk] = hand.of[b];
    copy_block(blocks.values[b], split.values[p], specs[p].cols(), blk, true);
  }
  Muon reference(blocks.refs(), by_hand);
  for (int t = 0; t < 3; ++t) {
    split.set_grads(t);
    for (size_t b = 0; b < hand.specs.size(); ++b) {
      const auto& [p, blk] = hand.of[b];
      copy_block(blocks.grads[b], split.grads[p], specs[p].cols(), blk, true);
    }
    ASSERT_TRUE(with_split.step() && reference.step());
  }
  const auto state = state_of(with_split), ref_state = state_of(reference);
  for (size_t p = 0; p < specs.size(); ++p) {
    std::vector<float> want = split.values[p], momentum = state.at(specs[p].name + " muon.momentum");
    std::vector<float> want_momentum = momentum;
    for (size_t b = 0; b < hand.specs.size(); ++b) {
      if (hand.of[b].first != p) continue;
      std::vector<float> block_values = blocks.values[b];
      copy_block(block_values, want, specs[p].cols(), hand.of[b].second, false);
      std::vector<float> block_momentum = ref_state.at(hand.specs[b].name + " muon.momentum");
      copy_block(block_momentum, want_momentum, specs[p].cols(), hand.of[b].second, false);
    }
    EXPECT_EQ(split.values[p], want) << specs[p].name;
    EXPECT_EQ(momentum, want_momentum) << specs[p].name << " muon.momentum";
  }
  for (const char* name : {"a.n", "a.m"}) {  // a.n: rows 0-3, then 4-7; a.m: block 0's rows, then block 1's
    const std::string matrix(name);
    const std::vector<float> v = state.at(matrix + " normuon.v");
    std::vector<float> want_v = ref_state.at(matrix + "#0 normuon.v");
    for (float x : ref_state.at(matrix + "#1 normuon.v")) want_v.push_back(x);
    EXPECT_EQ(v, want_v) << matrix;
  }
  EXPECT_NE(split.values[0], test::ToyModel(specs, 11).values[0]) << "the step changed nothing";

  ASSERT_FALSE(calls.empty());
  const std::vector<std::string> two_by_six = {"a.q:rows 0+2",   "a.q:rows 2+2",   "a.q:rows 4+2", "a.q:rows 6+2",
                                               "a.qkv:rows 4+2", "a.qkv:rows 6+2", "a.h"};
  EXPECT_EQ(std::count(calls.begin(), calls.end(), two_by_six), 3) << "the 2×6 blocks and h: one call per step";

  const auto refused = [&](MuonMatrixOptions o, const std::string& want) {
    OptimizerOptions bad = opt;
    bad.muon_rules = {{"a.*", o}};
    try {
      Optimizer optimizer(split.refs(), bad, test::reference_orthogonalizer());
      ADD_FAILURE() << "no error, wanted one with: " << want;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  MuonMatrixOptions o = opt.muon;
  o.split_heads = 3;
  refused(o, "Muon matrix 'a.q' (8x6) has 8 rows, not a multiple of split-heads=3");
  o.split_heads = 0, o.split_sizes = {4, 2, 3};
  refused(o, "Muon matrix 'a.q' (8x6) has 8 rows, but split-sizes 4+2+3 sum to 9");
  o.split_sizes = {2, 4}, o.split_dim = 1;
  refused(o, "Muon matrix 'a.o' (6x8) has 8 columns, but split-sizes 2+4 sum to 6");
}

TEST(Optimizer, MuonBlocksOfAModelForThePlanner) {
  const std::vector<ParamSpec> specs = {{"q", {8, 6}, ParamRole::matrix, 0}, {"b", {6}, ParamRole::elementwise, 0},
                                        {"o", {6, 8}, ParamRole::matrix, 0}};
  OptimizerOptions opt;
  MuonMatrixOptions columns = opt.muon;
  columns.split_sizes = {3, 5}, columns.split_dim = 1;
  opt.muon_rules = {{"o", columns}};
  const std::vector<std::vector<MatrixBlock>> want = {{{0, 0, 8, 6}}, {}, {{0, 0, 6, 3}, {0, 3, 6, 5}}};
  EXPECT_EQ(muon_blocks(specs, opt), want);
  opt.rules = {{"o", OptimGroup::adamw}};
  EXPECT_EQ(muon_blocks(specs, opt)[2], std::vector<MatrixBlock>{}) << "o is AdamW's";
}

// Rules that cannot apply are refused at construction, naming the pattern or the parameter.
TEST(Optimizer, MuonRulesThatCannotApplyAreRefused) {
  Model model(1);
  const auto refused = [&](const OptimizerOptions& opt, const std::string& want) {
    try {
      Optimizer o(model.refs(), opt, test::reference_orthogonalizer());
      ADD_FAILURE() << "no error, wanted one with: " << want;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  OptimizerOptions opt;
  opt.rules = {{"embed.*", OptimGroup::adamw}};
  opt.muon_rules = {{"embed.*", opt.muon}};  // AdamW's parameter only
  refused(opt, "Muon rule 'embed.*' matches no Muon matrix");
  opt.muon_rules = {{"layers.*", opt.muon}, {"layers.0.w", opt.muon}};  // the first takes every matrix
  refused(opt, "Muon rule 'layers.0.w' matches no Muon matrix");
  MuonMatrixOptions bad = opt.muon;
  bad.normuon_beta2 = 1.0;
  opt.muon_rules = {{"layers.*", bad}};
  refused(opt, "parameter 'layers.0.w': normuon_beta2 must be in [0, 1), got 1");
  opt.muon_rules = {};
  opt.muon.extra_scale_factor = 0;
  refused(opt, "OptimizerOptions.muon: extra_scale_factor must be finite and > 0");
}

TEST(MuonRules, ParseReadsEveryKeyAndRoundTrips) {
  MuonMatrixOptions defaults;
  defaults.ns.steps = 5;
  const MuonRule rule = parse_muon_rule(
      "re:blocks\\.[0-9]+\\.attn:.*:ns-steps=6,coeffs=polar-express,algo=gram,scale=spectral,extra-scale=1.5,"
      "cautious-wd=on,variant=normuon,normuon-beta2=0.9,split-sizes=896+128+128,split-dim=1",
      defaults);
  EXPECT_EQ(rule.pattern, "re:blocks\\.[0-9]+\\.attn:.*");  // everything before the last ':'
  const MuonMatrixOptions& o = rule.options;
  EXPECT_EQ(o.ns.steps, 6);
  EXPECT_EQ(o.ns.coeffs, NsCoeffs::polar_express);
  EXPECT_EQ(o.ns.algo, NsAlgo::gram);
  EXPECT_EQ(o.scale, MuonScale::spectral);
  EXPECT_EQ(o.extra_scale_factor, 1.5);
  EXPECT_TRUE(o.cautious_wd);
  EXPECT_EQ(o.variant, MuonVariant::normuon);
  EXPECT_EQ(o.normuon_beta2, 0.9);
  EXPECT_EQ(o.split_sizes, (std::vector<int64_t>{896, 128, 128}));
  EXPECT_EQ(o.split_dim, 1);
  EXPECT_EQ(parse_muon_rule("attn.*:split-heads=14", defaults).options.split_heads, 14);
  EXPECT_EQ(to_string(parse_muon_rule("o:split-heads=14,split-dim=1", defaults), defaults), "o:split-heads=14,split-dim=1");
  const MuonRule again = parse_muon_rule(to_string(rule, defaults), defaults);
  EXPECT_EQ(again.pattern, rule.pattern);
  EXPECT_EQ(again.options, rule.options);
  EXPECT_EQ(to_string(parse_muon_rule("mlp.*:variant=normuon", defaults), defaults), "mlp.*:variant=normuon");
  EXPECT_EQ(parse_muon_rule("x:scale=unit_rms", defaults).options.ns, defaults.ns);  // the rest: the defaults
  for (const auto& [text, want] : std::vector<std::pair<std::string, std::string>>{
           {"attn.*:ns-stepz=6", "Muon rule 'attn.*:ns-stepz=6' (pattern 'attn.*'): unknown option 'ns-stepz'"},
           {"attn.*:ns-steps=0", "(pattern 'attn.*'): ns-steps must be ≥ 1, got 0"},
           {"attn.*:ns-steps=six", "ns-steps=six is not a number"},
           {"attn.*:variant=adam", "unknown Muon variant 'adam' (valid: muon, normuon)"},
           {"attn.*:scale=rms", "unknown Muon scale 'rms'"},
           {"attn.*:normuon-beta2=1", "normuon-beta2 must be in [0, 1), got 1"},
           {"attn.*:cautious-wd=yes", "cautious-wd takes on or off"},
           {"attn.*:ns-steps", "'ns-steps' is not key=value"},
           {"attn.*", "Muon rule 'attn.*' is not PATTERN:key=value"},
           {":variant=normuon", "is not PATTERN:key=value"},
           {"attn.*:split-heads=-1", "split-heads must be ≥ 1 (0: no split), got -1"},
           {"attn.*:split-sizes=896", "split-sizes needs two or more lengths joined by '+', got 896"},
           {"attn.*:split-sizes=896+0", "split-sizes must be lengths ≥ 1, got 896+0"},
           {"attn.*:split-dim=2", "split-dim takes 0 (rows) or 1 (columns), got '2'"},
           {"attn.*:split-heads=2,split-sizes=1+1", "split-heads and split-sizes are two ways of one split"}}) {
    try {
      parse_muon_rule(text, defaults);
      ADD_FAILURE() << text << " parsed";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  }
}

TEST(MuonScales, EachKindsDefinition) {
  EXPECT_DOUBLE_EQ(muon_scale(12, 3, MuonScale::original), 2.0);
  EXPECT_DOUBLE_EQ(muon_scale(3, 12, MuonScale::original), 1.0);
  EXPECT_DOUBLE_EQ(muon_scale(3, 12, MuonScale::match_rms_adamw), 0.2 * std::sqrt(12.0));
  EXPECT_DOUBLE_EQ(muon_scale(3, 12, MuonScale::spectral), 0.5);
  EXPECT_DOUBLE_EQ(muon_scale(3, 12, MuonScale::unit_rms), std::sqrt(12.0));
  for (MuonScale k : {MuonScale::original, MuonScale::match_rms_adamw, MuonScale::spectral, MuonScale::unit_rms})
    EXPECT_EQ(parse_muon_scale(to_string(k)), k);
}

}  // namespace
}  // namespace dmuon
