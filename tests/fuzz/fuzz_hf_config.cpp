// Fuzz target: Hugging Face config.json (load_hf_config), all layers and the first two only.
#include "dmuon/models.hpp"
#include "fuzz_input.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = dmuon::fuzz::write_scratch("config.json", dmuon::fuzz::as_text(data, size));
  dmuon::fuzz::expect_only_dmuon_errors([&] { dmuon::load_hf_config(path); });
  dmuon::fuzz::expect_only_dmuon_errors([&] { dmuon::load_hf_config(path, 2); });
  return 0;
}
