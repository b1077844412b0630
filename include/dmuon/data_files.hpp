// Locating the project's data files (model manifests in models/, hardware profiles in
// models/hardware/) from wherever dmuon runs: the build tree, the source tree, or an install.
#pragma once

#include <string>

namespace dmuon {

// `name_or_path` itself if it is a file; else <dir>/<subdir>/<name>.json for dir in
// $DMUON_MODELS_DIR/.., the current folder, and each folder above the running executable (also
// <dir>/share/dmuon/). Throws dmuon::Error naming `what` and listing the folders searched.
std::string find_data_file(const std::string& subdir, const std::string& name_or_path, const std::string& what);

}  // namespace dmuon
