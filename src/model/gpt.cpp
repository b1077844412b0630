// The GPT example's forward and backward, unit by unit, over parameters bound by the caller.
#include "dmuon/gpt.hpp"

#include <algorithm>

#include "dmuon/error.hpp"
#include "model/gpt_layers.hpp"

namespace dmuon {

using namespace model;

// Offsets of a block's parameters from its first index, in gpt_param_specs order.
namespace {
enum BlockParam : int {
  kLn1W,
  kLn1B,
  kQkvW,
  kQkvB,
  kProjW,
  kProjB,
  kLn2W,
  kLn2B,
  kFcW,
  kFcB,
  kFcProjW,
  kFcProjB,
  kBlockParams
};
}  // namespace

// One block's activations, all kept for backward. N = B·T.
struct Gpt::Layer {
  std::vector<float> input;                    // (N,C) the residual stream entering the block
  std::vector<float> ln1, ln1_mean, ln1_rstd;  // (N,C), (N), (N)
  std::vector<float> qkv;                      // (N,3C)
  std::vector<float> att;                      // (B,NH,T,T) softmax probabilities
  std::vector<float> atty;                     // (N,C) attention output before the projection
  std::vector<float> residual2;                // (N,C) input + attention branch
  std::vector<float> ln2, ln2_mean, ln2_rstd;
  std::vector<float> fch, fch_gelu;  // (N,4C)
};

Gpt::Gpt(const GptConfig& config) : config_(config), specs_(gpt_param_specs(config)) {
  unit_params_.resize(num_units());
  for (int i = 0; i < static_cast<int>(specs_.size()); i++) unit_params_[specs_[i].unit].push_back(i);
  values_.assign(specs_.size(), nullptr);
  grads_.assign(specs_.size(), nullptr);
  const int after_blocks = block_first_ + kBlockParams * static_cast<int>(config_.layers);
  lnf_w_ = after_blocks;
  lnf_b_ = after_blocks + 1;
  head_ = after_blocks + 2;
  layers_.resize(config_.layers);
}

Gpt::~Gpt() = default;

const std::vector<int>& Gpt::unit_params(int unit) const {
  DMUON_CHECK(unit >= 0 && unit < num_units(), "GPT unit ", unit, " out of range [0, ", num_units(), ")");
  return unit_params_[unit];
}

void Gpt::bind(int index, const float* value, float* grad) {
  DMUON_CHECK(index >= 0 && index < static_cast<int>(specs_.size()), "GPT parameter index ", index,
              " out of range [0, ", specs_.size(), ")");
  values_[index] = value;
  grads_[index] = grad;
}

const float* Gpt::value(int index) const { return values_[index]; }
float* Gpt::grad(int index) const { return grads_[index]; }

void Gpt::check_bound(int unit, bool need_grads) const {
  for (int i : unit_params_[unit]) {
    DMUON_CHECK(values_[i] != nullptr, "GPT parameter ", specs_[i].name, " (unit ", unit, ") has no bound value");
    DMUON_CHECK(!need_grads || grads_[i] != nullptr, "GPT parameter ", specs_[i].name, " (unit ", unit,
                ") has no bound gradient");
  }
}

void Gpt::set_batch(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T, float loss_scale) {
  DMUON_CHECK(B >= 1, "GPT batch size must be at least 1, got ", B);
  DMUON_CHECK(T >= 1 && T <= config_.context, "GPT sequence length ", T, " outside [1, context=", config_.context, "]");
  inputs_.assign(inputs, inputs + B * T);
  targets_.assign(targets, targets + B * T);
  for (int64_t i = 0; i < B * T; i++) {
    DMUON_CHECK(inputs_[i] >= 0 && inputs_[i] < config_.vocab, "GPT input token ", inputs_[i], " at position ", i,
                " outside the vocabulary [0, ", config_.vocab, ")");
    DMUON_CHECK(targets_[i] >= 0 && targets_[i] < config_.vocab, "GPT target token ", targets_[i], " at position ", i,
                " outside the vocabulary [0, ", config_.vocab, ")");
  }
  if (B != B_ || T != T_) {
    B_ = B;
    T_ = T;
    resize_activations();
  }
  loss_scale_ = loss_scale;
  next_forward_ = 0;
  next_backward_ = -1;
}

void Gpt::resize_activations() {
  const int64_t N = B_ * T_, C = config_.width, V = config_.vocab, NH = config_.heads;
  final_residual_.resize(N * C);
  for (Layer& a : layers_) {
    a.input.resize(N * C);
    a.ln1.resize(N * C);
    a.ln1_mean.resize(N);
    a.ln1_rstd.resize(N);
    a.qkv.resize(N * 3 * C);
    a.att.resize(B_ * NH * T_ * T_);
    a.atty.resize(N * C);
    a.residual2.resize(N * C);
    a.ln2.resize(N * C);
    a.ln2_mean.resize(N);
    a.ln2_rstd.resize(N);
    a.fch.resize(N * 4 * C);
    a.fch_gelu.resize(N * 4 * C);
  }
  lnf_.resize(N * C);
  lnf_mean_.resize(N);
  lnf_rstd_.resize(N);
  logits_.resize(N * V);
  probs_.resize(N * V);
  losses_.resize(N);
  dresidual_.resize(N * C);
  dln_.resize(N * C);
  dqkv_.resize(N * 3 * C);
  datty_.resize(N * C);
  dfch_gelu_.resize(N * 4 * C);
  dfch_.resize(N * 4 * C);
  datt_scratch_.resize(T_ * T_);
  dlogits_.resize(N * V);
}

void Gpt::forward_unit(int unit) {
  DMUON_CHECK(B_ > 0, "GPT forward_unit(", unit, ") before set_batch");
  DMUON_CHECK(unit == next_forward_, "GPT forward_unit(", unit, ") out of order: expected unit ", next_forward_);
  check_bound(unit, false);
  const int L = static_cast<int>(config_.layers);
  if (unit == 0) {
    // The embeddings are the first block's input.
    encoder_forward(layers_[0].input.data(), inputs_.data(), value(wte_), value(wpe_), B_, T_, config_.width);
  } else if (unit <= L) {
    forward_block(unit - 1);
  } else {
    forward_head();
  }
  next_forward_++;
  if (next_forward_ == num_units()) next_backward_ = num_units() - 1;
}

// Block l reads layers_[l].input and writes its output into layers_[l+1].input (final_residual_ for the last).
void Gpt::forward_block(int l) {
  const int64_t N = B_ * T_, C = config_.width, NH = config_.heads;
  const int p = block_first_ + kBlockParams * l;
  Layer& a = layers_[l];
  float* out = l + 1 < config_.layers ? layers_[l + 1].input.data() : final_residual_.data();  // (N,C)
  layernorm_forward(a.ln1.data(), a.ln1_mean.data(), a.ln1_rstd.data(), a.input.data(), value(p + kLn1W),
                    value(p + kLn1B), N, C);
  matmul_forward(a.qkv.data(), a.ln1.data(), value(p + kQkvW), value(p + kQkvB), N, C, 3 * C);
  attention_forward(a.atty.data(), a.att.data(), a.qkv.data(), B_, T_, C, NH);
  matmul_forward(a.residual2.data(), a.atty.data(), value(p + kProjW), value(p + kProjB), N, C, C);
  residual_add(a.residual2.data(), a.input.data(), N * C);
  layernorm_forward(a.ln2.data(), a.ln2_mean.data(), a.ln2_rstd.data(), a.residual2.data(), value(p + kLn2W),
                    value(p + kLn2B), N, C);
  matmul_forward(a.fch.data(), a.ln2.data(), value(p + kFcW), value(p + kFcB), N, C, 4 * C);
  gelu_forward(a.fch_gelu.data(), a.fch.data(), N * 4 * C);
  matmul_forward(out, a.fch_gelu.data(), value(p + kFcProjW), value(p + kFcProjB), N, 4 * C, C);
  residual_add(out, a.residual2.data(), N * C);
}

void Gpt::forward_head() {
  const int64_t N = B_ * T_, C = config_.width, V = config_.vocab;
  layernorm_forward(lnf_.data(), lnf_mean_.data(), lnf_rstd_.data(), final_residual_.data(), value(lnf_w_),
                    value(lnf_b_), N, C);
  matmul_forward(logits_.data(), lnf_.data(), value(head_), nullptr, N, C, V);  // (N,V)
  loss_ = static_cast<float>(
      softmax_crossentropy_forward(losses_.data(), probs_.data(), logits_.data(), targets_.data(), N, V));
}

float Gpt::loss() const {
  DMUON_CHECK(next_forward_ == num_units(), "GPT loss() before the forward of the last unit");
  return loss_;
}

void Gpt::backward_unit(int unit) {
  DMUON_CHECK(next_backward_ >= 0, "GPT backward_unit(", unit, ") before the whole forward ran");
  DMUON_CHECK(unit == next_backward_, "GPT backward_unit(", unit, ") out of order: expected unit ", next_backward_);
  check_bound(unit, true);
  const int L = static_cast<int>(config_.layers);
  if (unit == L + 1) {
    backward_head();
  } else if (unit >= 1) {
    backward_block(unit - 1);
  } else {
    encoder_backward(grad(wte_), grad(wpe_), dresidual_.data(), inputs_.data(), B_, T_, config_.width);
  }
  next_backward_--;
}

// Leaves the gradient of the last block's output in dresidual_.
void Gpt::backward_head() {
  const int64_t N = B_ * T_, C = config_.width, V = config_.vocab;
  std::fill(dlogits_.begin(), dlogits_.end(), 0.0f);
  std::fill(dln_.begin(), dln_.end(), 0.0f);
  std::fill(dresidual_.begin(), dresidual_.end(), 0.0f);
  softmax_crossentropy_backward(dlogits_.data(), probs_.data(), targets_.data(), loss_scale_, N, V);
  matmul_backward(dln_.data(), grad(head_), nullptr, dlogits_.data(), lnf_.data(), value(head_), N, C, V);
  layernorm_backward(dresidual_.data(), grad(lnf_w_), grad(lnf_b_), dln_.data(), final_residual_.data(), value(lnf_w_),
                     lnf_mean_.data(), lnf_rstd_.data(), N, C);
}

// On entry dresidual_ holds the gradient of block l's output; on exit, that of its input. Each residual
// connection passes the gradient through unchanged, so dresidual_ is updated in place.
void Gpt::backward_block(int l) {
  const int64_t N = B_ * T_, C = config_.width, NH = config_.heads;
  const int p = block_first_ + kBlockParams * l;
  Layer& a = layers_[l];
  std::fill(dfch_gelu_.begin(), dfch_gelu_.end(), 0.0f);
  std::fill(dfch_.begin(), dfch_.end(), 0.0f);
  std::fill(dln_.begin(), dln_.end(), 0.0f);
  std::fill(datty_.begin(), datty_.end(), 0.0f);
  std::fill(dqkv_.begin(), dqkv_.end(), 0.0f);
  // MLP branch: dresidual_ is d(output); the branch input is residual2.
  matmul_backward(dfch_gelu_.data(), grad(p + kFcProjW), grad(p + kFcProjB), dresidual_.data(), a.fch_gelu.data(),
                  value(p + kFcProjW), N, 4 * C, C);
  gelu_backward(dfch_.data(), a.fch.data(), dfch_gelu_.data(), N * 4 * C);
  matmul_backward(dln_.data(), grad(p + kFcW), grad(p + kFcB), dfch_.data(), a.ln2.data(), value(p + kFcW), N, C,
                  4 * C);
  layernorm_backward(dresidual_.data(), grad(p + kLn2W), grad(p + kLn2B), dln_.data(), a.residual2.data(),
                     value(p + kLn2W), a.ln2_mean.data(), a.ln2_rstd.data(), N, C);
  // Attention branch: dresidual_ is now d(residual2).
  matmul_backward(datty_.data(), grad(p + kProjW), grad(p + kProjB), dresidual_.data(), a.atty.data(),
                  value(p + kProjW), N, C, C);
  attention_backward(dqkv_.data(), datt_scratch_.data(), datty_.data(), a.qkv.data(), a.att.data(), B_, T_, C, NH);
  std::fill(dln_.begin(), dln_.end(), 0.0f);
  matmul_backward(dln_.data(), grad(p + kQkvW), grad(p + kQkvB), dqkv_.data(), a.ln1.data(), value(p + kQkvW), N, C,
                  3 * C);
  layernorm_backward(dresidual_.data(), grad(p + kLn1W), grad(p + kLn1B), dln_.data(), a.input.data(), value(p + kLn1W),
                     a.ln1_mean.data(), a.ln1_rstd.data(), N, C);
}

float Gpt::forward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T, float loss_scale) {
  set_batch(inputs, targets, B, T, loss_scale);
  for (int u = 0; u < num_units(); u++) forward_unit(u);
  return loss_;
}

void Gpt::backward() {
  for (int u = num_units() - 1; u >= 0; u--) backward_unit(u);
}

}  // namespace dmuon
