// Fuzz target: the tuning cache file (TuneCache::load, which turns a bad file of ours into a warning
// and an empty cache, and refuses a file that is not a tuning cache with a dmuon::Error) and the tuned
// entries rank 0 sends to the others (tune_entries_from_json).
#include "dmuon/tune.hpp"
#include "fuzz_input.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text = dmuon::fuzz::as_text(data, size);
  const std::string path = dmuon::fuzz::write_scratch("tune.json", text);
  // The key of the seed corpus's files, so that inputs get past the key check to the entries.
  dmuon::TuneKey key;
  key.cpu = "fuzz-cpu";
  key.blas = "fuzz-blas";
  dmuon::fuzz::expect_only_dmuon_errors([&] {
    std::string warning;
    const dmuon::TuneCache cache = dmuon::TuneCache::load(path, key, &warning);
    for (const dmuon::TuneEntry& e : cache.entries()) dmuon::describe(e.options);
  });
  dmuon::fuzz::expect_only_dmuon_errors([&] { dmuon::tune_entries_from_json(std::string(text)); });
  return 0;
}
