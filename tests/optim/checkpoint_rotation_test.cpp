// A folder of periodic checkpoints (checkpoint_rotation.hpp): the newest complete one is found past
// debris of a save that died, pruning keeps the newest K and nothing else of the folder's, a folder
// without a complete checkpoint is an error naming it, and a --save folder holding anything but
// step-N checkpoints is refused before any save.
#include "dmuon/checkpoint_rotation.hpp"

#include <gtest/gtest.h>

#include <filesystem>

#include "dmuon/atomic_file.hpp"
#include "dmuon/checkpoint.hpp"
#include "dmuon/error.hpp"
#include "test_data.hpp"
#include "toy_model.hpp"

namespace dmuon {
namespace {

namespace fs = std::filesystem;

struct Saver {
  test::ToyModel model{{{"w", {3, 2}, ParamRole::elementwise, 0}, {"b", {5}, ParamRole::elementwise, 0}}, 7};
  AdamW optimizer{model.refs(), OptimizerOptions{}};
  // Steps the optimizer to `step` updates and saves it as that step's checkpoint in `dir`.
  std::string save(const std::string& dir, int64_t step) {
    while (optimizer.updates() < step) {
      model.set_grads(static_cast<int>(optimizer.updates()));
      optimizer.step();
    }
    const std::string path = checkpoint_for_step(dir, step);
    save_checkpoint(path, optimizer);
    return path;
  }
};

int64_t loaded_updates(const std::string& path) {
  test::ToyModel fresh{{{"w", {3, 2}, ParamRole::elementwise, 0}, {"b", {5}, ParamRole::elementwise, 0}}, 8};
  AdamW o(fresh.refs(), OptimizerOptions{});
  load_checkpoint(path, o);
  return o.updates();
}

TEST(CheckpointRotation, NamesFoldersByStepAndFindsTheNewestCompleteOne) {
  test::TempDir dir;
  Saver s;
  EXPECT_EQ(checkpoint_for_step(dir.path(), 120), dir.path() + "/step-00000120");
  s.save(dir.path(), 2);
  s.save(dir.path(), 10);  // 10 > 9 numerically, though "step-00000010" sorts after "step-00000009" anyway
  s.save(dir.path(), 9);
  // Debris of a save of step 12 that died before its index: not a checkpoint.
  fs::create_directories(dir.file("step-00000012.new"));
  write_file_atomically(dir.file("step-00000012.new/rank-00000.json"), "{}");
  EXPECT_EQ(newest_checkpoint(dir.path()), checkpoint_for_step(dir.path(), 10));
  EXPECT_EQ(newest_checkpoint_step(dir.path()), 10);
  EXPECT_EQ(loaded_updates(newest_checkpoint(dir.path())), 10);
  // A checkpoint folder itself resolves to itself.
  const std::string two = checkpoint_for_step(dir.path(), 2);
  EXPECT_EQ(newest_checkpoint(two), two);
}

TEST(CheckpointRotation, PruningKeepsTheNewestKAndNothingElseGoes) {
  test::TempDir dir;
  Saver s;
  for (int64_t step : {2, 4, 6, 8}) s.save(dir.path(), step);
  fs::create_directories(dir.file("step-00000003.new"));  // debris older than the kept ones: goes
  fs::create_directories(dir.file("step-00000009.new"));  // debris of a newer save: stays
  write_file_atomically(dir.file("notes.txt"), "mine");   // not ours: stays
  prune_checkpoints(dir.path(), 2);
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir.path())) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"notes.txt", "step-00000006", "step-00000008", "step-00000009.new"}));
  EXPECT_EQ(loaded_updates(newest_checkpoint(dir.path())), 8);
  prune_checkpoints(dir.path(), 5);  // fewer than K: nothing to do
  EXPECT_TRUE(fs::exists(dir.file("step-00000006")));
  EXPECT_THROW(prune_checkpoints(dir.path(), 0), Error);
}

TEST(CheckpointRotation, AFolderWithoutACompleteCheckpointIsAnErrorNamingIt) {
  test::TempDir dir;
  fs::create_directories(dir.file("step-00000004.new"));
  for (const std::string& path : {dir.path(), dir.file("missing")}) {
    try {
      newest_checkpoint(path);
      ADD_FAILURE() << "found a checkpoint in " << path;
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind(path + ": no", 0), 0u) << e.what();
    }
  }
  EXPECT_FALSE(newest_checkpoint_step(dir.path()).has_value());
}

// What check_checkpoint_folder refuses, and that it refuses before touching anything.
TEST(CheckpointRotation, ASaveFolderMayHoldStepCheckpointsAndNothingElse) {
  test::TempDir dir;
  Saver s;
  check_checkpoint_folder(dir.file("new/deeper"));  // missing: the first save creates it
  EXPECT_FALSE(fs::exists(dir.file("new")));
  const std::string ck = dir.file("ck");
  s.save(ck, 2);
  fs::create_directories(ck + "/step-00000003.new");  // debris of a save that died: the next save's
  check_checkpoint_folder(ck);
  auto refused = [](const std::string& folder, const std::string& what) {
    try {
      check_checkpoint_folder(folder);
      ADD_FAILURE() << folder << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  refused(checkpoint_for_step(ck, 2), "is a checkpoint itself");
  write_file_atomically(ck + "/step-00000003.new/notes.txt", "mine");
  refused(ck, ck + "/step-00000003.new: holds 'notes.txt', which is not part of a checkpoint");
  fs::remove(ck + "/step-00000003.new/notes.txt");
  write_file_atomically(ck + "/notes.txt", "mine");
  refused(ck, ck + ": holds 'notes.txt', which is not a step-N checkpoint");
  refused(ck + "/notes.txt", "exists and is not a folder");
  EXPECT_EQ(read_file(ck + "/notes.txt"), "mine");
  EXPECT_EQ(loaded_updates(newest_checkpoint(ck)), 2);
}

}  // namespace
}  // namespace dmuon
