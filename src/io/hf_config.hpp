// One Hugging Face config (a parsed JSON object) expanded into ParamSpecs: the step that
// load_hf_config and load_model_manifest (include/dmuon/models.hpp) share. Internal: nlohmann's
// types stay out of the public headers.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dmuon/params.hpp"

namespace dmuon {

// Expands one config. `layers` > 0 keeps only the first `layers` layers of every layer stack
// (for small runs); 0 keeps all. `prefix` overrides the model type's default name prefix
// ("model." for the llama family); `first_unit` numbers the units. `origin` names the file in errors.
// Throws dmuon::Error for an unknown model_type (listing the supported ones) or missing fields
// (listing all of them).
std::vector<ParamSpec> params_from_hf_config(const nlohmann::json& config, const std::string& origin, int layers = 0,
                                             int first_unit = 0, const std::string* prefix = nullptr);

}  // namespace dmuon
