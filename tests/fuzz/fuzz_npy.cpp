// Fuzz target: .npy files (read_npy).
#include "dmuon/npy.hpp"
#include "fuzz_input.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = dmuon::fuzz::write_scratch("input.npy", dmuon::fuzz::as_text(data, size));
  dmuon::fuzz::expect_only_dmuon_errors([&] { dmuon::read_npy(path); });
  return 0;
}
