// The GPT example's parameter list (names, shapes, roles, units) and its GPT-2 initialisation.
#include <cmath>
#include <string>

#include "dmuon/checksum.hpp"
#include "dmuon/error.hpp"
#include "dmuon/gpt.hpp"
#include "model/random.hpp"

namespace dmuon {

void validate(const GptConfig& c) {
  // Messages name the fields (GptConfig.width); dmuon train and dmuon-bench gpt show their flags instead.
  DMUON_CHECK(c.vocab > 0, "GptConfig.vocab must be positive, got ", c.vocab);
  DMUON_CHECK(c.context > 0, "GptConfig.context must be positive, got ", c.context);
  DMUON_CHECK(c.layers > 0, "GptConfig.layers must be positive, got ", c.layers);
  DMUON_CHECK(c.heads > 0, "GptConfig.heads must be positive, got ", c.heads);
  DMUON_CHECK(c.width > 0, "GptConfig.width must be positive, got ", c.width);
  DMUON_CHECK(c.width % c.heads == 0, "GptConfig.width ", c.width, " is not divisible by GptConfig.heads ", c.heads);
}

std::vector<ParamSpec> gpt_param_specs(const GptConfig& c) {
  validate(c);
  const int64_t C = c.width, L = c.layers;
  const auto E = ParamRole::elementwise, M = ParamRole::matrix;
  std::vector<ParamSpec> s;
  s.push_back({"wte", {c.vocab, C}, E, 0});
  s.push_back({"wpe", {c.context, C}, E, 0});
  for (int64_t l = 0; l < L; l++) {
    const std::string p = "blocks." + std::to_string(l) + ".";
    const int u = static_cast<int>(l) + 1;
    s.push_back({p + "ln1.weight", {C}, E, u});
    s.push_back({p + "ln1.bias", {C}, E, u});
    s.push_back({p + "attn.qkv.weight", {3 * C, C}, M, u});
    s.push_back({p + "attn.qkv.bias", {3 * C}, E, u});
    s.push_back({p + "attn.proj.weight", {C, C}, M, u});
    s.push_back({p + "attn.proj.bias", {C}, E, u});
    s.push_back({p + "ln2.weight", {C}, E, u});
    s.push_back({p + "ln2.bias", {C}, E, u});
    s.push_back({p + "mlp.fc.weight", {4 * C, C}, M, u});
    s.push_back({p + "mlp.fc.bias", {4 * C}, E, u});
    s.push_back({p + "mlp.proj.weight", {C, 4 * C}, M, u});
    s.push_back({p + "mlp.proj.bias", {C}, E, u});
  }
  const int last = static_cast<int>(L) + 1;
  s.push_back({"ln_f.weight", {C}, E, last});
  s.push_back({"ln_f.bias", {C}, E, last});
  s.push_back({"head.weight", {c.vocab, C}, E, last});
  return s;
}

double gpt_forward_flops(const GptConfig& c, int64_t T) {
  const double C = static_cast<double>(c.width), L = static_cast<double>(c.layers), t = static_cast<double>(T);
  const double matmuls = 2.0 * t * (L * 12.0 * C * C + C * static_cast<double>(c.vocab));  // qkv 3C², proj C², MLP 8C²
  const double attention = 2.0 * L * 2.0 * t * t * C;
  return matmuls + attention;
}

namespace {
bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
}  // namespace

void gpt_init_param(const GptConfig& c, const ParamSpec& spec, uint64_t seed, float* out) {
  const int64_t n = spec.numel();
  const std::string& name = spec.name;
  const bool layernorm = name.find(".ln") != std::string::npos || name.rfind("ln_f.", 0) == 0;
  if (ends_with(name, ".bias")) {
    for (int64_t i = 0; i < n; i++) out[i] = 0.0f;
  } else if (layernorm) {
    for (int64_t i = 0; i < n; i++) out[i] = 1.0f;
  } else {
    // GPT-2: residual projections are scaled so the residual stream's variance does not grow with depth.
    const bool residual = ends_with(name, "attn.proj.weight") || ends_with(name, "mlp.proj.weight");
    const double std = residual ? 0.02 / std::sqrt(2.0 * static_cast<double>(c.layers)) : 0.02;
    model::Rng rng(model::mix64(seed) ^ fnv1a64(name));
    for (int64_t i = 0; i < n; i++) out[i] = static_cast<float>(std * rng.normal());
  }
}

}  // namespace dmuon
