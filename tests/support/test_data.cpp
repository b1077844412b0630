#include "test_data.hpp"

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "dmuon/error.hpp"

namespace dmuon::test {

std::string data_path(const std::string& name) { return std::string(DMUON_TEST_DATA_DIR) + "/" + name; }

NpyArray load_golden(const std::string& name) { return read_npy(data_path(name)); }

CommandResult run_command(const std::string& command) {
  CommandResult result;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  DMUON_CHECK(pipe != nullptr, "cannot run: ", command);
  std::array<char, 4096> buffer;
  size_t n = 0;
  while ((n = std::fread(buffer.data(), 1, buffer.size(), pipe)) > 0) result.output.append(buffer.data(), n);
  const int status = ::pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return result;
}

CommandResult run_cli(const std::string& args, int ranks) {
  std::string command = std::string(DMUON_CLI_PATH) + " " + args;
  if (ranks > 0) command = std::string(DMUON_MPIRUN) + " -np " + std::to_string(ranks) + " " + command;
  return run_command(command);
}

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
