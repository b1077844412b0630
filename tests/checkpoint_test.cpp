// Checkpoints in one process: bit-identical resume, re-sharding (slices saved by "ranks" that hold
// parts of each tensor, loaded whole, and the reverse), and refusal of corrupt, truncated or
// mismatched folders without touching memory.
#include "dmuon/checkpoint.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
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
                 "rank-00000.json: malformed JSON");
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
      },
      "rank-00000.safetensors: truncated safetensors file");
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

}  // namespace
}  // namespace dmuon
