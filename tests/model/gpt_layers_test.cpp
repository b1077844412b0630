// Finite-difference checks of every GPT layer's backward (src/model/gpt_layers.cpp).
#include "model/gpt_layers.hpp"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "gpt_gradcheck.hpp"
#include "model/random.hpp"

namespace dmuon::model {
namespace {

using test::check_gradient;
using test::GradCheck;

std::vector<float> randn(int64_t n, uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(scale * rng.normal());
  return v;
}

// f = Σ w·out in double, and Σ |w·out| for the rounding allowance.
double project(const std::vector<float>& out, const std::vector<float>& w) {
  double s = 0;
  for (size_t i = 0; i < out.size(); i++) s += static_cast<double>(w[i]) * out[i];
  return s;
}
double project_abs(const std::vector<float>& out, const std::vector<float>& w) {
  double s = 0;
  for (size_t i = 0; i < out.size(); i++) s += std::fabs(static_cast<double>(w[i]) * out[i]);
  return s;
}

// Runs check_gradient for each (input, analytic gradient) pair and expects no failure.
struct Checked {
  const char* name;
  std::vector<float>* x;
  const std::vector<float>* grad;
};
void expect_gradients(const std::vector<Checked>& inputs, const std::function<double()>& f, GradCheck opt) {
  for (const Checked& c : inputs) {
    auto r = check_gradient(c.name, *c.x, *c.grad, f, opt);
    EXPECT_EQ(r.failures, 0) << c.name << ": worst |err|/tol " << r.worst_excess;
    EXPECT_GT(r.checked, 0);
  }
}

TEST(GptLayers, LayerNormBackward) {
  const int64_t N = 6, C = 16;
  auto x = randn(N * C, 1, 2.0), w = randn(C, 2), b = randn(C, 3), dout = randn(N * C, 4);
  std::vector<float> out(N * C), mean(N), rstd(N);
  auto f = [&] {
    layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    return project(out, dout);
  };
  f();
  std::vector<float> dx(N * C, 0.0f), dw(C, 0.0f), db(C, 0.0f);
  layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
  expect_gradients({{"dinp", &x, &dx}, {"dweight", &w, &dw}, {"dbias", &b, &db}}, f,
                   {.noise_scale = project_abs(out, dout), .reduction = C});
}

TEST(GptLayers, MatmulBackwardWithAndWithoutBias) {
  const int64_t N = 5, C = 12, OC = 7;
  for (bool with_bias : {true, false}) {
    auto x = randn(N * C, 5), w = randn(OC * C, 6), b = randn(OC, 7), dout = randn(N * OC, 8);
    std::vector<float> out(N * OC);
    auto f = [&] {
      matmul_forward(out.data(), x.data(), w.data(), with_bias ? b.data() : nullptr, N, C, OC);
      return project(out, dout);
    };
    f();
    std::vector<float> dx(N * C, 0.0f), dw(OC * C, 0.0f), db(OC, 0.0f);
    matmul_backward(dx.data(), dw.data(), with_bias ? db.data() : nullptr, dout.data(), x.data(), w.data(), N, C, OC);
    std::vector<Checked> checked = {{"dinp", &x, &dx}, {"dweight", &w, &dw}};
    if (with_bias) checked.push_back({"dbias", &b, &db});
    expect_gradients(checked, f, {.noise_scale = project_abs(out, dout), .reduction = C});
  }
}

TEST(GptLayers, AttentionBackward) {
  const int64_t B = 2, T = 5, C = 12, NH = 3;
  auto qkv = randn(B * T * 3 * C, 9), dout = randn(B * T * C, 10);
  std::vector<float> out(B * T * C), att(B * NH * T * T), scratch(T * T);
  auto f = [&] {
    attention_forward(out.data(), att.data(), qkv.data(), B, T, C, NH);
    return project(out, dout);
  };
  f();
  // Causality: the softmax rows put no weight on future positions.
  for (int64_t r = 0; r < B * NH; r++)
    for (int64_t t = 0; t < T; t++)
      for (int64_t j = t + 1; j < T; j++) EXPECT_EQ(att[(r * T + t) * T + j], 0.0f);
  std::vector<float> dqkv(qkv.size(), 0.0f);
  attention_backward(dqkv.data(), scratch.data(), dout.data(), qkv.data(), att.data(), B, T, C, NH);
  expect_gradients({{"dqkv", &qkv, &dqkv}}, f, {.noise_scale = project_abs(out, dout), .reduction = C / NH + T});
}

TEST(GptLayers, GeluBackward) {
  const int64_t N = 64;
  std::vector<float> x(N);
  for (int64_t i = 0; i < N; i++) x[i] = -4.0f + 8.0f * static_cast<float>(i) / (N - 1);  // its curved range
  auto dout = randn(N, 11);
  std::vector<float> out(N);
  auto f = [&] {
    gelu_forward(out.data(), x.data(), N);
    return project(out, dout);
  };
  f();
  std::vector<float> dx(N, 0.0f);
  gelu_backward(dx.data(), x.data(), dout.data(), N);
  expect_gradients({{"dinp", &x, &dx}}, f, {.noise_scale = project_abs(out, dout), .reduction = 4});
}

TEST(GptLayers, SoftmaxCrossEntropyBackward) {
  const int64_t N = 6, V = 11;
  const float loss_scale = 1.7f;
  auto logits = randn(N * V, 12, 2.0);
  std::vector<int32_t> targets = {0, 3, 10, 5, 5, 7};
  std::vector<float> losses(N), probs(N * V);
  auto f = [&] {
    return loss_scale * softmax_crossentropy_forward(losses.data(), probs.data(), logits.data(), targets.data(), N, V);
  };
  const double loss = f();
  // From the logits in float64: the mean loss is the mean over rows of log Σ_v e^{logit_v} − logit_target,
  // and probs are the softmax.
  double ref = 0;
  for (int64_t i = 0; i < N; i++) {
    double z = 0;
    for (int64_t v = 0; v < V; v++) z += std::exp(static_cast<double>(logits[i * V + v]));
    ref += std::log(z) - logits[i * V + targets[i]];
    for (int64_t v = 0; v < V; v++) EXPECT_NEAR(probs[i * V + v], std::exp(logits[i * V + v]) / z, 1e-6) << i << ", " << v;
  }
  EXPECT_NEAR(loss / loss_scale, ref / N, 1e-5);
  std::vector<float> dlogits(N * V, 0.0f);
  softmax_crossentropy_backward(dlogits.data(), probs.data(), targets.data(), loss_scale, N, V);
  expect_gradients({{"dlogits", &logits, &dlogits}}, f, {.noise_scale = std::fabs(loss), .reduction = V});
}

TEST(GptLayers, EncoderBackward) {
  const int64_t B = 2, T = 3, C = 4, V = 5;
  auto wte = randn(V * C, 13), wpe = randn(T * C, 14), dout = randn(B * T * C, 15);
  std::vector<int32_t> tokens = {1, 4, 1, 0, 1, 2};  // token 1 repeats: its gradient accumulates
  std::vector<float> out(B * T * C);
  auto f = [&] {
    encoder_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    return project(out, dout);
  };
  f();
  std::vector<float> dwte(V * C, 0.0f), dwpe(T * C, 0.0f);
  encoder_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C);
  expect_gradients({{"dwte", &wte, &dwte}, {"dwpe", &wpe, &dwpe}}, f,
                   {.noise_scale = project_abs(out, dout), .reduction = 2});
}

// The check must be able to fail: a gradient 3% off in one element is reported.
TEST(GptLayers, GradientCheckCatchesAWrongGradient) {
  const int64_t N = 4, C = 8, OC = 3;
  auto x = randn(N * C, 16), w = randn(OC * C, 17), dout = randn(N * OC, 18);
  std::vector<float> out(N * OC);
  auto f = [&] {
    matmul_forward(out.data(), x.data(), w.data(), nullptr, N, C, OC);
    return project(out, dout);
  };
  f();
  std::vector<float> dx(N * C, 0.0f), dw(OC * C, 0.0f);
  matmul_backward(dx.data(), dw.data(), nullptr, dout.data(), x.data(), w.data(), N, C, OC);
  dw[5] *= 1.03f;
  GradCheck opt{.noise_scale = project_abs(out, dout), .reduction = C};
  EXPECT_NONFATAL_FAILURE(check_gradient("dweight", w, dw, f, opt), "dweight[5]");
}

}  // namespace
}  // namespace dmuon::model
