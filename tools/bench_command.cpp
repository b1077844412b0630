// `dmuon bench ...`: the benchmarks are an executable of their own, dmuon-bench (bench/), built beside dmuon in
// a build folder and not installed with it, so that no measurement code ships in the users' binary. This
// subcommand runs `dmuon-bench ...` with the same arguments in place of this process: under mpirun each rank
// becomes dmuon-bench before any MPI call. `dmuon bench --help` is dmuon-bench's.
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "cli_kit/cli.hpp"
#include "dmuon/error.hpp"

namespace dmuon::cli {

namespace bench_command {

// dmuon-bench beside this executable.
std::filesystem::path bench_executable() {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  DMUON_CHECK(!ec, "dmuon bench: cannot find this executable (/proc/self/exe): ", ec.message());
  return self.parent_path() / "dmuon-bench";
}

Registration reg("", [](CLI::App& app) {
  auto* c = app.add_subcommand("bench", "Benchmarks: print a table, or JSON with --json (runs dmuon-bench, "
                                        "built beside dmuon)");
  c->prefix_command();  // everything after `bench` is dmuon-bench's
  c->set_help_flag();
  c->callback([c] {
    const std::filesystem::path exe = bench_executable();
    DMUON_CHECK(std::filesystem::exists(exe),
                "dmuon bench: the benchmarks are the developer tool dmuon-bench, built beside dmuon in a build "
                "folder (target dmuon_bench) and not installed; ", exe.string(), " does not exist");
    std::vector<std::string> args = c->remaining();
    std::string name = "dmuon bench";  // what its --help and errors call it
    std::vector<char*> argv = {name.data()};
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(exe.c_str(), argv.data());
    DMUON_FAIL("dmuon bench: cannot run ", exe.string(), ": ", std::strerror(errno));
  });
});

}  // namespace bench_command

}  // namespace dmuon::cli
