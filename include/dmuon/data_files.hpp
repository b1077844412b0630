// Locating files under the project's models/ folder (model manifests, models/hardware/ profiles)
// from wherever dmuon runs: the source tree, the build tree below it, or an install.
#pragma once

#include <string>

namespace dmuon {

// `name_or_path` itself if it is a file; else <models>/<subdir>/<name>.json for <models> in
// $DMUON_MODELS_DIR, ./models, and models/ or share/dmuon/models/ in each folder above the running
// executable. Throws dmuon::Error naming `what` and listing the folders searched.
std::string find_models_file(const std::string& subdir, const std::string& name_or_path, const std::string& what);

}  // namespace dmuon
