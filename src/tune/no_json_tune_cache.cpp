// The tuning cache in a build without nlohmann-json (the Python package's or the GPU-only build on a machine
// without it, src/CMakeLists.txt): no file is read or written, tuned entries serve the process that timed them.
// Builds with nlohmann-json have tune_cache_json.cpp instead.
#include <filesystem>
#include <string>
#include <vector>

#include "dmuon/error.hpp"
#include "dmuon/tune.hpp"

namespace dmuon {

namespace {

constexpr const char* kNoJson = "this build of dmuon has no JSON library (built without nlohmann-json)";

}  // namespace

// An empty cache that is never saved; a warning where `path` exists (its entries go unused).
TuneCache TuneCache::load(const std::string& path, const TuneKey& key, std::string* warning) {
  TuneCache cache(key);
  cache.saveable_ = false;
  std::error_code ec;
  if (warning && std::filesystem::exists(path, ec))
    *warning = "tuning cache " + path + " is not read: " + kNoJson + "; tuning without it, leaving it as it is";
  return cache;
}

std::string TuneCache::to_json() const { DMUON_FAIL("the tuning cache cannot be written: ", kNoJson); }

std::string tune_entries_to_json(const std::vector<TuneEntry>&) {
  DMUON_FAIL("tuning entries cannot be sent as JSON: ", kNoJson);
}

std::vector<TuneEntry> tune_entries_from_json(const std::string&) {
  DMUON_FAIL("tuning entries cannot be read from JSON: ", kNoJson);
}

}  // namespace dmuon
