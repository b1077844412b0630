// Autotuning of Newton–Schulz (DESIGN 3.5): for each (shape, batch size), time candidate
// configurations — algorithm (standard, Gram with restart sets), symmetric-product tiles, batch
// mode, threads and, for a CPU caller that asks for no compute dtype, the dtype (float32, and
// bfloat16 where the CPU has bf16 instructions that oneDNN uses) — keep the fastest, and cache the winners in a
// JSON file keyed by the machine (CPU model, BLAS, threads, the dtypes timed) so a later run tunes nothing.
//
// Pure parts (candidates, the selection state machine, the cache) take no timings of their own;
// tune_shapes drives them with a MeasureFn, which in production is make_ns_timer().
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dmuon/backend.hpp"
#include "dmuon/ns.hpp"
#include "dmuon/params.hpp"

namespace dmuon {

namespace comm {
class Comm;
}

// What makes timings comparable: results from another machine, BLAS, thread count or dtype are foreign. `dtype` names
// the compute dtypes the candidates were timed in (tune_dtype_key): "float32", "bfloat16", or "bfloat16 or float32"
// where each entry's dtype was chosen among both by measurement.
// A cache file holds entries for several keys side by side (CPU and GPU ones alike). `device` names the
// backend: "cpu" (cpu = the CPU model, blas = the BLAS library), or "cuda", whose own fields are in
// `extra` (tune_key_for: the GPU's name, the CUDA runtime, driver and cuBLAS versions); `extra` is
// compared and written like the named fields.
struct TuneKey {
  std::string cpu;
  std::string blas;
  int threads = 1;
  std::string dtype = "float32";
  std::string device = "cpu";
  std::map<std::string, std::string> extra;
  bool operator==(const TuneKey&) const = default;
  // Every field as (name, value): device, cpu, blas, threads, dtype, then `extra` by name.
  std::vector<std::pair<std::string, std::string>> fields() const;
};
// "threads 1 there, 2 here; blas 'A' there, 'B' here": the fields in which `theirs` differs from `ours`.
std::string describe_difference(const TuneKey& theirs, const TuneKey& ours);
// This process's key for `threads` BLAS threads (linalg::cpu_model, linalg::blas_description).
TuneKey current_tune_key(int threads);
// The key of timings taken on `backend`: current_tune_key(threads) on the CPU; on a GPU (src/tune/tune_key_gpu.cpp)
// device = "cuda", cpu and blas empty, threads = 1, dtype = "bfloat16" (a GPU's default; tune_with_cache sets the
// dtypes it times on any device), extra = {"gpu": the GPU's name, "cuda": the CUDA runtime, driver and cuBLAS versions}.
TuneKey tune_key_for(Backend& backend, int threads);

// The configurations worth timing for `batch` rows×cols matrices with at most `max_threads` threads
// in `dtype` (each candidate's NsOptions::dtype): ({standard} × {plain sgemm, symmetric} + {gram
// restart [2], gram restart [1,3]} × {plain sgemm, symmetric with 1, 2, 4, 8 tiles of at least 128
// rows}) × {sequential with max_threads, sequential with 1 thread, concurrent with max_threads
// workers (batch > 1 and max_threads > 1 only)}; in bf16 Gram restarts at [1,3] only (DESIGN 2.2:
// half precision). No two have the same ns_effective_options. Deterministic order.
std::vector<NsOptions> tune_candidates(int64_t rows, int64_t cols, int batch, int max_threads,
                                       DType dtype = DType::f32);

// The configuration used when nothing is tuned: NsOptions's defaults with max_threads and `dtype`
// (bf16: restarts [1,3], DESIGN 2.2, as the C ABI's untuned bf16 calls).
NsOptions untuned_options(int max_threads, DType dtype = DType::f32);

// The compute dtypes the tuner times for a CPU caller that asks for none, given the CPU's untuned default
// (`cpu_default`: cpu_ns_default_dtype(), bf16 where the CPU has bf16 matrix units (AMX) or
// DMUON_NS_DEFAULT_DTYPE=bf16) and whether bf16 competes there (`bf16_candidate`: cpu_ns_bf16_candidate(), a CPU
// with bf16 instructions that oneDNN uses, AVX-512 BF16 or AMX): {bf16, f32} where the default is bf16, {f32, bf16}
// where bf16 is a candidate only (the default first: the untuned baseline's dtype), {f32} elsewhere (an AVX2 CPU),
// whose key is an explicit f32 caller's. A function of its arguments, so tests fake the machine.
std::vector<DType> auto_tune_dtypes(DType cpu_default, bool bf16_candidate);
// This process's: auto_tune_dtypes(cpu_ns_default_dtype(), cpu_ns_bf16_candidate()).
std::vector<DType> cpu_auto_tune_dtypes();
// TuneKey::dtype of timings in `dtypes`: the one dtype's name ("float32"), or the names in alphabetical order joined by
// " or " ("bfloat16 or float32", whichever was timed first) where each entry's dtype was chosen among several.
std::string tune_dtype_key(const std::vector<DType>& dtypes);

// "gram r[1,3] sym t4 concurrent x2": one line per configuration for tables and logs.
std::string describe(const NsOptions& options);

// Noise-tolerant choice among candidates (as gemma.cpp's ops/matmul.h autotuner): rounds in which
// each surviving candidate is timed once; a candidate's time is the minimum of its timings; after
// each round, candidates slower than prune_ratio × the best are dropped, except the first `pinned`
// ones (a baseline whose time is reported). Done after `rounds` rounds or when one candidate is left.
class TuneSelector {
 public:
  explicit TuneSelector(size_t candidates, int rounds = 3, double prune_ratio = 1.25, size_t pinned = 0);
  // The candidate to time next, or nothing when the choice is made.
  std::optional<size_t> next() const;
  // The timing of the candidate next() returned.
  void record(double seconds);
  bool done() const { return !next().has_value(); }
  size_t best() const;            // index of the fastest candidate so far
  double best_seconds() const;    // its minimum time
  double seconds(size_t candidate) const;  // a candidate's minimum time (∞ if never timed)
  size_t survivors() const;

