// A process-wide flag raised when a collective failed or timed out: MPI is then left
// unfinalised at exit (MPI_Finalize would wait for the peers that are gone).
#pragma once

namespace dmuon::comm::detail {

void mark_comm_failed();
bool comm_failed();

}  // namespace dmuon::comm::detail
