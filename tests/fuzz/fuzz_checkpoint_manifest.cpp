// Fuzz target: a checkpoint's per-rank manifest rank-00000.json (checkpoint.hpp), listed in the
// index with its right size and checksum.
#include "checkpoint_fixture.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static dmuon::fuzz::CheckpointFixture fixture;
  fixture.use_manifest(dmuon::fuzz::as_text(data, size));
  fixture.load();
  return 0;
}
