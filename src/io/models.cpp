// Config → ParamSpecs for the model families in include/dmuon/models.hpp.
// Linear weights are (out_features, in_features) as PyTorch stores them; GPT-2's Conv1D is (in, out).
#include "dmuon/models.hpp"

#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dmuon/data_files.hpp"
#include "dmuon/error.hpp"
#include "io/hf_config.hpp"
#include "io/json_file.hpp"

namespace dmuon {

namespace {

using nlohmann::json;

// Reads required and optional fields of one config, collecting every missing field before failing.
class ConfigReader {
 public:
  ConfigReader(const json& config, std::string origin) : config_(config), origin_(std::move(origin)) {}

  int64_t integer(const std::string& key) {
    auto it = config_.find(key);
    if (it == config_.end() || it->is_null()) {
      missing_.push_back(key);
      return 1;
    }
    DMUON_CHECK(it->is_number_integer() && it->get<int64_t>() > 0, origin_, ": field '", key,
                "' must be a positive integer, got ", it->dump());
    return it->get<int64_t>();
  }
  int64_t integer_or(const std::string& key, int64_t fallback) {
    auto it = config_.find(key);
    return (it == config_.end() || it->is_null()) ? fallback : integer(key);
  }
  bool flag_or(const std::string& key, bool fallback) {
    auto it = config_.find(key);
    if (it == config_.end() || it->is_null()) return fallback;
    DMUON_CHECK(it->is_boolean(), origin_, ": field '", key, "' must be true or false, got ", it->dump());
    return it->get<bool>();
  }
  // Throws once, naming every missing required field.
  void finish(const std::string& model_type) const {
    if (missing_.empty()) return;
    std::ostringstream os;
    for (size_t i = 0; i < missing_.size(); ++i) os << (i ? ", " : "") << missing_[i];
    DMUON_FAIL(origin_, ": model_type '", model_type, "' needs field(s) missing here: ", os.str());
  }

