// The options that name a model, shared by `dmuon plan` and `dmuon tune`:
// --model NAME|PATH (a manifest in models/) or --hf-config config.json, and --layers N.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "cli_kit/cli.hpp"
#include "dmuon/error.hpp"
#include "dmuon/models.hpp"

namespace dmuon::cli {

struct ModelArgs {
  std::string model;
  std::string hf_config;
  int layers = 0;

  void add_to(CLI::App* c, bool allow_hf_config = true) {
    auto* m = c->add_option("--model", model, "Shape manifest: a name in models/ (e.g. qwen2.5-0.5b) or a path (required, or --hf-config)");
    if (allow_hf_config) {
      auto* h = c->add_option("--hf-config", hf_config, "A Hugging Face config.json (qwen2, llama, mistral, gemma) (required, or --model)");
      m->excludes(h);
    }
    c->add_option("--layers", layers, "Keep only the first N layers of every layer stack (0: all)")
        ->capture_default_str()
        ->check(at_least(0));
  }

  std::vector<ParamSpec> load() const {
    DMUON_CHECK(!model.empty() || !hf_config.empty(), "give --model NAME|PATH or --hf-config FILE");
    return model.empty() ? load_hf_config(hf_config, layers) : load_model_manifest(model, layers);
  }

  std::string label() const {
    std::string name = model.empty() ? hf_config : model;
    return layers > 0 ? name + " (first " + std::to_string(layers) + " layers)" : name;
  }
};

}  // namespace dmuon::cli
