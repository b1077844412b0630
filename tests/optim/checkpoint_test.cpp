// Checkpoints in one process: bit-identical resume, re-sharding (slices saved by "ranks" that hold
// parts of each tensor, loaded whole, and the reverse), and refusal of corrupt, truncated or
// mismatched folders without touching memory.
#include "dmuon/checkpoint.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "dmuon/atomic_file.hpp"
#include "dmuon/checksum.hpp"
#include "dmuon/error.hpp"
#include "dmuon/npy.hpp"
#include "reference_orthogonalizer.hpp"
#include "test_data.hpp"
#include "toy_model.hpp"

namespace dmuon {
namespace {

// A model of two matrices and two vectors.
struct Model : test::ToyModel {
  explicit Model(uint32_t seed)
      : ToyModel({{"w1", {5, 3}, ParamRole::matrix, 0},
                  {"w2", {3, 4}, ParamRole::matrix, 0},
                  {"bias", {7}, ParamRole::elementwise, 0},
                  {"gain", {4}, ParamRole::elementwise, 0}},
                 seed) {}
};

OptimizerOptions test_options() {
  OptimizerOptions o;
  o.muon.weight_decay = 0.01;
  o.adamw.weight_decay = 0.1;
  return o;
}

void run(Optimizer& o, Model& m, int from, int to) {
  for (int t = from; t < to; ++t) {
    m.set_grads(t);
    ASSERT_TRUE(o.step());
  }
}

// The published FNV-1a 64 test vectors (http://www.isthe.com/chongo/tech/comp/fnv/): every user of the
// hash (checkpoint checksums, the GPT example's per-parameter streams, cross-rank checks) shares them.
TEST(Checksum, Fnv1a64MatchesKnownAnswers) {
  EXPECT_EQ(fnv1a64(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a64("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a64("foobar"), 0x85944171f73967e8ull);
  EXPECT_EQ(fnv1a64_hex("a"), "af63dc4c8601ec8c");
  EXPECT_EQ(fnv1a64("bar", fnv1a64("foo")), fnv1a64("foobar"));  // continuing a hash
  const int64_t values[2] = {3, -7};
  std::string bytes(sizeof values, '\0');
  std::memcpy(bytes.data(), values, sizeof values);
  EXPECT_EQ(fnv1a64_values(values, 2), fnv1a64(bytes));
}

TEST(Checkpoint, SaveReloadContinueIsBitIdentical) {
  test::TempDir dir;
  Model straight(1), first(1), resumed(99);
  Optimizer os(straight.refs(), test_options(), test::reference_orthogonalizer());
  run(os, straight, 0, 8);
  Optimizer of(first.refs(), test_options(), test::reference_orthogonalizer());
  run(of, first, 0, 4);
  save_checkpoint(dir.path(), of);
  Optimizer orr(resumed.refs(), test_options(), test::reference_orthogonalizer());
  load_checkpoint(dir.path(), orr);
  EXPECT_EQ(orr.updates(), 4);
  run(orr, resumed, 4, 8);
  for (size_t p = 0; p < straight.values.size(); ++p) EXPECT_EQ(resumed.values[p], straight.values[p]) << p;
  EXPECT_EQ(orr.updates(), os.updates());
}

// AdamW that believes it is rank r of w and holds that rank's even slice of every tensor.
class PretendRank : public AdamW {
 public:
  PretendRank(Model& m, int r, int w) : AdamW(m.slice_refs(r, w), test_options()) {
    rank_ = r;
    world_size_ = w;
  }
};

TEST(Checkpoint, ReshardsThreeRanksToOneAndOneToTwo) {
  test::TempDir three, one;
  Model straight(2), sharded(2), whole(50), halves(60);
  AdamW os(straight.refs(), test_options());
  run(os, straight, 0, 6);
  {
    // Three "ranks" update their slices of the same buffers: elementwise AdamW makes this equal to one.
    std::vector<std::unique_ptr<PretendRank>> ranks;
    for (int r = 0; r < 3; ++r) ranks.push_back(std::make_unique<PretendRank>(sharded, r, 3));
    for (int t = 0; t < 3; ++t) {
      sharded.set_grads(t);
      for (auto& r : ranks) ASSERT_TRUE(r->step());
    }
    for (int r = 2; r >= 0; --r) save_checkpoint(three.path(), *ranks[r]);  // rank 0 last writes the index
  }
  AdamW ow(whole.refs(), test_options());
  load_checkpoint(three.path(), ow);
  save_checkpoint(one.path(), ow);
  std::vector<std::unique_ptr<PretendRank>> two;
  for (int r = 0; r < 2; ++r) {
    two.push_back(std::make_unique<PretendRank>(halves, r, 2));
    load_checkpoint(one.path(), *two.back());
  }
  run(ow, whole, 3, 6);
  for (int t = 3; t < 6; ++t) {
    halves.set_grads(t);
    for (auto& r : two) ASSERT_TRUE(r->step());
  }
  for (size_t p = 0; p < straight.values.size(); ++p) {
    EXPECT_EQ(whole.values[p], straight.values[p]) << p;
    EXPECT_EQ(halves.values[p], straight.values[p]) << p;
  }
}

// Saves a 3-step checkpoint, lets `damage` spoil it, and expects a load to fail with a message
// containing `expected` and to leave a fresh model untouched.
void expect_refused(const std::function<void(const std::string&)>& damage, const std::string& expected,
                    OptimizerOptions load_options = test_options(), bool other_shape = false) {
  test::TempDir dir;
  Model m(3);
  Optimizer o(m.refs(), test_options(), test::reference_orthogonalizer());
  run(o, m, 0, 3);
  save_checkpoint(dir.path(), o);
  damage(dir.path());
  Model fresh(4);
  if (other_shape) fresh.specs[1].shape = {4, 3};
  const auto before = fresh.values;
  Optimizer of(fresh.refs(), load_options, test::reference_orthogonalizer());
  try {
    load_checkpoint(dir.path(), of);
    ADD_FAILURE() << "load succeeded; expected an error containing: " << expected;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
  }
  EXPECT_EQ(fresh.values, before);
  EXPECT_EQ(of.updates(), 0);
}

// After a test edits a manifest on purpose: lists its new size and checksum in the index and gives
// the index its new checksum, as a save would have (checkpoint.hpp), so the edit reaches the checks
// behind the checksums.
void reseal(const std::string& dir) {
  nlohmann::json index = nlohmann::json::parse(read_file(dir + "/index.json"));
  for (auto& entry : index["manifests"]) {
    const std::string bytes = read_file(dir + "/" + entry["file"].get<std::string>());
    entry["bytes"] = bytes.size();
    entry["fnv1a64"] = fnv1a64_hex(bytes);
  }
  index.erase("index_fnv1a64");
  index["index_fnv1a64"] = fnv1a64_hex(index.dump());
  write_file_atomically(dir + "/index.json", index.dump(1));
}

void flip_byte(const std::string& path, size_t from_end) {
  std::string bytes = read_file(path);
  bytes[bytes.size() - from_end] ^= 0x10;
  write_file_atomically(path, bytes);
}

TEST(Checkpoint, RefusesCorruptTruncatedAndMismatched) {
  const auto nothing = [](const std::string&) {};
  expect_refused([](const std::string& d) { flip_byte(d + "/rank-00000.safetensors", 3); },
                 "rank-00000.safetensors: checksum mismatch");
  expect_refused([](const std::string& d) { std::filesystem::remove(d + "/index.json"); }, "index.json: missing");
  expect_refused([](const std::string& d) { write_file_atomically(d + "/rank-00000.json", "{\"file\": 3"); },
                 "rank-00000.json: 10 bytes, the index says");
  expect_refused(
      [](const std::string& d) {
        write_file_atomically(d + "/rank-00000.json", "{\"file\": 3");
        reseal(d);
      },
      "rank-00000.json: not valid JSON");
  // A model whose w2 is 4×3 instead of 3×4: the file and tensor are named.
  expect_refused(nothing, "rank-00000.safetensors: tensor 'param/w2@0' has shape [3, 4], the model's 'w2' has [4, 3]",
                 test_options(), true);
  // Parameter groups changed since the save: w1 now takes AdamW, whose state the checkpoint lacks.
  OptimizerOptions moved = test_options();
  moved.rules = {{"w1", OptimGroup::adamw}};
  expect_refused(nothing, "has no adamw.m for parameter 'w1'", moved);
}

TEST(Checkpoint, RefusesTruncationNamingTheFile) {
  expect_refused(
      [](const std::string& d) {
        const std::string b = read_file(d + "/rank-00000.safetensors");
        write_file_atomically(d + "/rank-00000.safetensors", b.substr(0, b.size() - 10));
      },
      "bytes, the manifest says");
  // A truncated file whose manifest was rewritten to match still fails the safetensors validation.
  expect_refused(
      [](const std::string& d) {
        const std::string b = read_file(d + "/rank-00000.safetensors").substr(0, 200);
        write_file_atomically(d + "/rank-00000.safetensors", b);
        std::string j = read_file(d + "/rank-00000.json");
        auto patch = [&](const std::string& key, const std::string& value) {
          const size_t at = j.find("\"" + key + "\": ") + key.size() + 4;
          j.replace(at, j.find_first_of(",\n", at) - at, value);
        };
        patch("bytes", "200");
        patch("fnv1a64", "\"" + fnv1a64_hex(b) + "\"");
        write_file_atomically(d + "/rank-00000.json", j);
        reseal(d);
      },
      "rank-00000.safetensors: truncated safetensors file");
}

// Replaces the shape that rank 0's manifest gives the weights of parameter `param`.
void set_manifest_shape(const std::string& dir, const std::string& param, const std::vector<int64_t>& shape) {
  nlohmann::json j = nlohmann::json::parse(read_file(dir + "/rank-00000.json"));
  for (auto& slice : j["slices"]) {
    if (slice["param"] == param && slice["kind"] == "param") slice["shape"] = shape;
  }
  write_file_atomically(dir + "/rank-00000.json", j.dump(1));
  reseal(dir);
}

// One character of `path` replaced: the first occurrence of `from` (which must be there) by `to`.
void replace_once(const std::string& path, const std::string& from, const std::string& to) {
  std::string text = read_file(path);
  const size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos) << from << " not in " << path << ":\n" << text;
  text.replace(at, from.size(), to);
  write_file_atomically(path, text);
}

// Every byte that affects a loaded value is under a checksum: a flipped digit in the index's step
// counter, in a manifest's shape or offset, or in the data file's JSON header is refused, naming
// the file (without the index's own checksum, "updates": 3 -> 4 loaded as step 4).
TEST(Checkpoint, RefusesAFlippedDigitInTheIndexAManifestOrAHeader) {
  expect_refused([](const std::string& d) { replace_once(d + "/index.json", "\"updates\": 3", "\"updates\": 4"); },
                 "index.json: checksum mismatch");
  expect_refused([](const std::string& d) { replace_once(d + "/index.json", "\"world_size\": 1", "\"world_size\": 2"); },
                 "index.json: checksum mismatch");
  expect_refused([](const std::string& d) { replace_once(d + "/rank-00000.json", "\"offset\": 0", "\"offset\": 1"); },
                 "rank-00000.json: checksum mismatch");
  expect_refused([](const std::string& d) { replace_once(d + "/rank-00000.json", "   5,\n", "   6,\n"); },
                 "rank-00000.json: checksum mismatch");
  expect_refused(
      [](const std::string& d) { replace_once(d + "/rank-00000.safetensors", "\"shape\":[7]", "\"shape\":[6]"); },
      "rank-00000.safetensors: checksum mismatch");
}

TEST(Checkpoint, RefusesCraftedManifestShapes) {
  // 2^32 · 2^32 wraps to 0 elements unchecked; 2^62 + 1 elements cannot be allocated.
  for (const std::vector<int64_t>& shape :
       {std::vector<int64_t>{int64_t{1} << 32, int64_t{1} << 32}, {(int64_t{1} << 62) + 1, 1}}) {
    const std::string expected = "rank-00000.json: tensor 'param/bias@0': shape [" + std::to_string(shape[0]) + ", " +
                                 std::to_string(shape[1]) + "] has more than 2^40 elements";
    expect_refused([&](const std::string& d) { set_manifest_shape(d, "bias", shape); }, expected);
    test::TempDir dir;
    Model m(8);
    Optimizer o(m.refs(), test_options(), test::reference_orthogonalizer());
    save_checkpoint(dir.path(), o);
    set_manifest_shape(dir.path(), "bias", shape);
    try {
      export_checkpoint_npy(dir.path(), dir.file("out"));
      ADD_FAILURE() << "export accepted shape [" << shape[0] << ", " << shape[1] << "]";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  }
  // Within bounds, but 2^39 elements when the files hold 7: refused before 2 TiB are allocated.
  test::TempDir dir;
  Model m(8);
  Optimizer o(m.refs(), test_options(), test::reference_orthogonalizer());
  save_checkpoint(dir.path(), o);
  set_manifest_shape(dir.path(), "bias", {int64_t{1} << 39});
  try {
    read_checkpoint_tensors(dir.path(), "param");
    ADD_FAILURE() << "read a 2^39-element tensor from 7 saved values";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds 7 of the 549755813888 elements of param 'bias'"), std::string::npos)
        << e.what();
  }
}

// AdamW whose other "ranks" report a failure at the n-th collective agreement after arm(n): a save
// then looks, on rank 0, as when another rank could not write its files.
class OtherRankFails : public AdamW {
 public:
  explicit OtherRankFails(Model& m) : AdamW(m.refs(), test_options()) {}
  void arm(int n) { countdown_ = n; }
  void sum_across_ranks(std::span<double> values) override {
    if (countdown_ > 0 && --countdown_ == 0) values[0] += 1;
  }

 private:
  int countdown_ = 0;
};

// Loads `dir` into a fresh model and returns its values and the optimizer's update count.
std::pair<std::vector<std::vector<float>>, int64_t> loaded(const std::string& dir) {
  Model fresh(77);
  AdamW o(fresh.refs(), test_options());
  load_checkpoint(dir, o);
  return {fresh.values, o.updates()};
}

TEST(Checkpoint, FailedSaveKeepsTheOldCheckpoint) {
  test::TempDir dir;
  const std::string ck = dir.file("ck");
  Model m(9);
  OtherRankFails o(m);
  run(o, m, 0, 2);
  save_checkpoint(ck, o);
  const auto saved = m.values;
  run(o, m, 2, 4);
  // Agreement 1 prepares the folder, 2 follows every rank's writes: another rank failed to write.
  o.arm(2);
  EXPECT_THROW(save_checkpoint(ck, o), Error);
  auto [values, updates] = loaded(ck);
  EXPECT_EQ(updates, 2);
  EXPECT_EQ(values, saved);
  // The next save succeeds over the debris and leaves no sibling folders.
  save_checkpoint(ck, o);
  std::tie(values, updates) = loaded(ck);
  EXPECT_EQ(updates, 4);
  EXPECT_EQ(values, m.values);
  EXPECT_FALSE(std::filesystem::exists(ck + ".new"));
  EXPECT_FALSE(std::filesystem::exists(ck + ".old"));
}

// A save that died between its two renames leaves <ck>.old (old) and <ck>.new (new, complete) and no
// <ck>: loading takes the new one, or the old one when the new is gone; the next save restores <ck>.
TEST(Checkpoint, LoadsAroundASwapInterruptedBetweenItsRenames) {
  test::TempDir dir;
  const std::string ck = dir.file("ck");
  Model m(10);
  AdamW o(m.refs(), test_options());
  run(o, m, 0, 1);
  save_checkpoint(ck, o);
  run(o, m, 1, 3);
  save_checkpoint(dir.file("newer"), o);
  std::filesystem::rename(ck, ck + ".old");
  std::filesystem::rename(dir.file("newer"), ck + ".new");
  EXPECT_EQ(loaded(ck).second, 3);
  std::filesystem::remove_all(ck + ".new");
  EXPECT_EQ(loaded(ck + "/").second, 1);
  run(o, m, 3, 4);
  save_checkpoint(ck, o);
  EXPECT_EQ(loaded(ck).second, 4);
  EXPECT_FALSE(std::filesystem::exists(ck + ".old"));
}

TEST(Checkpoint, RefusesToReplaceAFolderThatIsNotACheckpoint) {
  test::TempDir dir;
  write_file_atomically(dir.file("notes.txt"), "keep me");
  Model m(11);
  AdamW o(m.refs(), test_options());
  try {
    save_checkpoint(dir.path(), o);
    ADD_FAILURE() << "saved over a folder holding notes.txt";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds 'notes.txt', which is not part of a checkpoint"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(read_file(dir.file("notes.txt")), "keep me");
  // Nor the sibling folders a save writes into and removes.
  for (const std::string sibling : {"ck.new", "ck.old"}) {
    std::filesystem::create_directories(dir.file(sibling));
    write_file_atomically(dir.file(sibling + "/notes.txt"), "keep me");
    EXPECT_THROW(save_checkpoint(dir.file("ck"), o), Error) << sibling;
    EXPECT_EQ(read_file(dir.file(sibling + "/notes.txt")), "keep me");
    std::filesystem::remove_all(dir.file(sibling));
  }
  save_checkpoint(dir.file("ck"), o);
}

TEST(Checkpoint, RefusesParametersTheModelLacks) {
  test::TempDir dir;
  Model m(5);
  Optimizer o(m.refs(), test_options(), test::reference_orthogonalizer());
  save_checkpoint(dir.path(), o);
  Model smaller(6);
  smaller.specs.pop_back();
  smaller.values.pop_back();
  smaller.grads.pop_back();
  Optimizer os(smaller.refs(), test_options(), test::reference_orthogonalizer());
  EXPECT_THROW(
      {
        try {
          load_checkpoint(dir.path(), os);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("parameter 'gain', which the model does not have"), std::string::npos)
              << e.what();
          throw;
        }
      },
      Error);
}

TEST(Checkpoint, ReadsWholeTensorsForExport) {
  test::TempDir dir;
  Model m(7);
  Optimizer o(m.refs(), test_options(), test::reference_orthogonalizer());
  run(o, m, 0, 2);
  save_checkpoint(dir.path(), o);
  const auto params = read_checkpoint_tensors(dir.path(), "param");
  ASSERT_EQ(params.size(), 4u);
  EXPECT_EQ(params.at("w2").shape, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(params.at("w2").data, m.values[1]);
  // And as .npy files.
  EXPECT_EQ(export_checkpoint_npy(dir.path(), dir.file("npy")), 4u);
  for (size_t p = 0; p < m.specs.size(); ++p) {
    const NpyArray a = read_npy(dir.file("npy/" + m.specs[p].name + ".npy"));
    EXPECT_EQ(a.shape, m.specs[p].shape);
    EXPECT_EQ(a.data, m.values[p]);
  }
  EXPECT_THROW(export_checkpoint_npy(dir.file("nothing"), dir.file("out")), Error);
}

// A name that cannot be a file name is found before anything is written: no half-exported folder.
TEST(Checkpoint, ExportChecksEveryNameBeforeWriting) {
  test::TempDir dir;
  test::ToyModel m({{"a", {2}, ParamRole::elementwise, 0}, {"z/../../escape", {3}, ParamRole::elementwise, 0}}, 12);
  AdamW o(m.refs(), test_options());
  save_checkpoint(dir.file("ck"), o);
  try {
    export_checkpoint_npy(dir.file("ck"), dir.file("out"));
    ADD_FAILURE() << "exported a parameter named z/../../escape";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 'z/../../escape' cannot be a file name"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(dir.file("out")));
}

}  // namespace
}  // namespace dmuon
