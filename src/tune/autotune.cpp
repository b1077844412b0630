// The autotuner's pure parts: candidate generation, the noise-tolerant selector, the cache's entries, and the
// loop that drives them with a measuring function. The cache's file format: tune_cache_json.cpp.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <sstream>

#include "dmuon/atomic_file.hpp"
#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/tune.hpp"

namespace dmuon {

namespace {

constexpr int64_t kMinTileRows = 128;  // smaller tiles lose more BLAS efficiency than they save (DESIGN 2.3)

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

std::vector<DType> auto_tune_dtypes(DType cpu_default, bool bf16_candidate) {
  if (cpu_default == DType::bf16) return {DType::bf16, DType::f32};
  if (bf16_candidate) return {DType::f32, DType::bf16};
  return {DType::f32};
}

std::vector<DType> cpu_auto_tune_dtypes() { return auto_tune_dtypes(cpu_ns_default_dtype(), cpu_ns_bf16_candidate()); }

std::string tune_dtype_key(const std::vector<DType>& dtypes) {
  DMUON_CHECK(!dtypes.empty(), "tuning needs at least one compute dtype");
  std::vector<std::string> names;
  for (const DType d : dtypes) names.push_back(to_string(d));
  std::sort(names.begin(), names.end());
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "" : " or ") + name;
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
