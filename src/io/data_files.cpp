#include "dmuon/data_files.hpp"

#include <cstdlib>
#include <filesystem>
#include <vector>

#include "dmuon/error.hpp"

// Set by CMake for this file: the source tree's models/ (for binaries of any build tree) and the path from
// an installed bin/ to share/dmuon/models (GNUInstallDirs' bin and data folders).
#ifndef DMUON_SOURCE_MODELS_DIR
#error "DMUON_SOURCE_MODELS_DIR is defined by CMakeLists.txt"
#endif
#ifndef DMUON_INSTALLED_MODELS_FROM_BINDIR
#error "DMUON_INSTALLED_MODELS_FROM_BINDIR is defined by CMakeLists.txt"
#endif

namespace dmuon {

namespace fs = std::filesystem;

namespace {
// In the order data_files.hpp gives.
std::vector<fs::path> models_search_dirs() {
  std::vector<fs::path> dirs;
  if (const char* env = std::getenv("DMUON_MODELS_DIR"); env && *env) dirs.emplace_back(env);
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    dirs.push_back(exe.parent_path() / "models");
    dirs.push_back((exe.parent_path() / DMUON_INSTALLED_MODELS_FROM_BINDIR).lexically_normal());
  }
  dirs.emplace_back(DMUON_SOURCE_MODELS_DIR);
  return dirs;
}
}  // namespace

std::string find_models_file(const std::string& subdir, const std::string& name_or_path, const std::string& what) {
  if (fs::is_regular_file(name_or_path)) return name_or_path;
  std::string searched;
  for (const fs::path& models : models_search_dirs()) {
    const fs::path dir = subdir.empty() ? models : models / subdir;
    const fs::path candidate = dir / (name_or_path + ".json");
    if (fs::is_regular_file(candidate)) return candidate.string();
    searched += (searched.empty() ? "" : ", ") + dir.string();
  }
  DMUON_FAIL("no ", what, " '", name_or_path, "': not a file, and no ", name_or_path, ".json in ", searched);
}

}  // namespace dmuon
