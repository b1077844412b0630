// The tuning cache's file format (JSON, nlohmann-json): TuneCache::load and to_json, and the entries' text that
// tune_across_ranks sends. A build without nlohmann-json (the Python package's or the GPU-only build on a machine
// without it) has no_json_tune_cache.cpp instead (src/CMakeLists.txt).
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dmuon/atomic_file.hpp"
#include "dmuon/error.hpp"
#include "dmuon/tune.hpp"

namespace dmuon {

// The file (version 3): {"format": "dmuon-tune", "version": 3, "settings": [{"key": {...}, "entries":
// [...]}, ...]}, one setting per TuneKey, each entry with its compute dtype ("dtype") and, where the key
// names several, each dtype's time ("dtype_seconds"). Version 2 is the same without the entries' dtypes
// (each ran in its key's one dtype); version 1 held one such setting as top-level "key" and "entries".
// Both are read as such and rewritten as version 3; a dmuon that reads only 1 and 2 leaves a version 3 file
// alone (its own version check), so no older reader drops the dtypes.

namespace {

constexpr int kCacheVersion = 3;

// "float32" or "bfloat16", the compute dtypes an entry may name.
DType parse_compute_dtype(const std::string& name) {
  for (const DType d : {DType::f32, DType::bf16})
    if (to_string(d) == name) return d;
  DMUON_FAIL("unknown compute dtype '", name, "' (float32 or bfloat16)");
}

nlohmann::json entry_to_json(const TuneEntry& e) {
  nlohmann::json dtype_seconds = nlohmann::json::object();
  for (const auto& [dtype, s] : e.dtype_seconds) dtype_seconds[to_string(dtype)] = s;
  return {{"rows", e.rows},
          {"cols", e.cols},
          {"batch", e.batch},
          {"algo", to_string(e.options.algo)},
          {"restarts", e.options.restarts},
          {"symmetric", e.options.symmetric},
          {"tiles", e.options.tiles},
          {"batch_mode", to_string(e.options.batch_mode)},
          {"threads", e.options.threads},
          {"dtype", to_string(e.options.dtype)},
          {"seconds", e.seconds},
          {"default_seconds", e.default_seconds},
          {"dtype_seconds", dtype_seconds}};
}

// Throws dmuon::Error (or nlohmann's exceptions) when an entry is malformed. `key_dtype`: the dtype of entries
// without one (files before version 3, whose entries ran in their key's one dtype); nothing where the key names
// several (an entry there without its own dtype is malformed).
TuneEntry entry_from_json(const nlohmann::json& j, std::optional<DType> key_dtype) {
  TuneEntry e;
  e.rows = j.at("rows").get<int64_t>();
  e.cols = j.at("cols").get<int64_t>();
  e.batch = j.at("batch").get<int>();
  e.options.algo = parse_ns_algo(j.at("algo").get<std::string>());
  e.options.restarts = j.at("restarts").get<std::vector<int>>();
  e.options.symmetric = j.at("symmetric").get<bool>();
  e.options.tiles = j.at("tiles").get<int>();
  e.options.batch_mode = parse_ns_batch_mode(j.at("batch_mode").get<std::string>());
  e.options.threads = j.at("threads").get<int>();
  if (j.contains("dtype")) e.options.dtype = parse_compute_dtype(j.at("dtype").get<std::string>());
  else if (key_dtype) e.options.dtype = *key_dtype;
  else DMUON_FAIL("entry has no dtype");
  e.seconds = j.at("seconds").get<double>();
  e.default_seconds = j.at("default_seconds").get<double>();
  const nlohmann::json dtype_seconds = j.value("dtype_seconds", nlohmann::json::object());
  for (const auto& [name, s] : dtype_seconds.items()) {
    const double seconds = s.get<double>();
    DMUON_CHECK(std::isfinite(seconds) && seconds > 0, "entry has a ", name, " time that is not a positive number");
    e.dtype_seconds[parse_compute_dtype(name)] = seconds;
  }
  DMUON_CHECK(e.rows > 0 && e.cols > 0 && e.batch > 0, "entry has a non-positive shape or batch");
  DMUON_CHECK(e.options.tiles >= 1 && e.options.threads >= 0, "entry has tiles < 1 or threads < 0");
  for (int r : e.options.restarts) DMUON_CHECK(r >= 0, "entry has a negative restart step");
  DMUON_CHECK(std::isfinite(e.seconds) && e.seconds > 0 && std::isfinite(e.default_seconds) && e.default_seconds > 0,
              "entry has a time that is not a positive number");
  return e;
}

nlohmann::json key_to_json(const TuneKey& k) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [name, value] : k.fields()) j[name] = value;
  j["threads"] = k.threads;
  return j;
}

TuneKey key_from_json(const nlohmann::json& j) {
  TuneKey k;
  k.cpu = j.at("cpu").get<std::string>();
  k.blas = j.at("blas").get<std::string>();
  k.threads = j.at("threads").get<int>();
  k.dtype = j.at("dtype").get<std::string>();
  k.device = j.value("device", std::string("cpu"));  // version 1 keys have no device: the CPU
  for (const auto& [name, value] : j.items())
    if (name != "cpu" && name != "blas" && name != "threads" && name != "dtype" && name != "device")
      k.extra[name] = value.get<std::string>();
  return k;
}

