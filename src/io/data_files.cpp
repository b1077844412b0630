#include "dmuon/data_files.hpp"

#include <cstdlib>
#include <filesystem>
#include <vector>

#include "dmuon/error.hpp"

namespace dmuon {

std::string find_models_file(const std::string& subdir, const std::string& name_or_path, const std::string& what) {
  namespace fs = std::filesystem;
  if (fs::is_regular_file(name_or_path)) return name_or_path;
  std::vector<fs::path> models_dirs;
  if (const char* env = std::getenv("DMUON_MODELS_DIR")) models_dirs.emplace_back(env);
  models_dirs.emplace_back("models");
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    // build/dmuon and build/tests/* find the source tree's models/; bin/dmuon finds ../share/dmuon/models.
    for (fs::path dir = exe.parent_path(); !dir.empty() && dir != dir.root_path(); dir = dir.parent_path()) {
      models_dirs.push_back(dir / "models");
      models_dirs.push_back(dir / "share" / "dmuon" / "models");
    }
  }
  std::string searched;
  for (const auto& models : models_dirs) {
    const fs::path dir = subdir.empty() ? models : models / subdir;
    const fs::path candidate = dir / (name_or_path + ".json");
    if (fs::is_regular_file(candidate)) return candidate.string();
    searched += (searched.empty() ? "" : ", ") + dir.string();
  }
  DMUON_FAIL("no ", what, " '", name_or_path, "': not a file, and no ", name_or_path, ".json in ", searched);
}

}  // namespace dmuon
