// The GPT example's forward pass against a float64 reference written from GPT-2's formulas (not from
// src/model): token + position embeddings; per block x ← x + proj(attn(ln1(x))), x ← x + mlp(ln2(x)) with
// LayerNorm (biased variance, eps 1e-5), causal softmax attention with the 1/√head_size scale over
// q, k, v split from one qkv projection, and a GELU-tanh MLP; final LayerNorm, output head, and the mean
// cross-entropy. Every parameter gets random values (biases and LayerNorm weights too), so each term
// shows in the loss. The gradient checks (gpt_model_test, gpt_layers_test) prove backward matches
// forward; this proves forward is the model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "dmuon/gpt.hpp"

namespace dmuon {
namespace {

using Rows = std::vector<std::vector<double>>;  // (N, width) activations, one row per position

// Parameter `name` of the model as float64, and its shape.
struct Weights {
  const Gpt& model;
  GptBuffers& buffers;
  std::vector<double> operator()(const std::string& name) const {
    for (size_t i = 0; i < model.params().size(); ++i) {
      if (model.params()[i].name != name) continue;
      const float* v = buffers.value(static_cast<int>(i));
      return std::vector<double>(v, v + model.params()[i].numel());
    }
    ADD_FAILURE() << "no parameter " << name;
    return {};
  }
};

Rows layernorm(const Rows& x, const std::vector<double>& w, const std::vector<double>& b) {
  Rows out;
  for (const auto& row : x) {
    const double n = static_cast<double>(row.size());
    double mean = 0, var = 0;
    for (double v : row) mean += v / n;
    for (double v : row) var += (v - mean) * (v - mean) / n;
    std::vector<double> y(row.size());
    for (size_t i = 0; i < row.size(); ++i) y[i] = (row[i] - mean) / std::sqrt(var + 1e-5) * w[i] + b[i];
    out.push_back(y);
  }
  return out;
}

// y = x·Wᵀ + b, W (out, in) as torch.nn.Linear.
Rows linear(const Rows& x, const std::vector<double>& w, const std::vector<double>& b) {
  const size_t out_dim = b.size();
  Rows out;
  for (const auto& row : x) {
    std::vector<double> y(out_dim);
    for (size_t o = 0; o < out_dim; ++o) {
      y[o] = b[o];
      for (size_t i = 0; i < row.size(); ++i) y[o] += w[o * row.size() + i] * row[i];
    }
    out.push_back(y);
  }
  return out;
}

Rows add(Rows a, const Rows& b) {
  for (size_t n = 0; n < a.size(); ++n)
    for (size_t i = 0; i < a[n].size(); ++i) a[n][i] += b[n][i];
  return a;
}

// 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
Rows gelu(Rows x) {
  for (auto& row : x)
    for (double& v : row) v = 0.5 * v * (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (v + 0.044715 * v * v * v)));
  return x;
}

// Causal self-attention of one sequence of T rows of qkv (3C: q, then k, then v, each split into `heads`
// consecutive slices of C/heads): each position attends to itself and the positions before it.
Rows attention(const Rows& qkv, int64_t heads) {
  const size_t T = qkv.size(), C = qkv[0].size() / 3, hs = C / heads;
  Rows y(T, std::vector<double>(C, 0.0));
  for (size_t h = 0; h < static_cast<size_t>(heads); ++h) {
    for (size_t t = 0; t < T; ++t) {
      std::vector<double> score(t + 1);
      double top = -INFINITY;
      for (size_t s = 0; s <= t; ++s) {
        double dot = 0;
        for (size_t i = 0; i < hs; ++i) dot += qkv[t][h * hs + i] * qkv[s][C + h * hs + i];
        score[s] = dot / std::sqrt(static_cast<double>(hs));
        top = std::max(top, score[s]);
      }
      double z = 0;
      for (double& e : score) z += (e = std::exp(e - top));
      for (size_t s = 0; s <= t; ++s)
        for (size_t i = 0; i < hs; ++i) y[t][h * hs + i] += score[s] / z * qkv[s][2 * C + h * hs + i];
    }
  }
  return y;
}

// The mean over the (B,T) positions of −log softmax(logits)[target].
double reference_loss(const Gpt& model, GptBuffers& buffers, const std::vector<int32_t>& inputs,
                      const std::vector<int32_t>& targets, int64_t B, int64_t T) {
  const GptConfig& c = model.config();
  const Weights w{model, buffers};
  const std::vector<double> wte = w("wte"), wpe = w("wpe");
  double total = 0;
  for (int64_t b = 0; b < B; ++b) {
    Rows x(T, std::vector<double>(c.width));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < c.width; ++i) x[t][i] = wte[inputs[b * T + t] * c.width + i] + wpe[t * c.width + i];
    for (int64_t l = 0; l < c.layers; ++l) {
      const std::string p = "blocks." + std::to_string(l) + ".";
      const Rows a = attention(linear(layernorm(x, w(p + "ln1.weight"), w(p + "ln1.bias")), w(p + "attn.qkv.weight"),
                                      w(p + "attn.qkv.bias")),
                               c.heads);
      x = add(x, linear(a, w(p + "attn.proj.weight"), w(p + "attn.proj.bias")));
      const Rows h = gelu(linear(layernorm(x, w(p + "ln2.weight"), w(p + "ln2.bias")), w(p + "mlp.fc.weight"),
                                 w(p + "mlp.fc.bias")));
      x = add(x, linear(h, w(p + "mlp.proj.weight"), w(p + "mlp.proj.bias")));
    }
    const Rows logits = linear(layernorm(x, w("ln_f.weight"), w("ln_f.bias")), w("head.weight"),
                               std::vector<double>(c.vocab, 0.0));
    for (int64_t t = 0; t < T; ++t) {
      double top = -INFINITY, z = 0;
      for (double v : logits[t]) top = std::max(top, v);
      for (double v : logits[t]) z += std::exp(v - top);
      total += top + std::log(z) - logits[t][targets[b * T + t]];
    }
  }
  return total / static_cast<double>(B * T);
}

