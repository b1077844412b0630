// Locating files under the project's models/ folder (model manifests, models/hardware/ profiles)
// from any working directory, for a binary in any build tree or an installed one.
#pragma once

#include <string>

namespace dmuon {

// `name_or_path` itself if it is a file; else <models>/<subdir>/<name>.json in the first of these
// <models> folders that has it:
//   $DMUON_MODELS_DIR (when set),
//   models/ beside the running executable (a build tree's own files: `dmuon bench calibrate`'s this-cpu),
//   ../share/dmuon/models from the executable's folder (an installed bin/dmuon; `cmake --install`),
//   the source tree's models/ that the library was built from (binaries of any build directory).
// The working directory is not searched: a name means the same file wherever dmuon runs.
// Throws dmuon::Error naming `what` and listing the folders searched.
std::string find_models_file(const std::string& subdir, const std::string& name_or_path, const std::string& what);

}  // namespace dmuon
