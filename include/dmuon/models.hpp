// Model shapes: every parameter (name, shape, optimizer role, sharding unit) of a real model,
// derived from a Hugging Face config.json or from a shape manifest in models/*.json.
//
// A manifest is a list of components, each a config in Hugging Face's vocabulary plus a name
// prefix, with citations for every number (see models/README.md). One function expands a
// config into ParamSpecs; units are: [embeddings] then one per layer then [final norm/head],
// numbered consecutively across components in manifest order.
//
// Supported model_type values:
//   qwen2, llama, mistral, gemma  decoder-only language models (also accepted by --hf-config)
//   gpt2                          GPT-2 (Conv1D weights stored (in, out) as in the checkpoints)
//   siglip_vision_model           SigLIP vision tower (PaliGemma)
//   qwen2_5_vl_vision             Qwen2.5-VL vision tower (window-attention ViT + patch merger)
//   params                        an explicit list {name, shape, role} forming one unit
#pragma once

#include <string>
#include <vector>

#include "dmuon/params.hpp"

namespace dmuon {

// The model_type values params_from_hf_config accepts, for messages.
std::vector<std::string> supported_model_types();

// Reads a Hugging Face config.json and expands it (src/io/hf_config.hpp: params_from_hf_config).
std::vector<ParamSpec> load_hf_config(const std::string& path, int layers = 0);

// Path of a manifest: `name_or_path` itself if it is a file, else <name>.json in the models/
// folders that find_models_file (data_files.hpp) searches. Throws dmuon::Error listing them.
std::string find_model_manifest(const std::string& name_or_path);

// Reads a manifest (by name or path) and expands all of its components.
std::vector<ParamSpec> load_model_manifest(const std::string& name_or_path, int layers = 0);

// Sum of numel over all parameters.
int64_t count_params(const std::vector<ParamSpec>& params);

}  // namespace dmuon