TEST(GptForward, MatchesAFloat64ReferenceOfTheFormulas) {
  const GptConfig config{.vocab = 13, .context = 6, .layers = 2, .heads = 2, .width = 8};
  Gpt model(config);
  GptBuffers buffers(model);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal;
  for (size_t i = 0; i < model.params().size(); ++i) {
    const ParamSpec& spec = model.params()[i];
    // Weights of order 1/√fan-in keep activations O(1); LayerNorm weights near 1; biases visible.
    const bool ln = spec.name.find("ln") != std::string::npos;
    const bool bias = spec.name.size() > 5 && spec.name.compare(spec.name.size() - 5, 5, ".bias") == 0;
    const float scale = bias ? 0.3f : ln ? 0.3f : spec.shape.size() == 2 ? 1.0f / std::sqrt(float(spec.shape[1])) : 1;
    float* v = buffers.value(static_cast<int>(i));
    for (int64_t k = 0; k < spec.numel(); ++k) v[k] = (ln && !bias ? 1.0f : 0.0f) + scale * normal(rng);
  }
  buffers.bind_to(model);
  const int64_t B = 2, T = 5;
  std::vector<int32_t> inputs(B * T);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(config.vocab) - 1);
  for (auto& x : inputs) x = token(rng);
  // Random targets, then every position aiming at one token v in turn: the mean of −log p(v), for every v.
  std::vector<std::vector<int32_t>> target_sets(1, std::vector<int32_t>(B * T));
  for (auto& x : target_sets[0]) x = token(rng);
  for (int32_t v = 0; v < config.vocab; ++v) target_sets.emplace_back(B * T, v);
  for (const auto& targets : target_sets) {
    const double want = reference_loss(model, buffers, inputs, targets, B, T);
    const float got = model.forward(inputs.data(), targets.data(), B, T);
    // float32 forward: each of a few dozen roundings per value along a path of width 8 and depth 2 is
    // 6e-8 relative; 1e-5 of the loss leaves room for their sum and none for a wrong formula.
    EXPECT_NEAR(got, want, 1e-5 * std::max(1.0, std::abs(want))) << "targets start " << targets[0];
  }
}

}  // namespace
}  // namespace dmuon
