// The autotuner's pure parts: candidate generation, the noise-tolerant selector, the JSON cache,
// and the loop that drives them with a measuring function.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "dmuon/atomic_file.hpp"
#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/tune.hpp"
#include "io/json_file.hpp"

namespace dmuon {

namespace {

constexpr int kCacheVersion = 1;
constexpr int64_t kMinTileRows = 128;  // smaller tiles lose more BLAS efficiency than they save (DESIGN 2.3)

nlohmann::json entry_to_json(const TuneEntry& e) {
  return {{"rows", e.rows},
          {"cols", e.cols},
          {"batch", e.batch},
          {"algo", to_string(e.options.algo)},
          {"restarts", e.options.restarts},
          {"symmetric", e.options.symmetric},
          {"tiles", e.options.tiles},
          {"batch_mode", to_string(e.options.batch_mode)},
          {"threads", e.options.threads},
          {"seconds", e.seconds},
          {"default_seconds", e.default_seconds}};
}

// Throws dmuon::Error (or nlohmann's exceptions) when an entry is malformed.
TuneEntry entry_from_json(const nlohmann::json& j) {
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
  e.seconds = j.at("seconds").get<double>();
  e.default_seconds = j.at("default_seconds").get<double>();
  DMUON_CHECK(e.rows > 0 && e.cols > 0 && e.batch > 0, "entry has a non-positive shape or batch");
  DMUON_CHECK(e.options.tiles >= 1 && e.options.threads >= 0, "entry has tiles < 1 or threads < 0");
  for (int r : e.options.restarts) DMUON_CHECK(r >= 0, "entry has a negative restart step");
  DMUON_CHECK(std::isfinite(e.seconds) && e.seconds > 0 && std::isfinite(e.default_seconds) && e.default_seconds > 0,
              "entry has a time that is not a positive number");
  return e;
}

}  // namespace

TuneKey current_tune_key(int threads) { return {linalg::cpu_model(), linalg::blas_description(), threads, "float32"}; }

std::vector<NsOptions> tune_candidates(int64_t rows, int64_t cols, int batch, int max_threads) {
  DMUON_CHECK(rows > 0 && cols > 0 && batch > 0 && max_threads > 0, "cannot tune shape ", rows, "x", cols,
              " batch ", batch, " with ", max_threads, " threads");
  const int64_t m = std::min(rows, cols);
  struct Algo {
    NsAlgo algo;
    std::vector<int> restarts;
  };
  const std::vector<Algo> algos = {{NsAlgo::standard, {}}, {NsAlgo::gram, {2}}, {NsAlgo::gram, {1, 3}}};
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
        out.push_back(o);
      }
  return out;
}