 private:
  void end_round();
  std::vector<double> min_s_;
  std::vector<bool> alive_;
  int rounds_, round_ = 0;
  double prune_ratio_;
  size_t pinned_;
  size_t cursor_ = 0;  // next alive candidate in this round
};

// One cached winner.
struct TuneEntry {
  int64_t rows = 0, cols = 0;
  int batch = 0;
  NsOptions options;           // the kernel, and its compute dtype (options.dtype): the one timed, or the faster one
  double seconds = 0;          // the winner's time for the whole batch
  double default_seconds = 0;  // untuned_options' time for the whole batch (in the first dtype timed)
  // Where several dtypes were timed: each one's fastest candidate's time for the whole batch (the winner's dtype
  // has `seconds`); empty where one was.
  std::map<DType, double> dtype_seconds;
};

class TuneCache {
 public:
  explicit TuneCache(TuneKey key) : key_(std::move(key)) {}
  // Reads `path`: the entries of `key`, keeping those of other keys for save(). A missing or empty
  // file gives an empty cache. A file of ours that cannot be used (unreadable, corrupt, an invalid
  // entry, another version) gives an empty cache and a one-line warning naming the file and the
  // reason; so does a file without entries for `key` (the warning says what differs from the nearest
  // key it has). Unreadable or of another version, the file is also left alone: saveable() is false.
  // A file that is not a dmuon tuning cache (not JSON, or JSON without our "format") is not ours to
  // replace: dmuon::Error naming it.
  static TuneCache load(const std::string& path, const TuneKey& key, std::string* warning);
  const TuneEntry* find(int64_t rows, int64_t cols, int batch) const;
  void put(const TuneEntry& entry);  // replaces an entry of the same (rows, cols, batch)
  const std::vector<TuneEntry>& entries() const { return entries_; }
  const TuneKey& key() const { return key_; }
  size_t other_keys() const { return others_.size(); }
  bool saveable() const { return saveable_; }
  // The whole file: this key's entries and every other key's, in the order they were first saved.
  std::string to_json() const;
  // Writes atomically (write_file_atomically), creating the folder.
  void save(const std::string& path) const;

