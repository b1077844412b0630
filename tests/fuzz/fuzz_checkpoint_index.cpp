// Fuzz target: a checkpoint's index.json (checkpoint.hpp), its own checksum made right.
#include "checkpoint_fixture.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static dmuon::fuzz::CheckpointFixture fixture;
  fixture.use_index(dmuon::fuzz::as_text(data, size));
  fixture.load();
  return 0;
}