NsOptions untuned_options(int max_threads) {
  NsOptions o;
  o.threads = max_threads;
  return o;
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

TuneCache TuneCache::load(const std::string& path, const TuneKey& key, std::string* warning) {
  TuneCache cache(key);
  if (!std::filesystem::exists(path)) return cache;
  auto reject = [&](const std::string& why) {
    if (warning) *warning = "tuning cache " + path + " " + why + "; tuning again and rewriting it";
    return TuneCache(key);
  };
  nlohmann::json j;
  try {
    j = read_json_file(path);
  } catch (const std::exception& e) {
    return reject(std::string("is unreadable or not JSON (") + e.what() + ")");
  }
  try {
    if (!j.is_object() || j.value("format", std::string()) != "dmuon-tune")
      return reject("is not a dmuon tuning cache");
    if (j.at("version").get<int>() != kCacheVersion)
      return reject("has version " + j.at("version").dump() + ", expected " + std::to_string(kCacheVersion));
    const auto& k = j.at("key");
    TuneKey theirs{k.at("cpu").get<std::string>(), k.at("blas").get<std::string>(), k.at("threads").get<int>(),
                   k.at("dtype").get<std::string>()};
    if (!(theirs == key)) {
      return reject("was tuned for another setting (cpu '" + theirs.cpu + "', blas '" + theirs.blas + "', " +
                    std::to_string(theirs.threads) + " threads, " + theirs.dtype + "; this run: cpu '" + key.cpu +
                    "', blas '" + key.blas + "', " + std::to_string(key.threads) + " threads, " + key.dtype + ")");
    }
    for (const auto& e : j.at("entries")) cache.put(entry_from_json(e));
  } catch (const std::exception& e) {
    return reject(std::string("is corrupt (") + e.what() + ")");
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
  nlohmann::json j = {{"format", "dmuon-tune"},
                      {"version", kCacheVersion},
                      {"key", {{"cpu", key_.cpu}, {"blas", key_.blas}, {"threads", key_.threads}, {"dtype", key_.dtype}}},
                      {"entries", nlohmann::json::array()}};
  for (const auto& e : entries_) j["entries"].push_back(entry_to_json(e));
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
  DMUON_CHECK(home && *home, "neither XDG_CACHE_HOME nor HOME is set: give the tuning cache with --cache FILE");
  return std::string(home) + "/.cache/dmuon/tune.json";
}

// ---- driver ----

std::vector<TuneEntry> tune_shapes(const std::vector<TuneRequest>& requests, TuneCache& cache,
                                   const MeasureFn& measure, int max_threads, int rounds,
                                   const TuneProgressFn& progress) {
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
    std::vector<NsOptions> candidates = {untuned_options(max_threads)};
    for (auto& o : tune_candidates(q.rows, q.cols, q.batch, max_threads)) candidates.push_back(std::move(o));
    TuneSelector selector(candidates.size(), rounds, 1.25, 1);
    size_t timed = 0;
    while (auto i = selector.next()) {
      selector.record(measure(candidates[*i], q.rows, q.cols, q.batch));
      if (progress) progress(k, requests.size(), what + ": " + std::to_string(++timed) + " timings");
    }
    TuneEntry e{q.rows, q.cols, q.batch, candidates[selector.best()], selector.best_seconds(), selector.seconds(0)};
    DMUON_CHECK(e.seconds > 0, "tuning ", what, " measured a time of zero");
    cache.put(e);
    out.push_back(e);
    if (progress) progress(k + 1, requests.size(), what);
  }
  return out;
}

std::vector<TuneEntry> tune_with_cache(const std::vector<TuneRequest>& requests, const TuneSessionOptions& options) {
  std::string warning;
  const TuneKey key = options.backend ? tune_key_for(*options.backend, options.threads) : current_tune_key(options.threads);
  TuneCache cache = TuneCache::load(options.cache_path, key, &warning);
  if (!warning.empty() && options.warn) options.warn(warning);
  const size_t before = cache.entries().size();
  const MeasureFn measure = options.backend ? make_ns_timer(*options.backend, options.dtype) : make_ns_timer();
  auto entries = tune_shapes(requests, cache, measure, options.threads, options.rounds, options.progress);
  if (cache.entries().size() != before || !warning.empty()) cache.save(options.cache_path);
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
    for (const auto& e : nlohmann::json::parse(text)) out.push_back(entry_from_json(e));
  } catch (const std::exception& e) {
    DMUON_FAIL("malformed tuning entries (", e.what(), ")");
  }
  return out;
}

std::vector<TuneRequest> tune_requests(const std::vector<ParamSpec>& params, int ranks) {
  DMUON_CHECK(ranks >= 1, "rank count must be at least 1, got ", ranks);
  std::map<std::pair<int64_t, int64_t>, int> count;
  for (const auto& p : params)
    if (p.role == ParamRole::matrix) ++count[{p.rows(), p.cols()}];
  std::vector<TuneRequest> out;
  for (const auto& [shape, n] : count) out.push_back({shape.first, shape.second, (n + ranks - 1) / ranks});
  return out;
}

}  // namespace dmuon
