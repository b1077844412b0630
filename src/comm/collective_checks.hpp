// The argument checks every Comm backend makes before posting a collective (comm.hpp's "always, locally"), so
// the MPI and NCCL communicators refuse the same calls with the same messages.
#pragma once

#include <cstdint>
#include <span>

#include "dmuon/comm.hpp"
#include "dmuon/error.hpp"

namespace dmuon::comm::detail {

inline void check_root(int root, int size, int rank, const char* what) {
  DMUON_CHECK(root >= 0 && root < size, what, " on rank ", rank, ": root ", root, " is not a rank of ", size);
}

// average divides by the rank count: floating dtypes only.
inline void check_reduce_op(DType t, ReduceOp op, int rank, const char* what) {
  DMUON_CHECK(op != ReduceOp::average || t == DType::f32 || t == DType::f64, what, " on rank ", rank,
              ": average needs a floating dtype, got ", to_string(t));
}

// One count per rank; returns their sum.
inline int64_t check_per_rank_counts(std::span<const int64_t> counts, int size, int rank, const char* what) {
  DMUON_CHECK(counts.size() == static_cast<std::size_t>(size), what, " on rank ", rank, ": ", counts.size(),
              " per-rank counts for ", size, " ranks");
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  return total;
}

}  // namespace dmuon::comm::detail
