// Fuzz target: model shape manifests as in models/*.json (load_model_manifest).
#include "dmuon/models.hpp"
#include "fuzz_input.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = dmuon::fuzz::write_scratch("manifest.json", dmuon::fuzz::as_text(data, size));
  dmuon::fuzz::expect_only_dmuon_errors([&] { dmuon::count_params(dmuon::load_model_manifest(path)); });
  return 0;
}
