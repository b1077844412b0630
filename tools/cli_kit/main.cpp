// The main() of the dmuon command-line tool and of dmuon-bench (the benchmarks, which `dmuon bench` runs);
// both read "dmuon: error: ..." on failure. Library errors arrive here as exceptions and become one line on stderr
// and a non-zero exit code: a user's error (dmuon::Error, a file system error) without the source
// locations the library attaches ("[src/io/npy.cpp:42]"; DMUON_DEBUG=1 keeps them), anything else as an
// internal error, in full. Under mpirun the failing rank then ends the whole job (abort_world):
// returning would leave its peers waiting in a collective until their comm timeout, and the exit
// handler's MPI_Finalize would wait with them.
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "cli_kit/cli.hpp"
#include "cli_kit/field_flags.hpp"
#include "dmuon/comm.hpp"
#include "dmuon/error.hpp"
#include "dmuon/linalg.hpp"
#include "dmuon/rank_agreement.hpp"
#include "console/progress.hpp"

namespace dmuon::cli {

namespace {
struct Entry {
  std::string group;
  AddSubcommand add;
};
std::vector<Entry>& registry() {
  static std::vector<Entry> entries;
  return entries;
}
const std::map<std::string, std::string> kGroupHelp = {
    {"ckpt", "Checkpoint tools"},
};
}  // namespace

Registration::Registration(std::string group, AddSubcommand add) {
  registry().push_back({std::move(group), std::move(add)});
}

void add_registered_subcommands(CLI::App& app) {
  std::map<std::string, CLI::App*> groups;
  for (const auto& e : registry()) {
    CLI::App* parent = &app;
    if (!e.group.empty()) {
      auto& g = groups[e.group];
      if (!g) {
        auto help = kGroupHelp.find(e.group);
        g = app.add_subcommand(e.group, help == kGroupHelp.end() ? "" : help->second);
        g->require_subcommand(1);
      }
      parent = g;
    }
    e.add(*parent);
  }
}

void read_integers_as_decimal(CLI::App& app) {
  // CLI11 converts integers with strtoll's base 0, which reads "010" as 8. A transform runs before the
  // conversion and the range checks, and replaces a decimal text by its canonical form.
  const CLI::Validator decimal(
      [](std::string& text) {
        long long v = 0;
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), v);
        if (error == std::errc() && end == text.data() + text.size()) text = std::to_string(v);
        return std::string();
      },
      "");
  for (CLI::Option* option : app.get_options()) {
    const std::string type = option->get_type_name();
    if (type.rfind("INT", 0) == 0 || type.rfind("UINT", 0) == 0) option->transform(decimal);
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) read_integers_as_decimal(*sub);
}

namespace {
// How long a rank that saw PeerFailed waits for the failing rank to print its error and end the job
// before it ends the job itself (that rank is alive: it joined the collective that told this one).
constexpr double kPeerAbortGraceS = 10;

// The library's error, with the flags of the fields it names ("TrainOptions.steps" → "--steps").
std::string user_message(const std::string& library_what) {
  const std::string what = with_flags(library_what);
  const char* debug = std::getenv("DMUON_DEBUG");
  if (debug && std::string(debug) == "1") return what;
  // " [src/optim/checkpoint.cpp:254]" (or a CUDA source's, .cu), also inside a message that quotes
  // another rank's error.
  static const std::regex location(R"( \[[^\[\] ]+\.(cpp|hpp|h|cc|cu|cuh):[0-9]+\])");
  return std::regex_replace(what, location, "");
}
// Warns once (rank 0 of an mpirun job, or the only process) after a command that computed on the CPU ran to its
// end when OpenBLAS ran kernels below the CPU's instruction set (linalg::blas_kernel_advice); after, so that an
// error stays the one line it is.
void warn_about_blas_kernels(int argc, char** argv) {
  static const std::vector<std::string> computing = {"train", "ns", "tune", "bench"};
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  if (argc < 2 || (rank != nullptr && std::string(rank) != "0")) return;
  if (std::find(computing.begin(), computing.end(), argv[1]) == computing.end()) return;
  const std::string advice = linalg::blas_kernel_advice();
  if (!advice.empty()) std::fprintf(stderr, "dmuon: warning: %s\n", advice.c_str());
}
}  // namespace

}  // namespace dmuon::cli

int main(int argc, char** argv) {
  CLI::App app{std::string(dmuon::cli::kProgram.name) + ": " + dmuon::cli::kProgram.description};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string(dmuon::cli::kProgram.name) + " 0.1.0");
  dmuon::cli::add_registered_subcommands(app);
  dmuon::cli::read_integers_as_decimal(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const dmuon::cli::ExitStatus& e) {  // e.g. `dmuon train` stopped by a signal, checkpointed
    return e.code;
  } catch (const CLI::ParseError& e) {
    // A bad command line is one line too, like every other error.
    std::fprintf(stderr, "dmuon: error: %s (see --help)\n", e.what());
    return e.get_exit_code();
  } catch (const dmuon::Error& e) {
    dmuon::end_open_progress_line();  // the error starts on its own line
    std::fprintf(stderr, "dmuon: error: %s\n", dmuon::cli::user_message(e.what()).c_str());
    // After PeerFailed another rank's error says why, and that rank ends the job: give it the time.
    const bool peer_failed = dynamic_cast<const dmuon::comm::PeerFailed*>(&e) != nullptr;
    dmuon::comm::abort_world(1, peer_failed ? dmuon::cli::kPeerAbortGraceS : 0);
    return 1;
  } catch (const std::filesystem::filesystem_error& e) {
    dmuon::end_open_progress_line();
    std::fprintf(stderr, "dmuon: error: %s\n", e.what());  // names the paths and the system's reason
    dmuon::comm::abort_world(1);
    return 1;
  } catch (const std::exception& e) {
    dmuon::end_open_progress_line();
    std::fprintf(stderr, "dmuon: internal error: %s\n", e.what());
    dmuon::comm::abort_world(2);
    return 2;
  }
  dmuon::cli::warn_about_blas_kernels(argc, argv);
  return 0;
}
