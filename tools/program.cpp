// The dmuon executable's name and description (cli.hpp: Program).
#include "cli_kit/cli.hpp"

namespace dmuon::cli {

const Program kProgram{"dmuon",
                       "distributed Muon optimizer (owner-aligned shards, Gram Newton-Schulz) over MPI and BLAS, "
                       "or NCCL and CUDA"};

}  // namespace dmuon::cli
