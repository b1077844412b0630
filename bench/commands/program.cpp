// The benchmarks' executable (cli.hpp: Program): `dmuon bench <command>` runs `dmuon-bench <command>`.
#include "cli_kit/cli.hpp"

namespace dmuon::cli {

const Program kProgram{"dmuon-bench", "dmuon's benchmarks (also run as `dmuon bench ...`): print a table, or JSON "
                                      "with --json"};

}  // namespace dmuon::cli
