// Contiguous parameter and gradient storage for a GPT model (tests, benchmarks, single-process use).
#include <algorithm>

#include "dmuon/gpt.hpp"

namespace dmuon {

GptBuffers::GptBuffers(const Gpt& model) {
  offsets.push_back(0);
  for (const ParamSpec& s : model.params()) offsets.push_back(offsets.back() + s.numel());
  values.assign(offsets.back(), 0.0f);
  grads.assign(offsets.back(), 0.0f);
}

void GptBuffers::init(const GptConfig& config, const std::vector<ParamSpec>& specs, uint64_t seed) {
  for (size_t i = 0; i < specs.size(); i++) gpt_init_param(config, specs[i], seed, value(static_cast<int>(i)));
}

void GptBuffers::bind_to(Gpt& model) {
  for (int i = 0; i < static_cast<int>(model.params().size()); i++) model.bind(i, value(i), grad(i));
}

void GptBuffers::zero_grads() { std::fill(grads.begin(), grads.end(), 0.0f); }

}  // namespace dmuon
