// Helpers shared by the tests: the golden tensors' folder and scratch files.
#pragma once

#include <string>

#include "dmuon/npy.hpp"

namespace dmuon::test {

// Path of a file in tests/data (the golden tensors copied from ../shared/golden).
std::string data_path(const std::string& name);

// Reads a tests/data .npy file.
NpyArray load_golden(const std::string& name);

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
