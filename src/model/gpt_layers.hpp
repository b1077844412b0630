// The layers of the GPT example, forward and backward, over linalg::gemm (row-major float32).
// Shapes are in comments: B batch, T time, C channels, OC output channels, NH heads, V vocabulary,
// N = B·T rows. As in llm.c's train_gpt2.c, every backward ACCUMULATES (+=) into its input and
// parameter gradients, so the caller zeroes them first (or keeps them to accumulate micro-batches).
#pragma once

#include <cstdint>

namespace dmuon::model {

// out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:].  out is (B,T,C), tokens (B,T), wte (V,C), wpe (maxT,C).
void encoder_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,
                     int64_t C);
void encoder_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                      int64_t C);

// LayerNorm over the last dimension (eps 1e-5). out, inp are (N,C); mean, rstd (N); weight, bias (C).
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int64_t C);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C);

// out = inp·weightᵀ + bias, as torch.nn.Linear. out is (N,OC), inp (N,C), weight (OC,C), bias (OC) or null.
void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t C,
                    int64_t OC);
// dbias may be null when the layer has no bias.
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t C, int64_t OC);

// Causal multi-head self-attention. qkv is (B,T,3C) holding q, k, v side by side (each head hs = C/NH
// channels); out is (B,T,C); att (B,NH,T,T) keeps the softmax probabilities (zero above the diagonal).
void attention_forward(float* out, float* att, const float* qkv, int64_t B, int64_t T, int64_t C, int64_t NH);
// scratch is (T,T).
void attention_backward(float* dqkv, float* scratch, const float* dout, const float* qkv, const float* att, int64_t B,
                        int64_t T, int64_t C, int64_t NH);

// GELU, tanh approximation (GPT-2). out, inp, dinp, dout are (N).
void gelu_forward(float* out, const float* inp, int64_t N);
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t N);

// out (N) += inp (N): the residual connection.
void residual_add(float* out, const float* inp, int64_t N);

// Softmax and cross-entropy per row. logits, probs are (N,V); targets, losses (N). Returns the mean loss.
double softmax_crossentropy_forward(float* losses, float* probs, const float* logits, const int32_t* targets, int64_t N,
                                    int64_t V);
// Gradient of loss_scale · mean(losses): dlogits (N,V) += loss_scale/N · (probs − onehot(targets)).
void softmax_crossentropy_backward(float* dlogits, const float* probs, const int32_t* targets, float loss_scale,
                                   int64_t N, int64_t V);

}  // namespace dmuon::model
