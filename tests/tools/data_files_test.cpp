// Finding models/ from anywhere (include/dmuon/data_files.hpp): the built CLI run from another working
// directory, the DMUON_MODELS_DIR override, and an installed tree (`cmake --install` to a scratch prefix)
// whose bin/dmuon finds share/dmuon/models. A second build in a folder outside the source tree would test
// the configured source path too, but takes longer than CI allows; the installed copy and cwd=/ cover the
// two ways a binary can sit away from the source tree.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "dmuon/atomic_file.hpp"
#include "dmuon/data_files.hpp"
#include "test_data.hpp"

namespace dmuon {
namespace {

namespace fs = std::filesystem;

std::string quoted(const std::string& s) { return "'" + s + "'"; }

// A command run in / with no DMUON_MODELS_DIR unless `env` sets it.
test::CommandResult run_in_root(const std::string& command, const std::string& env = "") {
  return test::run_command("cd / && env -u DMUON_MODELS_DIR " + env + " " + command);
}

// Cheap commands that read a model manifest and a hardware profile (--costs flops --device).
std::string plan_args(const std::string& model, const std::string& device) {
  return " plan --model " + model + " --device " + device + " --costs flops --layers 1 --ranks 2 --balancer lpt";
}

TEST(DataFiles, TheCliFindsModelsFromAnotherWorkingDirectory) {
  const auto r = run_in_root(quoted(DMUON_CLI_PATH) + plan_args("qwen2.5-0.5b", "h200"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const auto sim = run_in_root(quoted(DMUON_CLI_PATH) + " simulate --model gpt2 --profile a800 --devices 8 --balancer lpt");
  EXPECT_EQ(sim.exit_code, 0) << sim.output;
}

TEST(DataFiles, DmuonModelsDirIsSearched) {
  test::TempDir dir;
  fs::create_directories(dir.file("hardware"));
  write_file_atomically(dir.file("env-only.json"), read_file(find_models_file("", "gpt2", "model manifest")));
  write_file_atomically(dir.file("hardware/env-only.json"),
                        read_file(find_models_file("hardware", "h200", "hardware profile")));
  const auto r = run_in_root(quoted(DMUON_CLI_PATH) + plan_args("env-only", "env-only"),
                             "DMUON_MODELS_DIR=" + quoted(dir.path()));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const auto without = run_in_root(quoted(DMUON_CLI_PATH) + plan_args("env-only", "h200"));
  EXPECT_NE(without.exit_code, 0) << without.output;
  EXPECT_NE(without.output.find("no model manifest 'env-only'"), std::string::npos) << without.output;
}

TEST(DataFiles, AnInstalledBinaryFindsShareDmuonModels) {
  test::TempDir prefix;
  const auto install = test::run_command(quoted(DMUON_CMAKE_COMMAND) + " --install " + quoted(DMUON_BUILD_DIR) +
                                         " --prefix " + quoted(prefix.path()));
  ASSERT_EQ(install.exit_code, 0) << install.output;
  const std::string share = prefix.file("share/dmuon/models");
  ASSERT_TRUE(fs::is_regular_file(share + "/gpt2.json")) << install.output;
  ASSERT_TRUE(fs::is_regular_file(share + "/hardware/a800.json")) << install.output;
  // Names only the installed tree has: found there, not in the source tree.
  fs::copy_file(share + "/gpt2.json", share + "/installed-only.json");
  fs::copy_file(share + "/hardware/a800.json", share + "/hardware/installed-only.json");
  const std::string dmuon = quoted(prefix.file("bin/dmuon"));
  const auto r = run_in_root(dmuon + plan_args("installed-only", "installed-only"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const auto missing = run_in_root(dmuon + plan_args("no-such-model", "h200"));
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.output.find(fs::path(share).lexically_normal().string()), std::string::npos) << missing.output;
}

}  // namespace
}  // namespace dmuon
