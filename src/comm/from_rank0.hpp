// Work that rank 0 alone does and every rank receives: the owner plan (milp answers may differ per
// rank) and the tuned NS entries (timings taken concurrently on shared cores are distorted).
#pragma once

#include <functional>
#include <string>

#include "dmuon/comm.hpp"

namespace dmuon::detail {

// Collective. Rank 0 runs `produce` while the others wait in a broadcast; every rank returns its
// bytes. If `produce` throws, rank 0 rethrows its error and every other rank throws an Error
// "rank r: rank 0 could not <what>: <rank 0's message>"; no rank waits for bytes that never come.
std::string from_rank0(comm::Comm& comm, const std::function<std::string()>& produce, const std::string& what);

}  // namespace dmuon::detail
