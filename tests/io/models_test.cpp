// Model shapes: parameter counts of real models equal their published counts, roles and units
// follow the rules of DESIGN 1 and 3.1, and bad configs are rejected with messages that say why.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>

#include "dmuon/atomic_file.hpp"
#include "dmuon/error.hpp"
#include "dmuon/models.hpp"
#include "io/hf_config.hpp"  // params_from_hf_config
#include "test_data.hpp"

namespace dmuon {
namespace {

using ::testing::HasSubstr;

std::string manifest(const std::string& name) { return test::data_path("../../models/" + name + ".json"); }
std::string hf(const std::string& name) { return test::data_path("hf/" + name + ".json"); }

const ParamSpec& find(const std::vector<ParamSpec>& params, const std::string& name) {
  for (const auto& p : params)
    if (p.name == name) return p;
  throw std::runtime_error("no parameter " + name);
}

// Exact counts of the released checkpoints (sum of their safetensors tensor sizes).
TEST(Models, ManifestCountsMatchPublishedCounts) {
  EXPECT_EQ(count_params(load_model_manifest(manifest("qwen2.5-0.5b"))), 494032768);   // 0.49B
  EXPECT_EQ(count_params(load_model_manifest(manifest("qwen2.5-7b"))), 7615616512);    // 7.62B
  EXPECT_EQ(count_params(load_model_manifest(manifest("gpt2"))), 124439808);           // 124M
  // pi0 from its sources (models/pi0.json): PaliGemma-3B-224 (2,923,335,408, published), the Gemma-300M
  // action expert without embeddings (openpi gemma_300m: width 1024, 18 layers, 8 query heads and 1 KV
  // head of 256, MLP 4096; per layer q, k, v, o, gate, up, down and two RMSNorm weights; a final norm),
  // and the action projections of openpi's pi0.py (action_dim 32).
  const int64_t width = 1024, head = 256, mlp = 4096;
  const int64_t expert_layer = width * 8 * head + 2 * width * 1 * head + 8 * head * width + 3 * width * mlp + 2 * width;
  const int64_t expert = 18 * expert_layer + width;
  const int64_t projections = (32 * width + width)                 // state_proj
                              + (32 * width + width)               // action_in_proj
                              + (2 * width * width + width)        // action_time_mlp_in
                              + (width * width + width)            // action_time_mlp_out
                              + (width * 32 + 32);                 // action_out_proj
  EXPECT_EQ(count_params(load_model_manifest(manifest("pi0"))), 2923335408 + expert + projections);
  // WALL-OSS: Qwen2.5-VL-3B (3,754,622,976) plus a 2048-wide MLP expert in each of 36 layers.
  const int64_t wall = count_params(load_model_manifest(manifest("wall-oss")));
  EXPECT_EQ(wall, 3754622976 + 36 * 3 * 2048 * 2048);
}

TEST(Models, PaliGemmaPartOfPi0MatchesItsPublishedCount) {
  auto params = load_model_manifest(manifest("pi0"));
  int64_t paligemma = 0;
  for (const auto& p : params)
    if (p.name.rfind("paligemma.", 0) == 0) paligemma += p.numel();
  EXPECT_EQ(paligemma, 2923335408);
}

TEST(Models, HfConfigsMatchPublishedCounts) {
  EXPECT_EQ(count_params(load_hf_config(hf("qwen2.5-0.5b"))), 494032768);
  EXPECT_EQ(count_params(load_hf_config(hf("llama-2-7b"))), 6738415616);
  EXPECT_EQ(count_params(load_hf_config(hf("mistral-7b"))), 7241732096);
  EXPECT_EQ(count_params(load_hf_config(hf("gemma-2b"))), 2506172416);
}

TEST(Models, Qwen2ShapesRolesAndUnits) {
  auto params = load_hf_config(hf("qwen2.5-0.5b"));
  const auto& q = find(params, "model.layers.3.self_attn.q_proj.weight");
  EXPECT_EQ(q.shape, (std::vector<int64_t>{896, 896}));
  EXPECT_EQ(q.role, ParamRole::matrix);
  EXPECT_EQ(q.unit, 4);  // unit 0 is the embedding
  EXPECT_EQ(find(params, "model.layers.3.self_attn.k_proj.weight").shape, (std::vector<int64_t>{128, 896}));
  EXPECT_EQ(find(params, "model.layers.3.self_attn.k_proj.bias").role, ParamRole::elementwise);
  EXPECT_EQ(find(params, "model.layers.3.mlp.down_proj.weight").shape, (std::vector<int64_t>{896, 4864}));
  EXPECT_EQ(find(params, "model.embed_tokens.weight").role, ParamRole::elementwise);
  EXPECT_EQ(find(params, "model.norm.weight").unit, 25);
  // Tied embeddings: no separate head.
  EXPECT_THROW(find(params, "lm_head.weight"), std::runtime_error);
  // Only q/k/v have biases in qwen2.
  EXPECT_THROW(find(params, "model.layers.0.self_attn.o_proj.bias"), std::runtime_error);
  int matrices = 0;
  for (const auto& p : params) {
    if (p.role == ParamRole::matrix) {
      ++matrices;
      EXPECT_EQ(p.shape.size(), 2u) << p.name;
    } else {
      EXPECT_TRUE(p.shape.size() == 1 || p.name.find("embed") != std::string::npos) << p.name;
    }
  }
  EXPECT_EQ(matrices, 24 * 7);
}

TEST(Models, UntiedHeadIsAdamW) {
  auto params = load_hf_config(hf("llama-2-7b"));
  EXPECT_EQ(find(params, "lm_head.weight").shape, (std::vector<int64_t>{32000, 4096}));
  EXPECT_EQ(find(params, "lm_head.weight").role, ParamRole::elementwise);
  EXPECT_THROW(find(params, "model.layers.0.self_attn.q_proj.bias"), std::runtime_error);
}

TEST(Models, LayersScalesDown) {
  auto full = load_model_manifest(manifest("qwen2.5-0.5b"));
  auto small = load_model_manifest(manifest("qwen2.5-0.5b"), 4);
  const int64_t per_layer = (count_params(full) - 151936 * 896 - 896) / 24;
  EXPECT_EQ(count_params(small), 151936 * 896 + 896 + 4 * per_layer);
  EXPECT_EQ(small.back().unit, 5);  // embedding, 4 layers, final norm
  // More layers than the model has keeps them all.
  EXPECT_EQ(count_params(load_model_manifest(manifest("qwen2.5-0.5b"), 100)), count_params(full));
}

TEST(Models, UnitsAreConsecutiveAcrossComponents) {
  auto params = load_model_manifest(manifest("pi0"), 2);
  std::set<int> units;
  int last = 0;
  for (const auto& p : params) {
    EXPECT_GE(p.unit, last) << p.name;  // forward order
    last = p.unit;
    units.insert(p.unit);
  }
  EXPECT_EQ(static_cast<int>(units.size()), *units.rbegin() + 1);  // no gaps
}

TEST(Models, UnknownModelTypeListsSupportedOnes) {
  try {
    load_hf_config(hf("bad-unknown-type"));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("unsupported model_type 'mamba'"));
    EXPECT_THAT(e.what(), HasSubstr("qwen2"));
    EXPECT_THAT(e.what(), HasSubstr("gemma"));
    EXPECT_THAT(e.what(), HasSubstr("bad-unknown-type.json"));
  }
}

TEST(Models, MissingFieldsAreAllNamed) {
  try {
    load_hf_config(hf("bad-missing-fields"));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("intermediate_size"));
    EXPECT_THAT(e.what(), HasSubstr("num_hidden_layers"));
    EXPECT_THAT(e.what(), Not(HasSubstr("vocab_size")));
  }
}

TEST(Models, BrokenJsonAndWrongTypesAreErrors) {
  EXPECT_THAT([] { load_hf_config(hf("bad-not-json")); },
              ::testing::ThrowsMessage<Error>(HasSubstr("not valid JSON")));
  nlohmann::json c = nlohmann::json::parse(read_file(hf("qwen2.5-0.5b")));
  c["hidden_size"] = -896;
  EXPECT_THAT([&] { params_from_hf_config(c, "cfg"); }, ::testing::ThrowsMessage<Error>(HasSubstr("hidden_size")));
  c["hidden_size"] = "896";
  EXPECT_THAT([&] { params_from_hf_config(c, "cfg"); }, ::testing::ThrowsMessage<Error>(HasSubstr("hidden_size")));
  EXPECT_THROW(load_hf_config(hf("no-such-file")), Error);
}

TEST(Models, ManifestLookupNamesWhatWasSearched) {
  EXPECT_THAT([] { find_model_manifest("no-such-model"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("no model manifest 'no-such-model'")));
  EXPECT_EQ(find_model_manifest(manifest("gpt2")), manifest("gpt2"));
}

}  // namespace
}  // namespace dmuon
