// The autotuner's pure parts: candidate generation, the noise-tolerant selector, the JSON cache,
// and the loop that drives them with a measuring function.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "dmuon/atomic_file.hpp"
#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/tune.hpp"

namespace dmuon {

namespace {

constexpr int kCacheVersion = 3;
constexpr int64_t kMinTileRows = 128;  // smaller tiles lose more BLAS efficiency than they save (DESIGN 2.3)

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

}  // namespace

TuneKey current_tune_key(int threads) {
  TuneKey k;
  k.cpu = linalg::cpu_model();
  k.blas = linalg::blas_description();
  k.threads = threads;
  return k;
}

std::vector<NsOptions> tune_candidates(int64_t rows, int64_t cols, int batch, int max_threads, DType dtype) {
  DMUON_CHECK(rows > 0 && cols > 0 && batch > 0 && max_threads > 0, "cannot tune shape ", rows, "x", cols,
              " batch ", batch, " with ", max_threads, " threads");
  const int64_t m = std::min(rows, cols);
  struct Algo {
    NsAlgo algo;
    std::vector<int> restarts;
  };
  std::vector<Algo> algos = {{NsAlgo::standard, {}}, {NsAlgo::gram, {2}}, {NsAlgo::gram, {1, 3}}};
  if (dtype == DType::bf16) algos.erase(algos.begin() + 1);  // DESIGN 2.2: half precision restarts at [1,3]
  // (symmetric, tiles). Only gram's upper-triangle products are tiled: the standard recurrence
  // ignores tiles, so it gets one symmetric candidate (ns_effective_options).
  const std::vector<std::pair<bool, int>> untiled = {{false, 1}, {true, 1}};
  std::vector<std::pair<bool, int>> tiled = untiled;
  for (int tiles : {2, 4, 8})
    if (m / tiles >= kMinTileRows) tiled.push_back({true, tiles});
  std::vector<std::pair<NsBatchMode, int>> modes = {{NsBatchMode::sequential, max_threads}};
  if (max_threads > 1) modes.push_back({NsBatchMode::sequential, 1});
  if (batch > 1 && max_threads > 1) modes.push_back({NsBatchMode::concurrent, max_threads});
  std::vector<NsOptions> out;
  for (const auto& a : algos)
    for (const auto& [symmetric, tiles] : a.algo == NsAlgo::gram ? tiled : untiled)
      for (const auto& [mode, threads] : modes) {
        NsOptions o;
        o.algo = a.algo;
        o.restarts = a.restarts;
        o.symmetric = symmetric;
        o.tiles = tiles;
        o.batch_mode = mode;
        o.threads = threads;
        o.dtype = dtype;
        out.push_back(o);
      }
  return out;
}

NsOptions untuned_options(int max_threads, DType dtype) {
  NsOptions o;
  o.threads = max_threads;
  o.dtype = dtype;
  if (dtype == DType::bf16) o.restarts = {1, 3};  // DESIGN 2.2: half precision
  return o;
}

std::vector<DType> auto_tune_dtypes(DType cpu_default) {
  if (cpu_default == DType::bf16) return {DType::bf16, DType::f32};
  return {DType::f32};
}

std::string tune_dtype_key(const std::vector<DType>& dtypes) {
  DMUON_CHECK(!dtypes.empty(), "tuning needs at least one compute dtype");
  std::string out;
  for (const DType d : dtypes) out += (out.empty() ? "" : " or ") + to_string(d);
  return out;
}

std::string describe(const NsOptions& o) {
  std::ostringstream os;
  os << to_string(o.algo);
  if (o.algo != NsAlgo::standard) {
    os << " r[";
    for (size_t i = 0; i < o.restarts.size(); ++i) os << (i ? "," : "") << o.restarts[i];
    os << "]";
  }
  if (o.symmetric) os << " sym t" << o.tiles;
  else os << " gemm";
  os << " " << to_string(o.batch_mode) << " x" << o.threads;
  return os.str();
}

// ---- selector ----

TuneSelector::TuneSelector(size_t candidates, int rounds, double prune_ratio, size_t pinned)
    : min_s_(candidates, std::numeric_limits<double>::infinity()),
      alive_(candidates, true),
      rounds_(rounds),
      prune_ratio_(prune_ratio),
      pinned_(pinned) {
  DMUON_CHECK(rounds >= 1, "tuning needs at least one round, got ", rounds);
  DMUON_CHECK(prune_ratio >= 1, "prune ratio must be ≥ 1, got ", prune_ratio);
}

size_t TuneSelector::survivors() const { return static_cast<size_t>(std::count(alive_.begin(), alive_.end(), true)); }

std::optional<size_t> TuneSelector::next() const {
  if (min_s_.empty() || round_ >= rounds_ || (round_ > 0 && survivors() <= 1)) return std::nullopt;
  return cursor_;
}

void TuneSelector::record(double seconds) {
  DMUON_CHECK(!done(), "TuneSelector::record called after the choice was made");
  DMUON_CHECK(std::isfinite(seconds) && seconds >= 0, "a timing must be a finite number ≥ 0, got ", seconds);
  min_s_[cursor_] = std::min(min_s_[cursor_], seconds);
  do ++cursor_;
  while (cursor_ < alive_.size() && !alive_[cursor_]);
  if (cursor_ == alive_.size()) end_round();
}

void TuneSelector::end_round() {
  ++round_;
  const double best = best_seconds();
  for (size_t i = pinned_; i < alive_.size(); ++i)
    if (alive_[i] && min_s_[i] > prune_ratio_ * best) alive_[i] = false;
  cursor_ = 0;
  while (cursor_ < alive_.size() && !alive_[cursor_]) ++cursor_;
}

size_t TuneSelector::best() const {
  DMUON_CHECK(!min_s_.empty(), "no candidates to choose from");
  size_t b = 0;
  for (size_t i = 1; i < min_s_.size(); ++i)
    if (min_s_[i] < min_s_[b]) b = i;  // ties: the earlier candidate
  return b;
}

double TuneSelector::best_seconds() const { return min_s_[best()]; }

double TuneSelector::seconds(size_t candidate) const { return min_s_.at(candidate); }

// ---- cache ----
//
// The file (version 3): {"format": "dmuon-tune", "version": 3, "settings": [{"key": {...}, "entries":
// [...]}, ...]}, one setting per TuneKey, each entry with its compute dtype ("dtype") and, where the key
// names several, each dtype's time ("dtype_seconds"). Version 2 is the same without the entries' dtypes
// (each ran in its key's one dtype); version 1 held one such setting as top-level "key" and "entries".
// Both are read as such and rewritten as version 3; a dmuon that reads only 1 and 2 leaves a version 3 file
// alone (its own version check), so no older reader drops the dtypes.

namespace {

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

std::vector<std::pair<std::string, std::string>> TuneKey::fields() const {
  std::vector<std::pair<std::string, std::string>> out = {
      {"device", device}, {"cpu", cpu}, {"blas", blas}, {"threads", std::to_string(threads)}, {"dtype", dtype}};
  for (const auto& [name, value] : extra) out.emplace_back(name, value);
  return out;
}

std::string describe_difference(const TuneKey& theirs, const TuneKey& ours) {
  const auto mine = ours.fields();
  std::string out;
  auto add = [&](const std::string& name, const std::string& there, const std::string& here) {
    const bool number = name == "threads";
    const auto show = [&](const std::string& v) { return v.empty() ? std::string("none") : number ? v : "'" + v + "'"; };
    out += (out.empty() ? "" : "; ") + name + " " + show(there) + " there, " + show(here) + " here";
  };
  for (const auto& [name, value] : theirs.fields()) {
    std::string here;
    for (const auto& [n, v] : mine) here = n == name ? v : here;
    if (here != value) add(name, value, here);
  }
  for (const auto& [name, value] : mine) {
    bool theirs_has = false;
    for (const auto& [n, v] : theirs.fields()) theirs_has = theirs_has || n == name;
    if (!theirs_has) add(name, "", value);
  }
  return out;
}

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

const TuneEntry* TuneCache::find(int64_t rows, int64_t cols, int batch) const {
  for (const auto& e : entries_)
    if (e.rows == rows && e.cols == cols && e.batch == batch) return &e;
  return nullptr;
}

void TuneCache::put(const TuneEntry& entry) {
  for (auto& e : entries_) {
    if (e.rows == entry.rows && e.cols == entry.cols && e.batch == entry.batch) {
      e = entry;
      return;
    }
  }
  entries_.push_back(entry);
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

void TuneCache::save(const std::string& path) const {
  const auto dir = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!dir.empty()) std::filesystem::create_directories(dir, ec);
  DMUON_CHECK(!ec, "cannot create folder ", dir.string(), " for the tuning cache: ", ec.message());
  write_file_atomically(path, to_json());
}

std::string default_tune_cache_path() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  if (xdg && *xdg) return std::string(xdg) + "/dmuon/tune.json";
  const char* home = std::getenv("HOME");
  DMUON_CHECK(home && *home,
              "neither XDG_CACHE_HOME nor HOME is set: name the tuning cache with TuneSessionOptions.cache_path");
  return std::string(home) + "/.cache/dmuon/tune.json";
}

// ---- driver ----

std::vector<TuneEntry> tune_shapes(const std::vector<TuneRequest>& requests, TuneCache& cache,
                                   const MeasureFn& measure, int max_threads, int rounds,
                                   const TuneProgressFn& progress, const std::vector<DType>& dtypes) {
  DMUON_CHECK(!dtypes.empty(), "tuning needs at least one compute dtype");
  std::vector<TuneEntry> out;
  for (size_t k = 0; k < requests.size(); ++k) {
    const auto& q = requests[k];
    const std::string what = std::to_string(q.rows) + "x" + std::to_string(q.cols) + " batch " + std::to_string(q.batch);
    if (const TuneEntry* hit = cache.find(q.rows, q.cols, q.batch)) {
      out.push_back(*hit);
      if (progress) progress(k + 1, requests.size(), what + " (cached)");
      continue;
    }
    // The untuned configuration competes as candidate 0, so its time is measured under the same
    // conditions and the winner is never slower than it.
    std::vector<NsOptions> candidates = {untuned_options(max_threads, dtypes[0])};
    for (const DType dtype : dtypes)
      for (auto& o : tune_candidates(q.rows, q.cols, q.batch, max_threads, dtype)) candidates.push_back(std::move(o));
    TuneSelector selector(candidates.size(), rounds, 1.25, 1);
    size_t timed = 0;
    while (auto i = selector.next()) {
      selector.record(measure(candidates[*i], q.rows, q.cols, q.batch));
      if (progress) progress(k, requests.size(), what + ": " + std::to_string(++timed) + " timings");
    }
    TuneEntry e{q.rows, q.cols, q.batch, candidates[selector.best()], selector.best_seconds(), selector.seconds(0), {}};
    DMUON_CHECK(e.seconds > 0, "tuning ", what, " measured a time of zero");
    if (dtypes.size() > 1) {
      for (size_t i = 0; i < candidates.size(); ++i) {
        const auto [it, added] = e.dtype_seconds.emplace(candidates[i].dtype, selector.seconds(i));
        if (!added) it->second = std::min(it->second, selector.seconds(i));
      }
    }
    cache.put(e);
    out.push_back(e);
    if (progress) progress(k + 1, requests.size(), what);
  }
  return out;
}

std::vector<TuneEntry> tune_with_cache(const std::vector<TuneRequest>& requests, const TuneSessionOptions& options) {
  auto warn = [&](const std::string& warning) {
    if (options.warn) options.warn(warning);
  };
  std::string path = options.cache_path;
  if (path.empty()) {
    try {
      path = default_tune_cache_path();
    } catch (const Error& e) {
      warn(std::string(e.what()) + "; the entries tuned now serve this run only");
    }
  }
  TuneKey key = options.backend ? tune_key_for(*options.backend, options.threads) : current_tune_key(options.threads);
  key.dtype = tune_dtype_key(options.dtypes);  // bf16 timings are not float32's, on any device
  TuneCache cache(key);
  bool save = false;
  if (!path.empty()) {
    std::string warning;
    cache = TuneCache::load(path, key, &warning);
    if (!warning.empty()) warn(warning);
    const std::string unwritable = cache.saveable() ? why_cannot_write(path) : "";
    if (!unwritable.empty())
      warn("tuning cache " + path + " cannot be written (" + unwritable + "); the entries tuned now serve this run only");
    save = cache.saveable() && unwritable.empty();
  }
  const size_t before = cache.entries().size();
  const bool host_f32 = !options.backend && options.dtypes == std::vector<DType>{DType::f32};
  const MeasureFn measure =
      host_f32 ? make_ns_timer() : make_ns_timer(options.backend ? *options.backend : cpu_backend());
  auto entries =
      tune_shapes(requests, cache, measure, options.threads, options.rounds, options.progress, options.dtypes);
  if (save && cache.entries().size() != before) {
    try {
      cache.save(path);
    } catch (const Error& e) {
      warn("cannot save tuning cache " + path + " (" + e.what() + "); the entries tuned now serve this run only");
    }
  }
  return entries;
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

std::vector<TuneRequest> tune_requests(const std::vector<ParamSpec>& params, int ranks,
                                       const std::vector<std::vector<MatrixBlock>>& ns_blocks) {
  DMUON_CHECK(ranks >= 1, "rank count must be at least 1, got ", ranks);
  DMUON_CHECK(ns_blocks.empty() || ns_blocks.size() == params.size(), "ns_blocks has ", ns_blocks.size(),
              " entries for ", params.size(), " parameters");
  std::map<std::pair<int64_t, int64_t>, int> count;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].role != ParamRole::matrix) continue;
    if (ns_blocks.empty() || ns_blocks[i].empty()) {
      ++count[{params[i].rows(), params[i].cols()}];
    } else {
      for (const MatrixBlock& b : ns_blocks[i]) ++count[{b.rows, b.cols}];
    }
  }
  std::vector<TuneRequest> out;
  for (const auto& [shape, n] : count) out.push_back({shape.first, shape.second, (n + ranks - 1) / ranks});
  return out;
}

}  // namespace dmuon
