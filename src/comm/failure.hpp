// A process-wide flag raised when a collective failed, timed out or was abandoned unfinished:
// MPI is then left unfinalised at exit (MPI_Finalize would wait for the peers that are gone), and
// cleanup no longer waits for in-flight operations (Work::settle, MpiWork's destructor).
#pragma once

namespace dmuon::comm::detail {

void mark_comm_failed();
bool comm_failed();

}  // namespace dmuon::comm::detail