 private:
  TuneKey key_;
  std::vector<TuneEntry> entries_;
  std::vector<std::pair<TuneKey, std::vector<TuneEntry>>> others_;
  size_t position_ = 0;  // where key_'s entries go among others_ in the file
  bool saveable_ = true;
};

// $XDG_CACHE_HOME/dmuon/tune.json, else $HOME/.cache/dmuon/tune.json; dmuon::Error when neither is set.
std::string default_tune_cache_path();

// Seconds one run of `options` takes on `batch` rows×cols matrices.
using MeasureFn = std::function<double(const NsOptions& options, int64_t rows, int64_t cols, int batch)>;

struct TuneRequest {
  int64_t rows = 0, cols = 0;
  int batch = 1;
};

// Progress: (requests done, requests in all, candidate timings done for the current request).
using TuneProgressFn = std::function<void(size_t done, size_t total, const std::string& what)>;

// Entries for every request: from the cache when present, else tuned with `measure` (candidates:
// untuned_options in dtypes[0] first, pinned so its reported time has every round, then tune_candidates
// in each of `dtypes`, all in one selection, so the winner's dtype is the faster one) and put in the
// cache (the caller saves it; its key's dtype should be tune_dtype_key(dtypes)).
// Returns the entries in request order.
std::vector<TuneEntry> tune_shapes(const std::vector<TuneRequest>& requests, TuneCache& cache,
                                   const MeasureFn& measure, int max_threads, int rounds = 3,
                                   const TuneProgressFn& progress = {},
                                   const std::vector<DType>& dtypes = {DType::f32});

// Entries as JSON text (the cache file's entry format) and back; from_json throws dmuon::Error for
// malformed text or an invalid entry.
std::string tune_entries_to_json(const std::vector<TuneEntry>& entries);
std::vector<TuneEntry> tune_entries_from_json(const std::string& text);

// Where tuned entries live and how to tune the missing ones.
struct TuneSessionOptions {
  // The cache file; empty: default_tune_cache_path(), or none (a warning) where that is not set.
  std::string cache_path;
  int threads = 1;         // BLAS threads NS runs with (part of the cache key)
  int rounds = 3;          // timing rounds per candidate
  TuneProgressFn progress;
  // One line each: a cache of ours that could not be used (then tuned anew), or a location that cannot
  // be written (then the entries tuned now serve this run only).
  std::function<void(const std::string&)> warn;
  Backend* backend = nullptr;  // tune on this backend (a GPU: key tune_key_for, timer make_ns_timer(backend))
  // The compute dtypes to time: the one a caller chose (float32 by default), or several, of which each (shape,
  // batch) keeps the faster (auto_tune_dtypes, for a CPU caller that asks for none); see tune_shapes. The cache
  // key's dtype is tune_dtype_key(dtypes); on the CPU float32 alone is timed on host pointers (make_ns_timer()),
  // anything else with make_ns_timer(backend or cpu_backend()).
  std::vector<DType> dtypes = {DType::f32};
};

// Loads the cache, tunes what it lacks for `requests` with make_ns_timer and saves it when it changed
// (or was rejected); the entries in request order. The location is checked before any tuning: where the
// cache cannot be written (its folder read-only, no HOME) a warning says so and nothing is saved. A file
// there that is not a tuning cache is an error (TuneCache::load), raised before any tuning.
std::vector<TuneEntry> tune_with_cache(const std::vector<TuneRequest>& requests, const TuneSessionOptions& options);

// Collective. Rank 0 runs tune_with_cache (progress and warnings are rank 0's) while the other
// ranks wait, and broadcasts the entries; every rank returns the same entries, in request order.
// Timings taken by several ranks at once on shared cores distort each other, hence rank 0 alone.
// Failures reach every rank as in comm::from_rank0 ("rank 0 could not tune Newton-Schulz (cache
// PATH): ...; this is rank r"). The waiting ranks wait within the comm timeout (DMUON_COMM_TIMEOUT_S).
std::vector<TuneEntry> tune_across_ranks(comm::Comm& comm, const std::vector<TuneRequest>& requests,
                                         const TuneSessionOptions& options);

// What a model needs tuned on D ranks: each Muon matrix shape with batch ceil(count/D), the
// batch make_plan_items (plan.hpp) asks about; with `ns_blocks` (as make_plan_items takes it) a split matrix's
// block shapes in its place. Sorted by shape.
std::vector<TuneRequest> tune_requests(const std::vector<ParamSpec>& params, int ranks,
                                       const std::vector<std::vector<MatrixBlock>>& ns_blocks = {});

// The NsOptions for `batch` rows×cols matrices: the kernel choice (algo, restarts, symmetric, tiles,
// batch mode, threads, compute dtype) of the entry for that (shape, batch), else of that shape's entry with
// the nearest batch (ties: the smaller), on top of `defaults`' math (coeffs, steps, safety); `defaults` alone
// for a shape no entry has. The dtype is the entry's: entries tuned in the one dtype a caller chose all have
// it, entries tuned among several (auto_tune_dtypes) carry the faster one.
NsOptions tuned_options(const std::vector<TuneEntry>& entries, int64_t rows, int64_t cols, int batch,
                        const NsOptions& defaults);

// An Orthogonalizer that runs newton_schulz_batched with tuned_options for each call's (shape, batch),
// the production path of tuned training and of the benchmarks. `adjust` (optional) edits the chosen
// options before the call (the ablations switch one choice off).
Orthogonalizer tuned_orthogonalizer(std::vector<TuneEntry> entries, NsOptions defaults,
                                    std::function<void(NsOptions&)> adjust = {});

// A MeasureFn that times newton_schulz_batched on fixed random inputs. It keeps the inputs of the
// last (shape, batch) between calls and makes one untimed warm-up run whenever that changes.
MeasureFn make_ns_timer();
// The same on `backend`'s memory, each candidate in its own compute dtype (NsOptions::dtype), timed on the device
// (Backend::time_queued: CUDA events on a GPU), each candidate's first run untimed. src/tune/tune_measure_device.cpp.
MeasureFn make_ns_timer(Backend& backend);

}  // namespace dmuon
