// Periodic checkpoints in one folder (layout in include/dmuon/checkpoint_rotation.hpp).
#include "dmuon/checkpoint_rotation.hpp"

#include <cstdio>
#include <filesystem>
#include <map>
#include <regex>

#include "dmuon/atomic_file.hpp"
#include "dmuon/checkpoint.hpp"
#include "dmuon/error.hpp"
#include "io/fault_injection.hpp"

namespace dmuon {

namespace {

namespace fs = std::filesystem;

// step-00000100, or its save's staging (.new) and parked (.old) folders.
const std::regex kStepFolder(R"(step-(\d{8,18})(\.new|\.old)?)");

struct StepFolders {
  std::map<int64_t, std::string> complete;  // step -> checkpoint path (as checkpoint.hpp names it)
  std::map<int64_t, std::vector<fs::path>> all;  // step -> every folder of that step's saves
};

StepFolders scan(const std::string& dir) {
  StepFolders out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory() || !std::regex_match(name, m, kStepFolder)) continue;
    const int64_t step = std::stoll(m[1]);
    out.all[step].push_back(entry.path());
    const std::string checkpoint = checkpoint_for_step(dir, step);
    if (is_checkpoint(checkpoint)) out.complete[step] = checkpoint;
  }
  return out;
}

}  // namespace

std::string checkpoint_for_step(const std::string& dir, int64_t step) {
  DMUON_CHECK(step >= 0, "checkpoint step must be at least 0, got ", step);
  char name[40];
  std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(step));
  return (fs::path(dir) / name).string();
}

std::optional<int64_t> newest_checkpoint_step(const std::string& dir) {
  const StepFolders folders = scan(dir);
  if (folders.complete.empty()) return std::nullopt;
  return folders.complete.rbegin()->first;
}

std::string newest_checkpoint(const std::string& path) {
  if (is_checkpoint(path)) return path;
  DMUON_CHECK(fs::exists(path), path, ": no such checkpoint folder");
  const StepFolders folders = scan(path);
  DMUON_CHECK(!folders.complete.empty(), path,
              ": no complete checkpoint (neither an index.json nor a step-N folder holding one)");
  return folders.complete.rbegin()->second;
}

void check_checkpoint_folder(const std::string& dir) {
  if (fs::exists(dir)) {
    DMUON_CHECK(fs::is_directory(dir), dir, ": exists and is not a folder; refusing to save checkpoints there");
    DMUON_CHECK(!is_checkpoint(dir), dir, ": is a checkpoint itself, not a folder of step-N checkpoints; refusing to "
                "save checkpoints into it (name a new or empty folder)");
    for (const auto& entry : fs::directory_iterator(dir)) {
      const std::string name = entry.path().filename().string();
      DMUON_CHECK(entry.is_directory() && std::regex_match(name, kStepFolder), dir, ": holds '", name,
                  "', which is not a step-N checkpoint; refusing to save checkpoints there (name a new or empty "
                  "folder)");
    }
    for (const auto& [step, paths] : scan(dir).all) check_checkpoint_destination(checkpoint_for_step(dir, step));
  }
  const std::string why = why_cannot_write(dir, true);
  DMUON_CHECK(why.empty(), "cannot write checkpoints into ", dir, ": ", why);
}

void prune_checkpoints(const std::string& dir, int keep) {
  DMUON_CHECK(keep >= 1, "prune_checkpoints: keep must be at least 1, got ", keep);
  const StepFolders folders = scan(dir);
  if (static_cast<int>(folders.complete.size()) <= keep) return;
  // The oldest step kept; every folder of an older step goes, complete or debris.
  auto oldest_kept = folders.complete.rbegin();
  std::advance(oldest_kept, keep - 1);
  for (const auto& [step, paths] : folders.all) {
    if (step >= oldest_kept->first) break;
    for (const fs::path& p : paths) {
      fs::remove(p / "index.json");  // incomplete first, so a crash midway leaves no broken "complete" one
      fs::remove_all(p);
      fault::point("removed an old checkpoint folder");
    }
  }
}

}  // namespace dmuon
