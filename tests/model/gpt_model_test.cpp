// The GPT example model: parameter list, whole-model gradients, unit-by-unit execution over rebound
// buffers, loss decrease, determinism and initialisation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "dmuon/error.hpp"
#include "dmuon/gpt.hpp"
#include "gpt_gradcheck.hpp"
#include "model/random.hpp"

namespace dmuon {
namespace {

GptConfig tiny_config() {
  return {.vocab = 256, .context = 8, .layers = 2, .heads = 2, .width = 8};
}

// (B,T) inputs and targets taken from a text: targets are the next bytes.
struct Tokens {
  std::vector<int32_t> inputs, targets;
};
Tokens text_tokens(const std::string& text, int64_t B, int64_t T) {
  Tokens t;
  for (int64_t b = 0; b < B; b++) {
    for (int64_t i = 0; i < T; i++) {
      t.inputs.push_back(static_cast<unsigned char>(text[(b * T + i) % text.size()]));
      t.targets.push_back(static_cast<unsigned char>(text[(b * T + i + 1) % text.size()]));
    }
  }
  return t;
}
const std::string kText = "the quick brown fox jumps over the lazy dog. the dog sleeps. ";

TEST(GptModel, ParamSpecsNameShapeRoleAndUnit) {
  GptConfig c{.vocab = 256, .context = 16, .layers = 3, .heads = 2, .width = 8};
  auto specs = gpt_param_specs(c);
  ASSERT_EQ(specs.size(), 2u + 12u * 3u + 3u);
  EXPECT_EQ(specs[0].name, "wte");
  EXPECT_EQ(specs[0].shape, (std::vector<int64_t>{256, 8}));
  EXPECT_EQ(specs[1].shape, (std::vector<int64_t>{16, 8}));
  int matrices = 0;
  for (const auto& s : specs) {
    const bool hidden =
        s.name.ends_with("qkv.weight") || s.name.ends_with("proj.weight") || s.name.ends_with("fc.weight");
    EXPECT_EQ(s.role, hidden ? ParamRole::matrix : ParamRole::elementwise) << s.name;
    matrices += hidden;
    if (s.name.rfind("blocks.", 0) == 0) {
      EXPECT_EQ(s.unit, std::stoi(s.name.substr(7)) + 1) << s.name;
    }
  }
  EXPECT_EQ(matrices, 4 * 3);
  EXPECT_EQ(specs[2 + 2].name, "blocks.0.attn.qkv.weight");
  EXPECT_EQ(specs[2 + 2].shape, (std::vector<int64_t>{24, 8}));
  EXPECT_EQ(specs.back().name, "head.weight");
  EXPECT_EQ(specs.back().unit, 4);
  c.heads = 3;
  EXPECT_THROW(gpt_param_specs(c), Error);
}

TEST(GptModel, ForwardFlopsCountEveryMatmulAndAttention) {
  const GptConfig c{.vocab = 256, .context = 4, .layers = 2, .heads = 2, .width = 8};
  // 2·T·(hidden matrices 2·12·C² + head V·C) + attention 2·L·2·T²·C
  EXPECT_EQ(gpt_forward_flops(c, 4), 2.0 * 4 * (2 * 12 * 64 + 256 * 8) + 2.0 * 2 * 2 * 16 * 8);
  double matrix_elems = 0;
  for (const auto& s : gpt_param_specs(c)) matrix_elems += s.role == ParamRole::matrix ? s.numel() : 0;
  EXPECT_EQ(matrix_elems, 2 * 12 * 64);
}

// Whole tiny model: every parameter tensor's gradient against central differences of the loss.
TEST(GptModel, GradientsMatchFiniteDifferences) {
  const GptConfig c = tiny_config();
  const int64_t B = 2, T = 6;
  Gpt model(c);
  GptBuffers buf(model);
  // Larger-than-GPT-2 random values so every path carries gradient well above float32 noise.
  model::Rng rng(7);
  for (size_t i = 0; i < model.params().size(); i++) {
    const ParamSpec& s = model.params()[i];
    const bool ln_weight = s.name.find("ln") != std::string::npos && s.name.ends_with(".weight");
    for (int64_t k = 0; k < s.numel(); k++)
      buf.value(i)[k] = static_cast<float>((ln_weight ? 1.0 : 0.0) + 0.3 * rng.normal());
  }
  buf.bind_to(model);
  Tokens tok = text_tokens(kText, B, T);
  // Sum over the (B,T) targets rather than the mean: gradients B·T times larger, same relative noise.
  const float scale = static_cast<float>(B * T);
  const double loss = model.forward(tok.inputs.data(), tok.targets.data(), B, T, scale) * scale;
  model.backward();
  auto f = [&] { return static_cast<double>(model.forward(tok.inputs.data(), tok.targets.data(), B, T)) * scale; };
  for (size_t i = 0; i < model.params().size(); i++) {
    const ParamSpec& s = model.params()[i];
    const int64_t off = buf.offsets[i];
    std::vector<float> x(buf.values.begin() + off, buf.values.begin() + off + s.numel());
    std::vector<float> g(buf.grads.begin() + off, buf.grads.begin() + off + s.numel());
    // f reads the model's bound buffer: perturb a copy and mirror it in.
    auto f_of_x = [&] {
      std::memcpy(buf.value(i), x.data(), sizeof(float) * x.size());
      return f();
    };
    // Rounding of the loss: each unit's float32 reductions (length ≤ 4C or V) feed the next.
    test::GradCheck opt{.noise_scale = std::fabs(loss) * model.num_units(), .reduction = c.vocab, .max_checks = 40};
    auto r = test::check_gradient(s.name, x, g, f_of_x, opt);
    std::memcpy(buf.value(i), x.data(), sizeof(float) * x.size());
    EXPECT_EQ(r.failures, 0) << s.name << ": worst |err|/tol " << r.worst_excess;
  }
}


// The sharded runtime's pattern: each unit's parameters are copied into a fresh buffer just before the
// unit runs (separately for forward and backward), and its gradients land in a fresh buffer. The loss
// and every gradient must equal the whole-model run bit for bit.
TEST(GptModel, UnitByUnitOverRebufferedParametersEqualsWholeModel) {
  const GptConfig c = tiny_config();
  const int64_t B = 3, T = 8;
  Gpt whole(c), units(c);
  GptBuffers ref(whole);
  ref.init(c, whole.params(), 42);
  ref.bind_to(whole);
  Tokens tok = text_tokens(kText, B, T);
  const float loss = whole.forward(tok.inputs.data(), tok.targets.data(), B, T);
  whole.backward();

  std::vector<std::vector<float>> gathered(units.num_units()), grads(units.num_units());
  auto gather = [&](int u) {  // a fresh full copy of unit u's parameters, bound to the model
    std::vector<float>& g = gathered[u];
    g.clear();
    for (int i : units.unit_params(u)) g.insert(g.end(), ref.value(i), ref.value(i) + units.params()[i].numel());
    grads[u].assign(g.size(), 0.0f);
    int64_t off = 0;
    for (int i : units.unit_params(u)) {
      units.bind(i, g.data() + off, grads[u].data() + off);
      off += units.params()[i].numel();
    }
  };
  units.set_batch(tok.inputs.data(), tok.targets.data(), B, T);
  for (int u = 0; u < units.num_units(); u++) {
    gather(u);
    units.forward_unit(u);
    gathered[u].assign(gathered[u].size(), NAN);  // "freed" after its forward (Z3)
  }
  EXPECT_EQ(units.loss(), loss);
  for (int u = units.num_units() - 1; u >= 0; u--) {
    gather(u);
    units.backward_unit(u);
    int64_t off = 0;
    for (int i : units.unit_params(u)) {
      const int64_t n = units.params()[i].numel();
      EXPECT_EQ(0, std::memcmp(grads[u].data() + off, ref.grad(i), sizeof(float) * n)) << units.params()[i].name;
      off += n;
    }
  }
}

TEST(GptModel, OutOfOrderOrUnboundUnitsAreErrors) {
  const GptConfig c = tiny_config();
  Gpt model(c);
  GptBuffers buf(model);
  buf.init(c, model.params(), 1);
  Tokens tok = text_tokens(kText, 1, 4);
  EXPECT_THROW(model.forward_unit(0), Error);  // before set_batch
  model.set_batch(tok.inputs.data(), tok.targets.data(), 1, 4);
  try {
    model.forward_unit(0);
    FAIL() << "unbound parameters accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("wte"), std::string::npos) << e.what();
  }
  buf.bind_to(model);
  EXPECT_THROW(model.forward_unit(1), Error);
  model.forward_unit(0);
  EXPECT_THROW(model.backward_unit(0), Error);  // forward incomplete
  EXPECT_THROW(model.loss(), Error);
  for (int u = 1; u < model.num_units(); u++) model.forward_unit(u);
  EXPECT_THROW(model.backward_unit(0), Error);  // backward starts at the last unit
  std::vector<int32_t> bad = {0, 1, 256, 3};
  EXPECT_THROW(model.set_batch(bad.data(), tok.targets.data(), 1, 4), Error);
  EXPECT_THROW(model.set_batch(tok.inputs.data(), tok.targets.data(), 1, 9), Error);  // T > context
}

// Two micro-batches with loss_scale 1/2 accumulate the gradient of the mean loss over both.
TEST(GptModel, MicroBatchesAccumulateToTheFullBatchGradient) {
  const GptConfig c = tiny_config();
  const int64_t T = 8;
  Gpt model(c);
  GptBuffers full(model), micro(model);
  full.init(c, model.params(), 3);
  micro.values = full.values;
  Tokens tok = text_tokens(kText, 2, T);
  full.bind_to(model);
  model.forward(tok.inputs.data(), tok.targets.data(), 2, T);
  model.backward();
  micro.bind_to(model);
  for (int m = 0; m < 2; m++) {
    model.forward(tok.inputs.data() + m * T, tok.targets.data() + m * T, 1, T, 0.5f);
    model.backward();
  }
  // Both sum the same per-token terms in a different order: float32 rounding of a sum of 16 terms.
  double max_ref = 0, max_diff = 0;
  for (size_t k = 0; k < full.grads.size(); k++) {
    max_ref = std::max(max_ref, static_cast<double>(std::fabs(full.grads[k])));
    max_diff = std::max(max_diff, static_cast<double>(std::fabs(full.grads[k] - micro.grads[k])));
  }
  EXPECT_GT(max_ref, 0.0);
  EXPECT_LE(max_diff, 16 * 0x1.0p-24 * max_ref * 8);
}

TEST(GptModel, LossFallsUnderPlainSgd) {
  const GptConfig c = tiny_config();
  const int64_t B = 4, T = 8;
  Gpt model(c);
  GptBuffers buf(model);
  buf.init(c, model.params(), 5);
  buf.bind_to(model);
  Tokens tok = text_tokens(kText, B, T);
  float first = 0, last = 0;
  for (int step = 0; step < 30; step++) {
    buf.zero_grads();
    last = model.forward(tok.inputs.data(), tok.targets.data(), B, T);
    if (step == 0) first = last;
    model.backward();
    for (size_t k = 0; k < buf.values.size(); k++) buf.values[k] -= 0.5f * buf.grads[k];
  }
  EXPECT_NEAR(first, std::log(256.0f), 0.1f);  // small init: near-uniform predictions
  EXPECT_LT(last, first - 1.5f) << "loss " << first << " -> " << last;
}

TEST(GptModel, SameSeedSameLossBitForBit) {
  const GptConfig c = tiny_config();
  auto run = [&](uint64_t seed) {
    Gpt model(c);
    GptBuffers buf(model);
    buf.init(c, model.params(), seed);
    buf.bind_to(model);
    Tokens tok = text_tokens(kText, 2, 8);
    float loss = 0;
    for (int step = 0; step < 3; step++) {
      buf.zero_grads();
      loss = model.forward(tok.inputs.data(), tok.targets.data(), 2, 8);
      model.backward();
      for (size_t k = 0; k < buf.values.size(); k++) buf.values[k] -= 0.1f * buf.grads[k];
    }
    return loss;
  };
  const float a = run(11), b = run(11);
  EXPECT_EQ(std::memcmp(&a, &b, sizeof a), 0);
  EXPECT_NE(run(11), run(12));
}

TEST(GptModel, InitialisationIsGpt2Style) {
  const GptConfig c{.vocab = 256, .context = 64, .layers = 4, .heads = 4, .width = 64};
  const auto specs = gpt_param_specs(c);
  auto stats = [&](const std::string& name, uint64_t seed) {
    for (const auto& s : specs) {
      if (s.name != name) continue;
      std::vector<float> v(s.numel());
      gpt_init_param(c, s, seed, v.data());
      double sum = 0, sq = 0;
      for (float x : v) {
        sum += x;
        sq += static_cast<double>(x) * x;
      }
      const double mean = sum / v.size();
      return std::pair<double, double>{mean, std::sqrt(sq / v.size() - mean * mean)};
    }
    ADD_FAILURE() << "no parameter " << name;
    return std::pair<double, double>{};
  };
  // Sample std of n normals has relative standard error 1/sqrt(2n); allow 5 of them.
  auto expect_std = [&](const std::string& name, double expected) {
    const auto [mean, sd] = stats(name, 9);
    int64_t n = 0;
    for (const auto& s : specs) n = s.name == name ? s.numel() : n;
    EXPECT_NEAR(sd, expected, 5 * expected / std::sqrt(2.0 * n)) << name;
    EXPECT_NEAR(mean, 0.0, 5 * expected / std::sqrt(1.0 * n)) << name;
  };
  expect_std("wte", 0.02);
  expect_std("blocks.1.attn.qkv.weight", 0.02);
  expect_std("blocks.1.mlp.fc.weight", 0.02);
  expect_std("blocks.2.attn.proj.weight", 0.02 / std::sqrt(8.0));
  expect_std("blocks.3.mlp.proj.weight", 0.02 / std::sqrt(8.0));
  EXPECT_EQ(stats("blocks.0.mlp.fc.bias", 9), (std::pair<double, double>{0.0, 0.0}));
  EXPECT_EQ(stats("ln_f.weight", 9).first, 1.0);
  EXPECT_EQ(stats("wte", 9), stats("wte", 9));
  EXPECT_NE(stats("wte", 9), stats("wte", 10));
  EXPECT_NE(stats("blocks.0.attn.qkv.weight", 9), stats("blocks.1.attn.qkv.weight", 9));
}

}  // namespace
}  // namespace dmuon
