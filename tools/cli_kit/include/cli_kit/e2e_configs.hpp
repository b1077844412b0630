// The GPT configurations `dmuon bench e2e` trains and `dmuon simulate --gpt` models, so both use the same
// shapes and batch: demo (make demo's model and batch: L4 C128 NH4 T64, 64 sequences per step) and large
// (L6 C256 NH4 T128, 16 sequences).
#pragma once

#include <cstdint>
#include <string>

#include "dmuon/error.hpp"
#include "dmuon/gpt.hpp"

namespace dmuon::cli {

struct E2eConfig {
  GptConfig model;
  int64_t batch = 0;  // B: sequences per global batch
};

inline E2eConfig e2e_config(const std::string& name) {
  E2eConfig c;  // the model's defaults are the demo model
  if (name == "large") {
    c.model.layers = 6;
    c.model.width = 256;
    c.model.context = 128;
    c.batch = 16;
  } else {
    DMUON_CHECK(name == "demo", "--config must be demo or large, got '", name, "'");
    c.batch = 64;  // scripts/demo.sh's BATCH
  }
  return c;
}

}  // namespace dmuon::cli
