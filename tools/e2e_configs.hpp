// The GPT configurations `dmuon bench e2e` trains and `dmuon simulate --gpt` models, so both use the same
// shapes: demo (make demo's model: L4 C128 NH4 T64) and large (L6 C256 NH4 T128), 16 sequences per step.
#pragma once

#include <string>

#include "dmuon/error.hpp"
#include "dmuon/gpt.hpp"

namespace dmuon::cli {

inline constexpr int64_t kE2eBatch = 16;  // B: sequences per global batch

inline GptConfig e2e_gpt_config(const std::string& name) {
  GptConfig c;  // the defaults are the demo model
  if (name == "large") {
    c.layers = 6;
    c.width = 256;
    c.context = 128;
  } else {
    DMUON_CHECK(name == "demo", "--config must be demo or large, got '", name, "'");
  }
  return c;
}

}  // namespace dmuon::cli