 private:
  const json& config_;
  std::string origin_;
  std::vector<std::string> missing_;
};

// Appends parameters with a running unit number.
struct Builder {
  std::vector<ParamSpec> params;
  int unit;
  void add(std::string name, std::vector<int64_t> shape, ParamRole role) {
    params.push_back({std::move(name), std::move(shape), role, unit});
  }
  void matrix(const std::string& name, int64_t rows, int64_t cols) { add(name, {rows, cols}, ParamRole::matrix); }
  void vector(const std::string& name, int64_t n) { add(name, {n}, ParamRole::elementwise); }
  void next_unit() {
    if (!params.empty() && params.back().unit == unit) ++unit;
  }
};

int64_t kept_layers(int64_t total, int layers) { return layers > 0 ? std::min<int64_t>(total, layers) : total; }

// qwen2, llama, mistral, gemma: embed, L × (norm, q/k/v/o, norm, gate/up/down), final norm, head.
void llama_family(const json& c, const std::string& origin, const std::string& type, int layers,
                  const std::string& prefix, Builder& b) {
  ConfigReader r(c, origin);
  const int64_t hidden = r.integer("hidden_size");
  const int64_t inter = r.integer("intermediate_size");
  const int64_t n_layers = r.integer("num_hidden_layers");
  const int64_t heads = r.integer("num_attention_heads");
  const int64_t vocab = c.value("embeddings", true) ? r.integer("vocab_size") : 0;
  const int64_t kv_heads = r.integer_or("num_key_value_heads", heads);
  // Gemma's head_dim is independent of hidden/heads (256 for 2B with hidden 2048 and 8 heads).
  const int64_t head_dim = type == "gemma" ? r.integer("head_dim") : r.integer_or("head_dim", hidden / heads);
  // qwen2 always has q/k/v biases; llama/mistral have them when attention_bias is set.
  const bool qkv_bias = type == "qwen2" || r.flag_or("attention_bias", false);
  const bool o_bias = type != "qwen2" && r.flag_or("attention_bias", false);
  const bool mlp_bias = r.flag_or("mlp_bias", false);
  const bool tied = r.flag_or("tie_word_embeddings", type == "gemma");
  r.finish(type);
  DMUON_CHECK(type == "gemma" || c.contains("head_dim") || hidden % heads == 0, origin, ": hidden_size ", hidden,
              " is not a multiple of num_attention_heads ", heads);
  // Optional extra MLPs per layer (mixture-of-transformers experts, e.g. Wall-OSS's action expert).
  std::vector<int64_t> expert_inter;
  if (c.contains("expert_intermediate_sizes")) expert_inter = c.at("expert_intermediate_sizes").get<std::vector<int64_t>>();

  if (vocab > 0) {
    b.add(prefix + "embed_tokens.weight", {vocab, hidden}, ParamRole::elementwise);
    b.next_unit();
  }
  for (int64_t i = 0; i < kept_layers(n_layers, layers); ++i) {
    const std::string l = prefix + "layers." + std::to_string(i) + ".";
    b.vector(l + "input_layernorm.weight", hidden);
    for (const char* p : {"q_proj", "k_proj", "v_proj"}) {
      const int64_t out = (p[0] == 'q' ? heads : kv_heads) * head_dim;
      b.matrix(l + "self_attn." + p + ".weight", out, hidden);
      if (qkv_bias) b.vector(l + "self_attn." + p + ".bias", out);
    }
    b.matrix(l + "self_attn.o_proj.weight", hidden, heads * head_dim);
    if (o_bias) b.vector(l + "self_attn.o_proj.bias", hidden);
    b.vector(l + "post_attention_layernorm.weight", hidden);
    auto mlp = [&](const std::string& m, int64_t width) {
      b.matrix(m + "gate_proj.weight", width, hidden);
      b.matrix(m + "up_proj.weight", width, hidden);
      b.matrix(m + "down_proj.weight", hidden, width);
      if (mlp_bias) {
        b.vector(m + "gate_proj.bias", width);
        b.vector(m + "up_proj.bias", width);
        b.vector(m + "down_proj.bias", hidden);
      }
    };
    if (expert_inter.empty()) {
      mlp(l + "mlp.", inter);
    } else {
      for (size_t e = 0; e < expert_inter.size(); ++e) mlp(l + "mlp.experts." + std::to_string(e) + ".", expert_inter[e]);
    }
    b.next_unit();
  }
  b.vector(prefix + "norm.weight", hidden);
  if (vocab > 0 && !tied) b.add(c.value("lm_head_name", std::string("lm_head.weight")), {vocab, hidden}, ParamRole::elementwise);
  b.next_unit();
}

// GPT-2: wte, wpe, L × (ln_1, c_attn, c_proj, ln_2, c_fc, c_proj), ln_f; the head is tied to wte.
void gpt2(const json& c, const std::string& origin, int layers, const std::string& prefix, Builder& b) {
  ConfigReader r(c, origin);
  const int64_t d = r.integer("n_embd");
  const int64_t n_layers = r.integer("n_layer");
  r.integer("n_head");
  const int64_t vocab = r.integer("vocab_size");
  const int64_t positions = r.integer("n_positions");
  const int64_t inner = r.integer_or("n_inner", 4 * d);
  r.finish("gpt2");
  b.add(prefix + "wte.weight", {vocab, d}, ParamRole::elementwise);
  b.add(prefix + "wpe.weight", {positions, d}, ParamRole::elementwise);
  b.next_unit();
  for (int64_t i = 0; i < kept_layers(n_layers, layers); ++i) {
    const std::string l = prefix + "h." + std::to_string(i) + ".";
    auto linear = [&](const std::string& name, int64_t in, int64_t out) {
      b.matrix(l + name + ".weight", in, out);
      b.vector(l + name + ".bias", out);
    };
    auto norm = [&](const std::string& name) {
      b.vector(l + name + ".weight", d);
      b.vector(l + name + ".bias", d);
    };
    norm("ln_1");
    linear("attn.c_attn", d, 3 * d);
    linear("attn.c_proj", d, d);
    norm("ln_2");
    linear("mlp.c_fc", d, inner);
    linear("mlp.c_proj", inner, d);
    b.next_unit();
  }
  b.vector(prefix + "ln_f.weight", d);
  b.vector(prefix + "ln_f.bias", d);
  b.next_unit();
}

// SigLIP vision tower: patch conv + position embedding (input layers: AdamW), L pre-norm blocks, post norm.
void siglip_vision(const json& c, const std::string& origin, int layers, const std::string& prefix, Builder& b) {
  ConfigReader r(c, origin);
  const int64_t d = r.integer("hidden_size");
  const int64_t inter = r.integer("intermediate_size");
  const int64_t n_layers = r.integer("num_hidden_layers");
  const int64_t patch = r.integer("patch_size");
  const int64_t image = r.integer("image_size");
  const int64_t channels = r.integer_or("num_channels", 3);
  r.finish("siglip_vision_model");
  const int64_t patches = (image / patch) * (image / patch);
  b.add(prefix + "embeddings.patch_embedding.weight", {d, channels, patch, patch}, ParamRole::elementwise);
  b.vector(prefix + "embeddings.patch_embedding.bias", d);
  b.add(prefix + "embeddings.position_embedding.weight", {patches, d}, ParamRole::elementwise);
  b.next_unit();
  for (int64_t i = 0; i < kept_layers(n_layers, layers); ++i) {
    const std::string l = prefix + "encoder.layers." + std::to_string(i) + ".";
    auto linear = [&](const std::string& name, int64_t out, int64_t in) {
      b.matrix(l + name + ".weight", out, in);
      b.vector(l + name + ".bias", out);
    };
    b.vector(l + "layer_norm1.weight", d);
    b.vector(l + "layer_norm1.bias", d);
    for (const char* p : {"q_proj", "k_proj", "v_proj", "out_proj"}) linear(std::string("self_attn.") + p, d, d);
    b.vector(l + "layer_norm2.weight", d);
    b.vector(l + "layer_norm2.bias", d);
    linear("mlp.fc1", inter, d);
    linear("mlp.fc2", d, inter);
    b.next_unit();
  }
  b.vector(prefix + "post_layernorm.weight", d);
  b.vector(prefix + "post_layernorm.bias", d);
  b.next_unit();
}

// Qwen2.5-VL vision tower: 3-D patch conv (no bias), L blocks (RMSNorm, fused qkv, SwiGLU with biases),
// and the patch merger (RMSNorm, 2-layer MLP from (merge²·d) to the language model's width).
void qwen2_5_vl_vision(const json& c, const std::string& origin, int layers, const std::string& prefix, Builder& b) {
  ConfigReader r(c, origin);
  const int64_t d = r.integer("hidden_size");
  const int64_t inter = r.integer("intermediate_size");
  const int64_t depth = r.integer("depth");
  const int64_t patch = r.integer("patch_size");
  const int64_t temporal = r.integer("temporal_patch_size");
  const int64_t merge = r.integer("spatial_merge_size");
  const int64_t out = r.integer("out_hidden_size");
  const int64_t channels = r.integer_or("in_chans", 3);
  r.finish("qwen2_5_vl_vision");
  b.add(prefix + "patch_embed.proj.weight", {d, channels, temporal, patch, patch}, ParamRole::elementwise);
  b.next_unit();
  for (int64_t i = 0; i < kept_layers(depth, layers); ++i) {
    const std::string l = prefix + "blocks." + std::to_string(i) + ".";
    auto linear = [&](const std::string& name, int64_t rows, int64_t cols) {
      b.matrix(l + name + ".weight", rows, cols);
      b.vector(l + name + ".bias", rows);
    };
    b.vector(l + "norm1.weight", d);
    linear("attn.qkv", 3 * d, d);
    linear("attn.proj", d, d);
    b.vector(l + "norm2.weight", d);
    linear("mlp.gate_proj", inter, d);
    linear("mlp.up_proj", inter, d);
    linear("mlp.down_proj", d, inter);
    b.next_unit();
  }
  const int64_t merged = merge * merge * d;
  b.vector(prefix + "merger.ln_q.weight", d);
  b.matrix(prefix + "merger.mlp.0.weight", merged, merged);
  b.vector(prefix + "merger.mlp.0.bias", merged);
  b.matrix(prefix + "merger.mlp.2.weight", out, merged);
  b.vector(prefix + "merger.mlp.2.bias", out);
  b.next_unit();
}

// An explicit parameter list (projections specific to one model): one unit.
void explicit_params(const json& c, const std::string& origin, const std::string& prefix, Builder& b) {
  DMUON_CHECK(c.contains("params") && c.at("params").is_array(), origin, ": model_type 'params' needs a 'params' array");
  for (const auto& p : c.at("params")) {
    DMUON_CHECK(p.contains("name") && p.contains("shape") && p.contains("role"), origin,
                ": each entry of 'params' needs name, shape and role, got ", p.dump());
    auto shape = p.at("shape").get<std::vector<int64_t>>();
    for (int64_t s : shape) DMUON_CHECK(s > 0, origin, ": parameter ", p.at("name").get<std::string>(), " has a non-positive dimension");
    b.add(prefix + p.at("name").get<std::string>(), shape, parse_param_role(p.at("role").get<std::string>()));
  }
  b.next_unit();
}

struct Family {
  std::string default_prefix;
  std::function<void(const json&, const std::string&, const std::string&, int, const std::string&, Builder&)> expand;
};

const std::map<std::string, Family>& families() {
  static const std::map<std::string, Family> table = [] {
    std::map<std::string, Family> t;
    for (const char* type : {"qwen2", "llama", "mistral", "gemma"}) t[type] = {"model.", llama_family};
    t["gpt2"] = {"transformer.", [](const json& c, const std::string& o, const std::string&, int l, const std::string& p,
                                    Builder& b) { gpt2(c, o, l, p, b); }};
    t["siglip_vision_model"] = {"vision_model.", [](const json& c, const std::string& o, const std::string&, int l,
                                                     const std::string& p, Builder& b) { siglip_vision(c, o, l, p, b); }};
    t["qwen2_5_vl_vision"] = {"visual.", [](const json& c, const std::string& o, const std::string&, int l,
                                            const std::string& p, Builder& b) { qwen2_5_vl_vision(c, o, l, p, b); }};
    t["params"] = {"", [](const json& c, const std::string& o, const std::string&, int, const std::string& p,
                          Builder& b) { explicit_params(c, o, p, b); }};
    return t;
  }();
  return table;
}

}  // namespace

std::vector<std::string> supported_model_types() {
  std::vector<std::string> out;
  for (const auto& [name, family] : families()) out.push_back(name);
  return out;
}

std::vector<ParamSpec> params_from_hf_config(const nlohmann::json& config, const std::string& origin, int layers,
                                             int first_unit, const std::string* prefix) {
  DMUON_CHECK(config.is_object(), origin, ": a model config must be a JSON object");
  DMUON_CHECK(layers >= 0, origin, ": the number of layers to take must be at least 0 (0: all), got ", layers);
  auto supported = [] {
    std::string s;
    for (const auto& t : supported_model_types()) s += (s.empty() ? "" : ", ") + t;
    return s;
  };
  DMUON_CHECK(config.contains("model_type") && config.at("model_type").is_string(), origin,
              ": no 'model_type' field (supported: ", supported(), ")");
  const std::string type = config.at("model_type").get<std::string>();
  auto family = families().find(type);
  DMUON_CHECK(family != families().end(), origin, ": unsupported model_type '", type, "' (supported: ", supported(), ")");
  Builder b{{}, first_unit};
  try {
    family->second.expand(config, origin, type, layers, prefix ? *prefix : family->second.default_prefix, b);
  } catch (const nlohmann::json::exception& e) {  // a field of the wrong JSON type ("embeddings": 3)
    DMUON_FAIL(origin, ": a field has the wrong type (", e.what(), ")");
  }
  return std::move(b.params);
}

std::vector<ParamSpec> load_hf_config(const std::string& path, int layers) {
  return params_from_hf_config(read_json_file(path), path, layers);
}

std::string find_model_manifest(const std::string& name_or_path) {
  return find_models_file("", name_or_path, "model manifest");
}

std::vector<ParamSpec> load_model_manifest(const std::string& name_or_path, int layers) {
  const std::string path = find_model_manifest(name_or_path);
  const nlohmann::json manifest = read_json_file(path);
  DMUON_CHECK(manifest.is_object() && manifest.contains("components") && manifest.at("components").is_array() &&
                  !manifest.at("components").empty(),
              path, ": a manifest needs a non-empty 'components' array");
  std::vector<ParamSpec> all;
  for (size_t i = 0; i < manifest.at("components").size(); ++i) {
    const auto& component = manifest.at("components")[i];
    const std::string origin = path + " component " + std::to_string(i);
    DMUON_CHECK(component.contains("config"), origin, ": needs a 'config' object");
    DMUON_CHECK(!component.contains("prefix") || component.at("prefix").is_string(), origin,
                ": 'prefix' must be a string");
    std::string prefix = component.value("prefix", std::string());
    const int first_unit = all.empty() ? 0 : all.back().unit + 1;
    auto params = params_from_hf_config(component.at("config"), origin, layers, first_unit,
                                        component.contains("prefix") ? &prefix : nullptr);
    all.insert(all.end(), params.begin(), params.end());
  }
  return all;
}

int64_t count_params(const std::vector<ParamSpec>& params) {
  int64_t n = 0;
  for (const auto& p : params) n += p.numel();
  return n;
}

}  // namespace dmuon
