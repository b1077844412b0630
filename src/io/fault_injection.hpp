// Hooks for the fault-injection tests (docs/RELIABILITY.md), internal to the library (the tests drive them
// through the environment, not this header), read once from the environment:
//   DMUON_FAULT_KILL_AT=N         the process kills itself with SIGKILL at the N-th fault point
//                                 (1-based, counted over the whole process): after each temporary
//                                 file and each rename of atomic_file.hpp (checkpoints, tuning
//                                 cache, .npy exports), and after each folder a checkpoint save
//                                 or pruning removes
//   DMUON_FAULT_WRITE_ERROR_AT=N  the N-th write of a file written atomically (atomic_file.hpp)
//                                 fails as if the disk were full (ENOSPC)
// Unset, as in every normal run, a hook is one atomic increment.
#pragma once

namespace dmuon::fault {

// A point where a crash must leave every complete checkpoint loadable; `what` is printed when the
// hook kills the process there.
void point(const char* what);

// Whether this write must fail (the caller then reports ENOSPC like a real failed write).
bool fail_write();

}  // namespace dmuon::fault
