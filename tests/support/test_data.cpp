#include "test_data.hpp"

#include <cstdlib>
#include <filesystem>
#include <string>

#include "dmuon/error.hpp"

namespace dmuon::test {

std::string data_path(const std::string& name) { return std::string(DMUON_TEST_DATA_DIR) + "/" + name; }

NpyArray load_golden(const std::string& name) { return read_npy(data_path(name)); }

TempDir::TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "dmuon-test-XXXXXX").string();
  DMUON_CHECK(::mkdtemp(tmpl.data()) != nullptr, "cannot create a temporary folder");
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace dmuon::test
