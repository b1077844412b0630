// The GPT example model: a GPT-2-style byte-level decoder (token + position embeddings, pre-LayerNorm
// blocks with causal multi-head attention and a GELU MLP, final LayerNorm, output head), forward and
// backward on the CPU over linalg::gemm, in the manner of llm.c's train_gpt2.c.
//
// Built for sharded (FSDP-style) training: the model owns its activations but NOT its parameters.
// The caller binds, per parameter, a pointer to its values and one to its gradient, and may rebind
// them before every unit runs (the runtime gathers a unit's weights into a full buffer just before
// the unit's forward or backward, and reduce-scatters its gradients right after its backward).
//
// Units (ParamSpec::unit), run forward in order 0..L+1 and backward in order L+1..0:
//   0       token embedding "wte" (V,C) and position embedding "wpe" (maxT,C)
//   1..L    transformer block l = unit−1: "blocks.<l>.{ln1,attn.qkv,attn.proj,ln2,mlp.fc,mlp.proj}.*"
//   L+1     final LayerNorm "ln_f.*" and the output head "head.weight" (V,C), not tied to wte
//
// Roles: the 2-D hidden weights (attn.qkv, attn.proj, mlp.fc, mlp.proj) are `matrix` (Muon);
// embeddings, head, LayerNorm weights and biases and all biases are `elementwise` (AdamW).
// Weights are (out, in) as torch.nn.Linear. The loss is mean cross-entropy over the (B,T) targets.
//
// Threads: the matrix products use BLAS with linalg::threads() threads; the elementwise layers run on the
// calling thread. The model never changes the thread count: a multi-rank run sets linalg::set_threads(1).
// A Gpt object is not thread-safe. The model adds no nondeterminism of its own (fixed loop orders).
#pragma once

#include <cstdint>
#include <vector>

#include "dmuon/params.hpp"

namespace dmuon {

struct GptConfig {
  int64_t vocab = 256;   // V: bytes
  int64_t context = 64;  // maxT: longest sequence (rows of wpe)
  int64_t layers = 4;    // L
  int64_t heads = 4;     // NH; width must be divisible by it
  int64_t width = 128;   // C
};

// Throws dmuon::Error naming the field when a dimension is non-positive or width % heads != 0.
void validate(const GptConfig& config);

// Every parameter in unit order (see above). Names are stable: checkpoints and plans key on them.
std::vector<ParamSpec> gpt_param_specs(const GptConfig& config);

// GPT-2 initialisation of parameter `spec` (one of gpt_param_specs(config)) into `out` (numel floats):
// weights and embeddings normal(0, 0.02), residual projections (attn.proj, mlp.proj) normal(0, 0.02/sqrt(2L)),
// biases 0, LayerNorm weights 1. The values depend only on (seed, spec.name), not on other parameters.
void gpt_init_param(const GptConfig& config, const ParamSpec& spec, uint64_t seed, float* out);

// Forward flops of one sequence of T tokens: 2 per multiply-add of every matmul and of attention's full
// T×T products (q·kᵀ and att·v, computed whole and then masked). Backward costs about twice this.
double gpt_forward_flops(const GptConfig& config, int64_t T);

class Gpt {
 public:
  explicit Gpt(const GptConfig& config);
  ~Gpt();

  const GptConfig& config() const { return config_; }
  const std::vector<ParamSpec>& params() const { return specs_; }
  int num_units() const { return static_cast<int>(config_.layers) + 2; }
  // Indices into params() of the parameters that belong to `unit`.
  const std::vector<int>& unit_params(int unit) const;

  // Binds parameter `index` to `value` (numel floats, read) and `grad` (numel floats, accumulated into
  // by backward; may be null for forward-only use). Pointers stay until rebound.
  void bind(int index, const float* value, float* grad);

  // Starts a step on a batch: inputs and targets are (B,T) byte tokens (copied), 1 ≤ T ≤ context.
  // The units' gradients become gradients of loss_scale · mean loss (e.g. 1/micro-batches when the
  // caller accumulates micro-batches into the same gradient buffers).
  void set_batch(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T, float loss_scale = 1.0f);

  // Forward of one unit; units must run in order 0..L+1 after set_batch. The last one computes the loss.
  void forward_unit(int unit);
  // Mean cross-entropy of the batch; valid after forward_unit(L+1).
  float loss() const;
  // Backward of one unit, in order L+1..0 after the whole forward. ACCUMULATES into the bound gradients
  // of the unit's parameters: the caller zeroes them before the first micro-batch.
  void backward_unit(int unit);

  // Conveniences for tests and single-process use: all units in order.
  float forward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T, float loss_scale = 1.0f);
  void backward();

 private:
  struct Layer;  // one block's activations
  const float* value(int index) const;
  float* grad(int index) const;
  void check_bound(int unit, bool need_grads) const;
  void resize_activations();
  void forward_block(int l);
  void backward_block(int l);
  void forward_head();
  void backward_head();

  GptConfig config_;
  std::vector<ParamSpec> specs_;
  std::vector<std::vector<int>> unit_params_;
  std::vector<const float*> values_;
  std::vector<float*> grads_;
  int wte_ = 0, wpe_ = 1, lnf_w_ = 0, lnf_b_ = 0, head_ = 0;  // parameter indices
  int block_first_ = 2;                                       // index of blocks.0's first parameter

  // Batch state.
  int64_t B_ = 0, T_ = 0;
  float loss_scale_ = 1.0f;
  std::vector<int32_t> inputs_, targets_;
  int next_forward_ = 0, next_backward_ = -1;
  float loss_ = 0.0f;

  // Activations, sized for (B,T); see resize_activations for shapes.
  std::vector<float> final_residual_;  // (B,T,C) the last block's output, the final LayerNorm's input
  std::vector<Layer> layers_;
  std::vector<float> lnf_, lnf_mean_, lnf_rstd_, logits_, probs_, losses_;
  // Backward scratch, reused by every unit: the residual-stream gradient flows from unit to unit.
  std::vector<float> dresidual_, dln_, dqkv_, datty_, dfch_gelu_, dfch_, datt_scratch_, dlogits_;
};

// Every parameter and gradient of a model in two contiguous buffers, in params() order: for tests,
// benchmarks and single-process training (the sharded runtime binds its own gathered buffers instead).
struct GptBuffers {
  explicit GptBuffers(const Gpt& model);
  // gpt_init_param for every parameter.
  void init(const GptConfig& config, const std::vector<ParamSpec>& specs, uint64_t seed);
  void bind_to(Gpt& model);
  void zero_grads();
  float* value(int index) { return values.data() + offsets[index]; }
  float* grad(int index) { return grads.data() + offsets[index]; }

  std::vector<int64_t> offsets;  // offsets[i]: parameter i's first element; offsets.back(): the total
  std::vector<float> values, grads;
};

}  // namespace dmuon
