// Helpers shared by the tests: the golden tensors' folder and scratch files.
#pragma once

#include <string>

#include "dmuon/npy.hpp"

namespace dmuon::test {

// Path of a file in tests/data (the golden tensors copied from ../shared/golden).
std::string data_path(const std::string& name);

// Reads a tests/data .npy file.
NpyArray load_golden(const std::string& name);

// What a command printed (stdout and stderr together) and its exit status.
struct CommandResult {
  int exit_code = -1;
  std::string output;
};
// Runs `args` (already shell-quoted where needed) through the shell.
CommandResult run_command(const std::string& command);
// Runs the built `dmuon` tool with `args`; with ranks > 0, under mpirun -np ranks.
CommandResult run_cli(const std::string& args, int ranks = 0);

// A fresh empty folder under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace dmuon::test
