// Fuzz target: safetensors files, header and data (decode_safetensors, then every tensor read
// through the typed views the checkpoint loader uses).
#include "dmuon/safetensors.hpp"
#include "fuzz_input.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dmuon::fuzz::expect_only_dmuon_errors([&] {
    const dmuon::SafetensorsFile file = dmuon::decode_safetensors(dmuon::fuzz::as_text(data, size), "input");
    for (const auto& [name, tensor] : file.tensors) {
      if (tensor.dtype == "F32") dmuon::get_f32(file, name, "input");
      if (tensor.dtype == "I64") dmuon::get_i64(file, name, "input");
    }
  });
  return 0;
}
