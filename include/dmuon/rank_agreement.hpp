// Agreement across ranks: one rank's decision, or one rank's failure, reaching every rank, so that no
// rank goes on alone into a collective the others never join (it would wait until the comm timeout).
//
//   rank 0 decides, every rank gets it:  from_rank0 (the owner plan: milp with a time limit may answer
//     differently per rank; tuned NS entries: timings taken at once on shared cores distort each other).
//   one rank failed, so every rank throws:  throw_if_any_failed, after a collective that summed each
//     rank's failure flag (checkpoint save and load, the metrics file of `dmuon train`, the optimizer's
//     non-finite gradient check, which sums the flag together with the gradient norm).
#pragma once

#include <exception>
#include <functional>
#include <string>

#include "dmuon/error.hpp"

namespace dmuon::comm {

class Comm;

// What a rank throws when another rank failed, whose own error says why (throw_if_any_failed,
// from_rank0). The failing rank ends the job after printing that error; a program's top level lets it
// (abort_world with a grace period) instead of racing it to MPI_Abort, which could kill the failing
// rank before its error is out.
class PeerFailed : public Error {
 public:
  using Error::Error;
};

// Runs `action`; returns null, or the exception it threw. A std::exception that is not a dmuon::Error
// (std::filesystem's, say) becomes an Error "<doing>: <its message>".
std::exception_ptr capture_failure(const std::function<void()>& action, const std::string& doing);

// The agreed outcome once every rank knows `failures`, the sum over ranks of their failure flags (from
// a collective the caller ran, possibly with other figures in it). Returns when it is 0. Otherwise a
// rank that failed rethrows its own error `mine`, and every other rank throws PeerFailed
// "<elsewhere>; this is rank <rank>" (`elsewhere` says what failed where, e.g. "... failed on another
// rank (its error says why)").
void throw_if_any_failed(const std::exception_ptr& mine, double failures, int rank, const std::string& elsewhere);

// Collective: sums the failure flags over `comm` (one all-reduce), then throw_if_any_failed.
void throw_if_any_failed(Comm& comm, const std::exception_ptr& mine, const std::string& elsewhere);

// Collective. Rank 0 runs `produce` while the others wait in a broadcast; every rank returns its bytes.
// If `produce` throws, rank 0 rethrows its error and every other rank throws PeerFailed
// "rank 0 could not <what>: <rank 0's message>; this is rank r"; no rank waits for bytes that never come.
std::string from_rank0(Comm& comm, const std::function<std::string()>& produce, const std::string& what);

}  // namespace dmuon::comm