// A setting's entries, each in one of the dtypes its key names (tune_dtype_key), so that an explicit dtype's
// setting never serves another; those without a dtype (before version 3) ran in the key's, where it names one.
std::vector<TuneEntry> entries_from_json(const nlohmann::json& j, const TuneKey& key) {
  std::vector<std::string> names;
  for (size_t from = 0, to; from <= key.dtype.size(); from = to + 4) {
    to = std::min(key.dtype.find(" or ", from), key.dtype.size());
    names.push_back(key.dtype.substr(from, to - from));
  }
  std::optional<DType> key_dtype;
  for (const DType d : {DType::f32, DType::bf16})
    if (names.size() == 1 && names[0] == to_string(d)) key_dtype = d;
  std::vector<TuneEntry> out;
  for (const auto& e : j) {
    out.push_back(entry_from_json(e, key_dtype));
    const std::string dtype = to_string(out.back().options.dtype);
    DMUON_CHECK(std::find(names.begin(), names.end(), dtype) != names.end(), "an entry's dtype ", dtype,
                " is not its setting's (", key.dtype, ")");
  }
  return out;
}

size_t count_differences(const TuneKey& a, const TuneKey& b) {
  size_t n = 0;
  for (const auto& [name, value] : a.fields()) {
    bool same = false;
    for (const auto& [other, other_value] : b.fields()) same = same || (other == name && other_value == value);
    n += !same;
  }
  return n;
}

}  // namespace

TuneCache TuneCache::load(const std::string& path, const TuneKey& key, std::string* warning) {
  TuneCache cache(key);
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return cache;
  auto warn = [&](const std::string& why) {
    if (warning) *warning = "tuning cache " + path + " " + why;
  };
  std::string text;
  try {
    text = read_file(path);
  } catch (const Error& e) {
    warn("cannot be read (" + std::string(e.what()) + "); tuning without it, leaving it as it is");
    cache.saveable_ = false;
    return cache;
  }
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) return cache;  // empty: nothing to lose
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception&) {
    j = nullptr;
  }
  // Ours: our format field, or, where the text is not JSON (cut short), our format's name in it.
  const bool ours = j.is_object() ? j.value("format", std::string()) == "dmuon-tune"
                                  : j.is_null() && text.find("\"dmuon-tune\"") != std::string::npos;
  DMUON_CHECK(ours, path,
              " is not a dmuon tuning cache; refusing to replace it (name another file with "
              "TuneSessionOptions.cache_path)");
  if (!j.is_object()) {
    warn("is corrupt (not JSON); tuning again and rewriting it");
    return cache;
  }
  std::vector<std::pair<TuneKey, std::vector<TuneEntry>>> settings;
  try {
    const int version = j.at("version").get<int>();
    if (version == 1) {
      const TuneKey k = key_from_json(j.at("key"));
      settings.emplace_back(k, entries_from_json(j.at("entries"), k));
    } else if (version == 2 || version == kCacheVersion) {  // 2: entries without their dtype
      for (const auto& s : j.at("settings")) {
        const TuneKey k = key_from_json(s.at("key"));
        settings.emplace_back(k, entries_from_json(s.at("entries"), k));
      }
    } else {
      warn("has version " + std::to_string(version) + " (this dmuon reads 1 to " + std::to_string(kCacheVersion) +
           "); tuning without it, leaving it as it is");
      cache.saveable_ = false;
      return cache;
    }
  } catch (const std::exception& e) {
    warn(std::string("is corrupt (") + e.what() + "); tuning again and rewriting it");
    return cache;
  }
  const TuneKey* nearest = nullptr;
  bool found = false;
  for (auto& [k, entries] : settings) {
    if (k == key) {
      cache.position_ = cache.others_.size();
      cache.entries_ = std::move(entries);
      found = true;
      continue;
    }
    if (!nearest || count_differences(k, key) < count_differences(*nearest, key)) nearest = &k;
    cache.others_.emplace_back(k, std::move(entries));
  }
  if (!found) cache.position_ = cache.others_.size();  // a new setting goes last
  if (cache.entries_.empty() && nearest) {
    warn("has no entries for this setting (" + std::to_string(cache.others_.size()) +
         " other setting(s); the nearest: " + describe_difference(*nearest, key) + "): tuning and adding them");
  }
  return cache;
}

std::string TuneCache::to_json() const {
  auto setting = [](const TuneKey& k, const std::vector<TuneEntry>& entries) {
    nlohmann::json s = {{"key", key_to_json(k)}, {"entries", nlohmann::json::array()}};
    for (const auto& e : entries) s["entries"].push_back(entry_to_json(e));
    return s;
  };
  nlohmann::json settings = nlohmann::json::array();
  for (size_t i = 0; i <= others_.size(); ++i) {
    if (i == position_ && !entries_.empty()) settings.push_back(setting(key_, entries_));
    if (i < others_.size()) settings.push_back(setting(others_[i].first, others_[i].second));
  }
  nlohmann::json j = {{"format", "dmuon-tune"}, {"version", kCacheVersion}, {"settings", settings}};
  return j.dump(2) + "\n";
}

std::string tune_entries_to_json(const std::vector<TuneEntry>& entries) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& e : entries) j.push_back(entry_to_json(e));
  return j.dump();
}

std::vector<TuneEntry> tune_entries_from_json(const std::string& text) {
  std::vector<TuneEntry> out;
  try {
    for (const auto& e : nlohmann::json::parse(text)) out.push_back(entry_from_json(e, std::nullopt));
  } catch (const std::exception& e) {
    DMUON_FAIL("malformed tuning entries (", e.what(), ")");
  }
  return out;
}

}  // namespace dmuon
