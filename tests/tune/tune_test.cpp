// Autotuner, pure parts: candidate generation, the noise-tolerant selector on scripted timings,
// the cache (keying, round trip, corrupt and foreign files), and the tuning loop with a fake clock.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <tuple>

#include <nlohmann/json.hpp>

#include "dmuon/atomic_file.hpp"
#include "dmuon/error.hpp"
#include "dmuon/models.hpp"
#include "dmuon/plan.hpp"  // make_plan_items, tuned_batch_time
#include "dmuon/tune.hpp"
#include "fenced_device.hpp"
#include "test_data.hpp"

namespace dmuon {
namespace {

using ::testing::HasSubstr;

TEST(TuneCandidates, CoverTheSpaceWithoutDuplicates) {
  const int64_t rows = 1024, cols = 4096;
  auto c = tune_candidates(rows, cols, 4, 2);
  // Distinct by what the kernel runs, not by description: the standard recurrence ignores tiles, so
  // "standard sym t1" and "standard sym t4" would be the same candidate timed twice.
  std::vector<NsOptions> effective;
  std::set<std::string> seen;
  for (const auto& o : c) {
    const NsOptions e = ns_effective_options(o, rows, cols);
    EXPECT_EQ(std::count(effective.begin(), effective.end(), e), 0) << describe(o) << " duplicates another candidate";
    effective.push_back(e);
    seen.insert(describe(o));
  }
  // (standard × (gemm, sym) + 2 gram restarts × (gemm + sym tiles 1, 2, 4, 8)) × (seq x2, seq x1, concurrent x2).
  EXPECT_EQ(c.size(), (2u + 2u * 5u) * 3u);
  EXPECT_TRUE(seen.count("gram r[1,3] sym t8 concurrent x2"));
  EXPECT_TRUE(seen.count("standard gemm sequential x1"));
}

TEST(TuneCandidates, SmallShapesSingleMatrixAndOneThread) {
  // m = 200: tiles of at least 128 rows allow only 1 tile; batch 1: no concurrent mode; 1 thread: one mode.
  auto c = tune_candidates(200, 800, 1, 1);
  EXPECT_EQ(c.size(), 3u * 2u * 1u);
  for (const auto& o : c) {
    EXPECT_EQ(o.batch_mode, NsBatchMode::sequential);
    EXPECT_EQ(o.threads, 1);
    EXPECT_LE(o.tiles, 1);
  }
  EXPECT_THROW(tune_candidates(0, 8, 1, 1), Error);
}

// bf16 candidates run in bf16 and restart Gram at [1,3] only (DESIGN 2.2: half precision); the untuned bf16
// configuration is the C ABI's untuned bf16 call (restarts [1,3]).
TEST(TuneCandidates, Bf16CandidatesComputeInBf16WithHalfPrecisionRestarts) {
  const auto f32 = tune_candidates(1024, 4096, 4, 2);
  const auto bf16 = tune_candidates(1024, 4096, 4, 2, DType::bf16);
  EXPECT_EQ(bf16.size(), (2u + 5u) * 3u);  // standard × 2 + gram [1,3] × 5, × 3 modes
  for (const auto& o : f32) EXPECT_EQ(o.dtype, DType::f32) << describe(o);
  for (const auto& o : bf16) {
    EXPECT_EQ(o.dtype, DType::bf16) << describe(o);
    if (o.algo == NsAlgo::gram) {
      EXPECT_EQ(o.restarts, (std::vector<int>{1, 3})) << describe(o);
    }
  }
  EXPECT_EQ(untuned_options(2, DType::bf16).restarts, (std::vector<int>{1, 3}));
  EXPECT_EQ(untuned_options(2), untuned_options(2, DType::f32));
}

// The dtypes a caller that asks for none has timed, the machine faked each way with the rules of NsDefaultDtype and
// NsBf16Candidate (backend_conformance_test): bf16 and float32 on a CPU with bf16 matrix units (AMX; the default, bf16,
// first) and on one with AVX-512 BF16 alone (float32, the default, first), float32 alone on an AVX2 CPU, whose key is an
// explicit float32 caller's, so such a CPU tunes and keeps float32 only. DMUON_NS_DEFAULT_DTYPE=f32 times float32 alone.
TEST(TuneDtypes, Bf16IsACandidateWhereTheCpuHasBf16Instructions) {
  const auto dtypes = [](bool amx, bool bf16_instructions, const char* forced) {
    return auto_tune_dtypes(ns_default_dtype_rule(amx, forced), ns_bf16_candidate_rule(bf16_instructions, forced));
  };
  EXPECT_EQ(dtypes(true, true, nullptr), (std::vector<DType>{DType::bf16, DType::f32}));
  EXPECT_EQ(dtypes(false, true, nullptr), (std::vector<DType>{DType::f32, DType::bf16}));
  EXPECT_EQ(dtypes(false, false, nullptr), (std::vector<DType>{DType::f32}));
  EXPECT_EQ(dtypes(false, false, "bf16"), (std::vector<DType>{DType::bf16, DType::f32}));
  EXPECT_EQ(dtypes(true, true, "f32"), (std::vector<DType>{DType::f32}));
  EXPECT_EQ(cpu_auto_tune_dtypes(), auto_tune_dtypes(cpu_ns_default_dtype(), cpu_ns_bf16_candidate()));
  EXPECT_EQ(tune_dtype_key({DType::f32}), TuneKey{}.dtype);
  EXPECT_EQ(tune_dtype_key({DType::bf16}), "bfloat16");
  EXPECT_EQ(tune_dtype_key({DType::bf16, DType::f32}), "bfloat16 or float32");
  EXPECT_EQ(tune_dtype_key({DType::f32, DType::bf16}), "bfloat16 or float32");  // one key per choice, either order
}

// Feeds scripted times: candidate i's k-th timing is times[i][k].
size_t run_selector(TuneSelector& s, const std::vector<std::vector<double>>& times, std::vector<int>* counts) {
  counts->assign(times.size(), 0);
  size_t steps = 0;
  while (auto i = s.next()) {
    s.record(times[*i][(*counts)[*i]++]);
    ++steps;
  }
  return steps;
}

TEST(TuneSelector, KeepsMinimumAndPrunesSlowCandidates) {
  // 0: noisy but fastest by its minimum; 1: consistently 1.1× (survives); 2: 2× (pruned after round 1).
  std::vector<std::vector<double>> t = {{1.3, 1.0, 1.2}, {1.1, 1.1, 1.1}, {3.0, 2.0, 2.0}};
  TuneSelector s(3, 3, 1.25);
  std::vector<int> counts;
  run_selector(s, t, &counts);
  EXPECT_EQ(s.best(), 0u);
  EXPECT_DOUBLE_EQ(s.best_seconds(), 1.0);
  EXPECT_EQ(counts, (std::vector<int>{3, 3, 1}));
  EXPECT_TRUE(s.done());
  EXPECT_THROW(s.record(1.0), Error);
}

TEST(TuneSelector, StopsWhenOneCandidateIsLeft) {
  std::vector<std::vector<double>> t = {{1.0, 1.0, 1.0}, {5.0}, {9.0}};
  TuneSelector s(3, 3, 1.25);
  std::vector<int> counts;
  EXPECT_EQ(run_selector(s, t, &counts), 3u);  // one round, then only candidate 0 survives
  EXPECT_EQ(s.best(), 0u);
  EXPECT_EQ(s.survivors(), 1u);
}

TEST(TuneSelector, SingleCandidateIsTimedOnceAndNoneIsAnError) {
  TuneSelector one(1, 3);
  ASSERT_TRUE(one.next().has_value());
  one.record(0.5);
  EXPECT_TRUE(one.done());
  EXPECT_EQ(one.best(), 0u);
  TuneSelector none(0, 3);
  EXPECT_TRUE(none.done());
  EXPECT_THROW(none.best(), Error);
  EXPECT_THROW(TuneSelector(2, 0), Error);
}

TEST(TuneSelector, PinnedBaselineIsTimedEveryRound) {
  // Candidate 0 is pinned: 3× slower, yet timed in all 3 rounds; candidate 2 is pruned after one.
  std::vector<std::vector<double>> t = {{3.0, 2.9, 3.1}, {1.0, 1.0, 1.0}, {5.0}};
  TuneSelector s(3, 3, 1.25, 1);
  std::vector<int> counts;
  run_selector(s, t, &counts);
  EXPECT_EQ(s.best(), 1u);
  EXPECT_DOUBLE_EQ(s.seconds(0), 2.9);
  EXPECT_EQ(counts, (std::vector<int>{3, 3, 1}));
}

TEST(TuneSelector, LateImprovementCanOvertakeAndPrune) {
  // Round 1: 0 = 1.0, 1 = 1.2 (within 1.25×). Round 2: 1 drops to 0.7, and now 0 (1.0 > 1.25·0.7 = 0.875) is pruned.
  std::vector<std::vector<double>> t = {{1.0, 1.0, 1.0}, {1.2, 0.7, 0.7}};
  TuneSelector s(2, 3, 1.25);
  std::vector<int> counts;
  run_selector(s, t, &counts);
  EXPECT_EQ(s.best(), 1u);
  EXPECT_EQ(counts, (std::vector<int>{2, 2}));
}

TuneKey key() {
  TuneKey k;
  k.cpu = "Test CPU", k.blas = "OpenBLAS test", k.threads = 2;
  return k;
}

TuneEntry entry(int64_t rows, int batch, double s) {
  TuneEntry e;
  e.rows = rows;
  e.cols = 2 * rows;
  e.batch = batch;
  e.options.algo = NsAlgo::gram;
  e.options.restarts = {1, 3};
  e.options.tiles = 2;
  e.options.batch_mode = NsBatchMode::concurrent;
  e.options.threads = 2;
  e.seconds = s;
  e.default_seconds = 2 * s;
  return e;
}

TEST(TuneCache, RoundTripAndLookupByShapeAndBatch) {
  test::TempDir dir;
  const std::string path = dir.file("sub/dir/tune.json");  // folders are created
  TuneCache c(key());
  c.put(entry(256, 4, 0.01));
  c.put(entry(512, 1, 0.02));
  c.put(entry(256, 4, 0.005));  // replaces
  c.save(path);
  std::string warning;
  auto back = TuneCache::load(path, key(), &warning);
  EXPECT_EQ(warning, "");
  ASSERT_EQ(back.entries().size(), 2u);
  const TuneEntry* e = back.find(256, 512, 4);
  ASSERT_NE(e, nullptr);
  EXPECT_DOUBLE_EQ(e->seconds, 0.005);
  EXPECT_EQ(e->options.algo, NsAlgo::gram);
  EXPECT_EQ(e->options.restarts, (std::vector<int>{1, 3}));
  EXPECT_EQ(e->options.batch_mode, NsBatchMode::concurrent);
  EXPECT_EQ(back.find(256, 512, 2), nullptr);
  EXPECT_EQ(back.to_json(), c.to_json());
}

// A missing file, or an empty one (nothing to lose), is an empty cache.
TEST(TuneCache, MissingOrEmptyFileIsEmptyWithoutWarning) {
  test::TempDir dir;
  write_file_atomically(dir.file("empty.json"), "");
  for (const char* name : {"none.json", "empty.json"}) {
    std::string warning;
    auto c = TuneCache::load(dir.file(name), key(), &warning);
    EXPECT_TRUE(c.entries().empty()) << name;
    EXPECT_EQ(warning, "") << name;
  }
}

TEST(TuneCache, CorruptFilesOfOursWarnAndStartEmpty) {
  test::TempDir dir;
  const std::string path = dir.file("tune.json");
  TuneCache good(key());
  good.put(entry(256, 1, 0.01));
  const std::string text = good.to_json();
  // name: (file text, warning, whether a save may replace the file)
  const std::map<std::string, std::tuple<std::string, std::string, bool>> cases = {
      {"truncated", {text.substr(0, text.size() / 2), "corrupt (not JSON)", true}},
      {"version", {std::string(text).replace(text.find("\"version\": 3"), 12, "\"version\": 9"), "version 9", false}},
      {"bad dtype", {std::string(text).replace(text.find("\"float32\""), 9, "\"float16\""), "corrupt", true}},
      {"not the key's dtype",  // the entries come first: an entry's dtype
       {std::string(text).replace(text.find("\"float32\""), 9, "\"bfloat16\""),
        "corrupt (an entry's dtype bfloat16 is not its setting's (float32)", true}},
      {"bad algo", {std::string(text).replace(text.find("\"gram\""), 6, "\"fast\""), "corrupt", true}},
      {"negative time", {std::string(text).replace(text.find("\"seconds\": "), 11, "\"seconds\": -"), "corrupt", true}},
  };
  for (const auto& [name, c] : cases) {
    write_file_atomically(path, std::get<0>(c));
    std::string warning;
    auto loaded = TuneCache::load(path, key(), &warning);
    EXPECT_TRUE(loaded.entries().empty()) << name;
    EXPECT_THAT(warning, HasSubstr(std::get<1>(c))) << name;
    EXPECT_THAT(warning, HasSubstr(path)) << name;
    EXPECT_EQ(warning.find('\n'), std::string::npos) << name;
    EXPECT_EQ(loaded.saveable(), std::get<2>(c)) << name;
  }
}

// A file that is not a tuning cache (notes, someone else's JSON) is not replaced: an error naming it,
// and the file keeps its bytes.
TEST(TuneCache, RefusesAFileThatIsNotATuningCache) {
  test::TempDir dir;
  for (const std::string& text : {std::string("my notes\n"), std::string(R"({"hello": 1})")}) {
    const std::string path = dir.file("notes.txt");
    write_file_atomically(path, text);
    std::string warning;
    try {
      TuneCache::load(path, key(), &warning);
      ADD_FAILURE() << "loaded " << text;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(path + " is not a dmuon tuning cache; refusing to replace it"));
    }
    EXPECT_EQ(read_file(path), text);
  }
}

// One file holds several settings: tuning for another thread count adds a setting beside the first
// instead of replacing it, and each key finds its own entries again.
TEST(TuneCache, KeepsEntriesOfSeveralKeysInOneFile) {
  test::TempDir dir;
  const std::string path = dir.file("tune.json");
  TuneCache two(key());
  two.put(entry(256, 1, 0.01));
  two.save(path);

  TuneKey one_thread = key();
  one_thread.threads = 1;
  std::string warning;
  TuneCache one = TuneCache::load(path, one_thread, &warning);
  EXPECT_TRUE(one.entries().empty());
  // One line naming what differs from the nearest setting the file has.
  EXPECT_THAT(warning, HasSubstr("has no entries for this setting (1 other setting(s); the nearest: threads 2 there, "
                                 "1 here)"));
  one.put(entry(128, 3, 0.002));
  one.save(path);

  warning.clear();
  const TuneCache again_two = TuneCache::load(path, key(), &warning);
  EXPECT_EQ(warning, "");
  ASSERT_EQ(again_two.entries().size(), 1u);
  EXPECT_NE(again_two.find(256, 512, 1), nullptr);
  EXPECT_EQ(again_two.other_keys(), 1u);
  const TuneCache again_one = TuneCache::load(path, one_thread, &warning);
  ASSERT_EQ(again_one.entries().size(), 1u);
  EXPECT_NE(again_one.find(128, 256, 3), nullptr);
  // Saving one setting writes the others back unchanged, in their place.
  EXPECT_EQ(again_one.to_json(), again_two.to_json());
}

// A GPU backend's key adds fields; they take part in matching and in what a mismatch names.
TEST(TuneCache, KeysWithExtraFieldsRoundTripAndDiffer) {
  test::TempDir dir;
  const std::string path = dir.file("tune.json");
  TuneKey gpu = key();
  gpu.device = "cuda";
  gpu.extra = {{"gpu", "NVIDIA H200"}, {"cuda", "13.0"}, {"cublas", "13.0.0"}};
  TuneCache c(gpu);
  c.put(entry(256, 1, 0.01));
  c.save(path);
  std::string warning;
  EXPECT_EQ(TuneCache::load(path, gpu, &warning).entries().size(), 1u);
  EXPECT_EQ(warning, "");
  TuneKey other = gpu;
  other.extra["cublas"] = "13.1.0";
  EXPECT_TRUE(TuneCache::load(path, other, &warning).entries().empty());
  EXPECT_THAT(warning, HasSubstr("cublas '13.0.0' there, '13.1.0' here"));
  EXPECT_EQ(describe_difference(key(), gpu), "device 'cpu' there, 'cuda' here; cublas none there, '13.0.0' here; "
                                             "cuda none there, '13.0' here; gpu none there, 'NVIDIA H200' here");
}

// A version 1 file (one key at the top level) is read, and rewritten as version 3.
TEST(TuneCache, ReadsVersionOneFiles) {
  test::TempDir dir;
  const std::string path = dir.file("tune.json");
  TuneCache c(key());
  c.put(entry(256, 4, 0.01));
  nlohmann::json v3 = nlohmann::json::parse(c.to_json());
  nlohmann::json v1 = {{"format", "dmuon-tune"}, {"version", 1}, {"key", v3["settings"][0]["key"]},
                       {"entries", v3["settings"][0]["entries"]}};
  v1["key"].erase("device");
  v1["entries"][0].erase("dtype");
  v1["entries"][0].erase("dtype_seconds");
  write_file_atomically(path, v1.dump(2));
  std::string warning;
  const TuneCache back = TuneCache::load(path, key(), &warning);
  EXPECT_EQ(warning, "");
  EXPECT_EQ(back.to_json(), c.to_json());
}

// Version 2 entries have no dtype: each ran in its setting's one dtype, which they take (a bf16 setting's entries
// are bf16). A setting whose dtype was chosen among several needs each entry's own: without it the file is corrupt,
// never read as float32. Version 3 keeps each entry's dtype and per-dtype times.
TEST(TuneCache, EntriesKeepTheirDtypeAndVersionTwoTakeTheirKeys) {
  test::TempDir dir;
  const std::string path = dir.file("tune.json");
  TuneKey bf16_key = key(), auto_key = key();
  bf16_key.dtype = tune_dtype_key({DType::bf16});
  auto_key.dtype = tune_dtype_key({DType::bf16, DType::f32});
  TuneCache bf16(bf16_key);
  TuneEntry e = entry(256, 4, 0.01);
  e.options.dtype = DType::bf16;
  bf16.put(e);
  nlohmann::json v2 = nlohmann::json::parse(bf16.to_json());
  v2["version"] = 2;
  v2["settings"][0]["entries"][0].erase("dtype");
  v2["settings"][0]["entries"][0].erase("dtype_seconds");
  write_file_atomically(path, v2.dump(2));
  std::string warning;
  TuneCache back = TuneCache::load(path, bf16_key, &warning);
  EXPECT_EQ(warning, "");
  ASSERT_EQ(back.entries().size(), 1u);
  EXPECT_EQ(back.entries()[0].options.dtype, DType::bf16);
  EXPECT_EQ(back.to_json(), bf16.to_json());

  v2["settings"][0]["key"]["dtype"] = auto_key.dtype;
  write_file_atomically(path, v2.dump(2));
  back = TuneCache::load(path, auto_key, &warning);
  EXPECT_TRUE(back.entries().empty());
  EXPECT_THAT(warning, HasSubstr("is corrupt (entry has no dtype"));

  TuneCache chosen(auto_key);
  e.options.dtype = DType::f32;
  e.dtype_seconds = {{DType::f32, 0.01}, {DType::bf16, 0.03}};
  chosen.put(e);
  chosen.save(path);
  warning.clear();
  back = TuneCache::load(path, auto_key, &warning);
  EXPECT_EQ(warning, "");
  ASSERT_EQ(back.entries().size(), 1u);
  EXPECT_EQ(back.entries()[0].options.dtype, DType::f32);
  EXPECT_EQ(back.entries()[0].dtype_seconds, e.dtype_seconds);
  EXPECT_EQ(tune_entries_from_json(tune_entries_to_json(back.entries()))[0].options, e.options);
}

TEST(TuneCache, DefaultPathFollowsXdg) {
  const char* old = std::getenv("XDG_CACHE_HOME");
  const std::string saved = old ? old : "";
  setenv("XDG_CACHE_HOME", "/tmp/xdg-test", 1);
  EXPECT_EQ(default_tune_cache_path(), "/tmp/xdg-test/dmuon/tune.json");
  unsetenv("XDG_CACHE_HOME");
  EXPECT_THAT(default_tune_cache_path(), HasSubstr("/.cache/dmuon/tune.json"));
  if (old) setenv("XDG_CACHE_HOME", saved.c_str(), 1);
}

// A fake clock: gram with restart [1,3], 2 tiles, concurrent is fastest; everything else slower.
double fake_measure(const NsOptions& o, int64_t rows, int64_t, int batch) {
  double t = 1e-9 * rows * batch;
  if (o.algo == NsAlgo::gram && o.restarts == std::vector<int>{1, 3} && o.tiles == 2 && o.symmetric &&
      o.batch_mode == NsBatchMode::concurrent)
    return t;
  return 2 * t;
}

TEST(TuneShapes, TunesMissingEntriesOnceAndReusesTheCache) {
  TuneCache cache(key());
  int calls = 0;
  MeasureFn counting = [&](const NsOptions& o, int64_t r, int64_t c, int b) {
    ++calls;
    return fake_measure(o, r, c, b);
  };
  std::vector<TuneRequest> req = {{512, 1024, 4}, {256, 256, 2}};
  auto first = tune_shapes(req, cache, counting, 2);
  ASSERT_EQ(first.size(), 2u);
  EXPECT_EQ(first[0].options.algo, NsAlgo::gram);
  EXPECT_EQ(first[0].options.tiles, 2);
  EXPECT_EQ(first[0].options.batch_mode, NsBatchMode::concurrent);
  EXPECT_DOUBLE_EQ(first[0].default_seconds / first[0].seconds, 2.0);
  EXPECT_GT(calls, 0);
  const int after_first = calls;
  auto second = tune_shapes(req, cache, counting, 2);
  EXPECT_EQ(calls, after_first);  // everything came from the cache
  EXPECT_EQ(describe(second[1].options), describe(first[1].options));
}

// Asked for no dtype on a CPU where bf16 competes: bf16 and float32 candidates compete in one selection, the untuned
// configuration in the CPU's default dtype pinned as the baseline; each (shape, batch) keeps the faster dtype, with each
// dtype's best time. The machine faked both ways: with AMX (default bf16) and with AVX-512 BF16 alone (default float32);
// on each a fake clock makes bf16 twice as fast on the 512-row shape and twice as slow on the 256-row one.
TEST(TuneShapes, ChoosesTheFasterDtypePerShape) {
  for (const bool amx : {true, false}) {
    SCOPED_TRACE(amx ? "AMX" : "AVX-512 BF16 without AMX");
    TuneCache cache(key());
    std::vector<NsOptions> timed;
    const MeasureFn clock = [&](const NsOptions& o, int64_t rows, int64_t cols, int batch) {
      timed.push_back(o);
      const bool bf16_faster = rows == 512;
      return fake_measure(o, rows, cols, batch) * ((o.dtype == DType::bf16) == bf16_faster ? 1 : 2);
    };
    const std::vector<DType> dtypes =
        auto_tune_dtypes(ns_default_dtype_rule(amx, nullptr), ns_bf16_candidate_rule(true, nullptr));
    const auto entries = tune_shapes({{512, 1024, 4}, {256, 256, 2}}, cache, clock, 2, 3, {}, dtypes);
    ASSERT_EQ(entries.size(), 2u);
    EXPECT_EQ(timed.front(), untuned_options(2, amx ? DType::bf16 : DType::f32));
    EXPECT_EQ(entries[0].options.dtype, DType::bf16);
    EXPECT_EQ(entries[1].options.dtype, DType::f32);
    for (const TuneEntry& e : entries) {
      const DType other = e.options.dtype == DType::bf16 ? DType::f32 : DType::bf16;
      EXPECT_EQ(e.dtype_seconds.at(e.options.dtype), e.seconds);
      EXPECT_DOUBLE_EQ(e.dtype_seconds.at(other), 2 * e.seconds);
    }
    EXPECT_EQ(cache.find(512, 1024, 4)->options.dtype, DType::bf16);
    EXPECT_EQ(cache.find(256, 256, 2)->options.dtype, DType::f32);
  }
}

// On a CPU without bf16 instructions that oneDNN uses (AVX2, faked) the tuner never times bf16: every candidate is
// float32, and so is every choice.
TEST(TuneShapes, WithoutBf16InstructionsOnlyFloat32IsTimed) {
  TuneCache cache(key());
  const std::vector<DType> dtypes =
      auto_tune_dtypes(ns_default_dtype_rule(false, nullptr), ns_bf16_candidate_rule(false, nullptr));
  int bf16_timings = 0;
  const MeasureFn clock = [&](const NsOptions& o, int64_t rows, int64_t cols, int batch) {
    bf16_timings += o.dtype == DType::bf16;
    return fake_measure(o, rows, cols, batch) / (o.dtype == DType::bf16 ? 100 : 1);  // bf16 would win
  };
  const auto entries = tune_shapes({{512, 1024, 4}, {256, 256, 2}}, cache, clock, 2, 3, {}, dtypes);
  EXPECT_EQ(bf16_timings, 0);
  for (const TuneEntry& e : entries) {
    EXPECT_EQ(e.options.dtype, DType::f32);
    EXPECT_TRUE(e.dtype_seconds.empty());
  }
}

TEST(TuneShapes, RequestsAreTheBatchesThePlannerAsksFor) {
  const std::vector<ParamSpec> params = {{"a", {64, 128}, ParamRole::matrix, 1},
                                         {"b", {64, 128}, ParamRole::matrix, 2},
                                         {"c", {64, 128}, ParamRole::matrix, 3},
                                         {"n", {64}, ParamRole::elementwise, 1},
                                         {"d", {32, 32}, ParamRole::matrix, 1}};
  auto req = tune_requests(params, 2);
  ASSERT_EQ(req.size(), 2u);
  EXPECT_EQ(req[0].rows, 32);
  EXPECT_EQ(req[0].batch, 1);
  EXPECT_EQ(req[1].rows, 64);
  EXPECT_EQ(req[1].batch, 2);  // 3 matrices on 2 ranks
  // The planner's items under tuned costs: per-matrix share of the tuned batch time.
  TuneCache cache(key());
  auto entries = tune_shapes(req, cache, fake_measure, 2);
  auto items = make_plan_items(params, 2, tuned_batch_time(entries));
  EXPECT_DOUBLE_EQ(items[0].time_s, entries[1].seconds / 2);
  EXPECT_THAT([&] { tuned_batch_time(entries)(64, 128, 3); },
              ::testing::ThrowsMessage<Error>(HasSubstr("no tuned time for shape 64x128 batch 3")));
  // c split for Newton-Schulz in 2 row blocks of 32x128: the requests the planner's items then ask about.
  std::vector<std::vector<MatrixBlock>> blocks(params.size());
  blocks[2] = {{0, 0, 32, 128}, {32, 0, 32, 128}};
  const auto split = tune_requests(params, 2, blocks);
  ASSERT_EQ(split.size(), 3u);
  EXPECT_EQ(std::make_tuple(split[0].rows, split[0].cols, split[0].batch), std::make_tuple(32, 32, 1));
  EXPECT_EQ(std::make_tuple(split[1].rows, split[1].cols, split[1].batch), std::make_tuple(32, 128, 1));
  EXPECT_EQ(std::make_tuple(split[2].rows, split[2].cols, split[2].batch), std::make_tuple(64, 128, 1));  // a, b
  const auto split_entries = tune_shapes(split, cache, fake_measure, 2);
  const auto split_items = make_plan_items(params, 2, tuned_batch_time(split_entries), blocks);
  EXPECT_DOUBLE_EQ(split_items[2].time_s, 2 * split_entries[1].seconds);
}

// The real clock on a tiny shape: every candidate (the untuned configuration and each of
// tune_candidates) runs through the NS engine, and the entry reports what the clock measured: the
// winner's time is the least of all timings, taken by the configuration it names, and default_seconds
// is the untuned configuration's own time.
TEST(TuneShapes, RealTimerRunsEveryCandidateAndReportsItsTimes) {
  TuneCache cache(key());
  const MeasureFn timer = make_ns_timer();
  std::vector<std::pair<NsOptions, double>> timed;
  const MeasureFn recording = [&](const NsOptions& o, int64_t rows, int64_t cols, int batch) {
    timed.emplace_back(o, timer(o, rows, cols, batch));
    return timed.back().second;
  };
  const auto entries = tune_shapes({{24, 40, 2}}, cache, recording, 2, 1);
  ASSERT_EQ(entries.size(), 1u);
  std::vector<NsOptions> expected = {untuned_options(2)};
  for (const NsOptions& o : tune_candidates(24, 40, 2, 2)) expected.push_back(o);
  ASSERT_EQ(timed.size(), expected.size());  // one round: each candidate once, in order
  double fastest = INFINITY;
  for (size_t i = 0; i < timed.size(); ++i) {
    EXPECT_EQ(timed[i].first, expected[i]) << i;
    EXPECT_GT(timed[i].second, 0) << describe(timed[i].first);
    fastest = std::min(fastest, timed[i].second);
  }
  EXPECT_EQ(entries[0].seconds, fastest);
  EXPECT_EQ(entries[0].default_seconds, timed[0].second);
  const auto winner = std::find_if(timed.begin(), timed.end(), [&](const auto& t) { return t.second == fastest; });
  EXPECT_EQ(entries[0].options, winner->first);
}

// The device clock never times a candidate's first run: on a GPU that run captures the candidate's CUDA graph. On
// the fenced device (which records a graph on a key's first run_graph and replays it after, as CUDA does) every
// timed run of every candidate replays all its graphs: each candidate was run once, untimed, before its first
// timing. (A run is one graph per chunk of the batch: batch / preferred_batch of them.)
TEST(TuneShapes, DeviceTimerWarmsEachCandidateBeforeTimingIt) {
  test::FencedBackend device;
  const MeasureFn timer = make_ns_timer(device);
  const int batch = 2;
  const std::vector<NsOptions> candidates = tune_candidates(24, 40, batch, 1);
  ASSERT_GE(candidates.size(), 2u);
  const int64_t graphs_per_run = (batch + device.preferred_batch() - 1) / device.preferred_batch();
  for (int round = 0; round < 2; ++round) {
    for (const NsOptions& o : candidates) {
      const int64_t before = device.graphs_replayed();
      EXPECT_GT(timer(o, 24, 40, batch), 0) << describe(o);
      EXPECT_GE(device.graphs_replayed() - before, graphs_per_run) << "round " << round << ", " << describe(o);
    }
  }
}

// The tuned choice: exact (shape, batch), else the nearest batch of that shape (ties: the smaller),
// else the defaults; the defaults' math (steps, coeffs) always stays.
TEST(TunedOptions, PicksTheEntryOfTheShapeAndNearestBatch) {
  std::vector<TuneEntry> entries(3);
  entries[0].rows = 16, entries[0].cols = 32, entries[0].batch = 1;
  entries[0].options.algo = NsAlgo::standard;
  entries[1].rows = 16, entries[1].cols = 32, entries[1].batch = 3;
  entries[1].options.algo = NsAlgo::gram, entries[1].options.restarts = {1, 3};
  entries[2].rows = 32, entries[2].cols = 16, entries[2].batch = 2;
  entries[2].options.symmetric = false;
  NsOptions defaults;
  defaults.steps = 7;
  defaults.threads = 2;
  EXPECT_EQ(tuned_options(entries, 16, 32, 1, defaults).algo, NsAlgo::standard);
  EXPECT_EQ(tuned_options(entries, 16, 32, 3, defaults).restarts, (std::vector<int>{1, 3}));
  EXPECT_EQ(tuned_options(entries, 16, 32, 2, defaults).algo, NsAlgo::standard);  // tie: batch 1
  EXPECT_EQ(tuned_options(entries, 16, 32, 9, defaults).restarts, (std::vector<int>{1, 3}));
  EXPECT_EQ(tuned_options(entries, 16, 32, 9, defaults).steps, 7);
  EXPECT_EQ(tuned_options(entries, 16, 32, 9, defaults).threads, 0);  // the entry's threads
  EXPECT_FALSE(tuned_options(entries, 32, 16, 5, defaults).symmetric);
  EXPECT_EQ(tuned_options(entries, 16, 16, 1, defaults), defaults);  // shape not tuned
}

// The tuned Orthogonalizer runs exactly newton_schulz_batched with the chosen options: bit-identical
// to that call, and different from the defaults' kernel, so the choice is really applied.
TEST(TunedOptions, OrthogonalizerRunsTheChosenKernel) {
  const int64_t rows = 24, cols = 40;
  std::vector<float> u(2 * rows * cols);
  for (size_t i = 0; i < u.size(); ++i) u[i] = static_cast<float>(std::sin(0.37 * i + 0.1 * (i % 7)));
  auto run = [&](const Orthogonalizer& orth) {
    std::vector<float> o(u.size());
    const std::vector<MatView> in = {f32_view(DeviceKind::cpu, u.data(), rows, cols),
                                     f32_view(DeviceKind::cpu, u.data() + rows * cols, rows, cols)};
    const std::vector<MatView> out = {f32_view(DeviceKind::cpu, o.data(), rows, cols),
                                      f32_view(DeviceKind::cpu, o.data() + rows * cols, rows, cols)};
    orth(cpu_backend(), in, out, {}, nullptr);
    return o;
  };
  TuneEntry e;
  e.rows = rows, e.cols = cols, e.batch = 2;
  e.options.algo = NsAlgo::standard;
  e.options.symmetric = false;
  NsOptions defaults;
  defaults.algo = NsAlgo::gram;
  NsOptions chosen = defaults;
  chosen.algo = NsAlgo::standard;
  chosen.symmetric = false;
  chosen.tiles = e.options.tiles;
  const auto tuned = run(tuned_orthogonalizer({e}, defaults));
  EXPECT_EQ(tuned, run(ns_orthogonalizer(chosen)));
  EXPECT_NE(tuned, run(ns_orthogonalizer(defaults)));
  // adjust edits the choice: back to Gram gives the defaults' kernel.
  EXPECT_EQ(run(tuned_orthogonalizer({e}, defaults, [](NsOptions& o) { o.algo = NsAlgo::gram, o.symmetric = true; })),
            run(ns_orthogonalizer(defaults)));
}

// Deterministic given the cache: a cache written by hand for a caller that asks for no dtype (bf16 and float32 timed)
// makes each shape run in the dtype it names, bit for bit the run of that dtype chosen explicitly with the same
// kernel, and times nothing (tune_with_cache finds every entry).
TEST(TunedOptions, HandWrittenCacheChoosesEachShapesDtype) {
  if (!cpu_backend().supports(DType::bf16)) GTEST_SKIP() << "no oneDNN: the CPU computes in float32 only";
  const int64_t rows = 24, cols = 40;
  std::vector<float> u(rows * cols);
  for (size_t i = 0; i < u.size(); ++i) u[i] = static_cast<float>(std::sin(0.37 * i + 0.1 * (i % 7)));
  auto run = [&](const Orthogonalizer& orth) {
    std::vector<float> o(u.size());
    const std::vector<MatView> in = {f32_view(DeviceKind::cpu, u.data(), rows, cols)};
    const std::vector<MatView> out = {f32_view(DeviceKind::cpu, o.data(), rows, cols)};
    orth(cpu_backend(), in, out, {}, nullptr);
    return o;
  };
  test::TempDir dir;
  TuneSessionOptions session;
  session.cache_path = dir.file("tune.json");
  session.threads = 1;
  session.dtypes = {DType::bf16, DType::f32};
  session.warn = [](const std::string& warning) { ADD_FAILURE() << warning; };
  session.progress = [](size_t, size_t, const std::string& what) {
    EXPECT_THAT(what, HasSubstr("(cached)")) << "timed " << what;
  };
  TuneKey k = current_tune_key(1);
  k.dtype = "bfloat16 or float32";
  std::map<DType, std::vector<float>> results;
  for (const DType chosen : {DType::f32, DType::bf16}) {
    const nlohmann::json file = {
        {"format", "dmuon-tune"},
        {"version", 3},
        {"settings",
         {{{"key", {{"device", "cpu"}, {"cpu", k.cpu}, {"blas", k.blas}, {"threads", 1}, {"dtype", k.dtype}}},
           {"entries",
            {{{"rows", rows}, {"cols", cols}, {"batch", 1}, {"algo", "gram"}, {"restarts", {1, 3}},
              {"symmetric", true}, {"tiles", 1}, {"batch_mode", "sequential"}, {"threads", 1},
              {"dtype", to_string(chosen)}, {"seconds", 1.0}, {"default_seconds", 2.0},
              {"dtype_seconds", {{"float32", 1.0}, {"bfloat16", 1.5}}}}}}}}}};
    write_file_atomically(session.cache_path, file.dump(2));
    const auto entries = tune_with_cache({{rows, cols, 1}}, session);
    ASSERT_EQ(entries.size(), 1u);
    ASSERT_EQ(entries[0].options.dtype, chosen);
    NsOptions explicit_choice;
    explicit_choice.algo = NsAlgo::gram;
    explicit_choice.restarts = {1, 3};
    explicit_choice.tiles = 1;
    explicit_choice.threads = 1;
    explicit_choice.dtype = chosen;
    results[chosen] = run(tuned_orthogonalizer(entries, untuned_options(1, DType::bf16)));
    EXPECT_EQ(results[chosen], run(ns_orthogonalizer(explicit_choice))) << to_string(chosen);
  }
  EXPECT_NE(results[DType::f32], results[DType::bf16]);  // the dtype really changed what ran
}

TEST(TuneKey, NamesThisMachine) {
  auto k = current_tune_key(3);
  EXPECT_FALSE(k.cpu.empty());
  EXPECT_THAT(k.blas, HasSubstr("OpenBLAS"));
  EXPECT_EQ(k.threads, 3);
  EXPECT_EQ(k.dtype, "float32");
}

}  // namespace
}  // namespace dmuon
