#include "dmuon/data_files.hpp"

#include <cstdlib>
#include <filesystem>
#include <vector>

#include "dmuon/error.hpp"

namespace dmuon {

std::string find_data_file(const std::string& subdir, const std::string& name_or_path, const std::string& what) {
  namespace fs = std::filesystem;
  if (fs::is_regular_file(name_or_path)) return name_or_path;
  std::vector<fs::path> roots;
  if (const char* env = std::getenv("DMUON_MODELS_DIR")) roots.push_back(fs::path(env).parent_path());
  roots.emplace_back(".");
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    // build/dmuon finds the source tree above it; an installed bin/dmuon finds ../share/dmuon.
    for (fs::path dir = exe.parent_path(); !dir.empty() && dir != dir.root_path(); dir = dir.parent_path()) {
      roots.push_back(dir);
      roots.push_back(dir / "share" / "dmuon");
    }
  }
  std::string searched;
  for (const auto& root : roots) {
    const fs::path dir = root / subdir;
    const fs::path candidate = dir / (name_or_path + ".json");
    if (fs::is_regular_file(candidate)) return candidate.string();
    searched += (searched.empty() ? "" : ", ") + dir.string();
  }
  DMUON_FAIL("no ", what, " '", name_or_path, "': not a file, and no ", name_or_path, ".json in ", searched);
}

}  // namespace dmuon
