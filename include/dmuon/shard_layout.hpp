// Where each parameter of a unit lives in the unit's packed flat buffer and in each rank's shard.
// Pure arithmetic: no MPI, no BLAS; identical on every rank for identical inputs.
//
// A unit's packed buffer (`total` elements) is the concatenation of the D ranks' shards: rank r
// holds [shard_offset[r], shard_offset[r+1]). The packed order is a list of segments, each a
// contiguous range of one parameter. Two layouts:
//   even:          parameters in registration order, each one segment; shard r has
//                  ⌊total/D⌋ (+1 for r < total mod D) elements, so a matrix may straddle ranks.
//   owner_aligned: shard r = the unit's matrices owned by r (whole, registration order), then r's
//                  chunk of the unit's elementwise pool (all elementwise parameters concatenated
//                  in registration order and split evenly: chunk sizes as in `even`). A matrix is
//                  one segment inside its owner's shard; an elementwise parameter may be cut into
//                  several segments (one per chunk it touches).
//
// The query the optimizer uses is UnitLayout::local_pieces(rank): for every parameter range in
// that rank's shard, (param, offset_in_param, length, offset_in_shard), in shard order.
#pragma once

#include <cstdint>
#include <vector>

#include "dmuon/params.hpp"

namespace dmuon::shard {

enum class Layout { even, owner_aligned };

// A contiguous range of parameter `param` (registry index) at `offset_in_packed` in the packed buffer.
struct Segment {
  int param = 0;
  int64_t offset_in_param = 0;
  int64_t length = 0;
  int64_t offset_in_packed = 0;
};

// A contiguous range of parameter `param` that lies in one rank's shard.
struct LocalPiece {
  int param = 0;
  int64_t offset_in_param = 0;
  int64_t length = 0;
  int64_t offset_in_shard = 0;
  bool operator==(const LocalPiece&) const = default;
};

struct UnitLayout {
  int unit = 0;
  Layout kind = Layout::even;
  int world_size = 1;
  std::vector<int> params;            // registry indices of the unit's parameters, registration order
  std::vector<Segment> segments;      // packed order; they tile [0, total) without gaps
  std::vector<int64_t> shard_offset;  // world_size + 1 entries; shard r = [offset[r], offset[r+1])

  int64_t total() const { return shard_offset.back(); }
  int64_t shard_size(int rank) const { return shard_offset[rank + 1] - shard_offset[rank]; }
  std::vector<int64_t> shard_sizes() const;
  // The parameter ranges inside `rank`'s shard, in shard order (an empty shard gives none).
  std::vector<LocalPiece> local_pieces(int rank) const;
  // The segments of registry parameter `param`, in order of offset_in_param (empty if not in unit).
  std::vector<Segment> segments_of(int param) const;
};

// Sizes of `parts` near-equal contiguous chunks of n: ⌊n/parts⌋, the first n mod parts one larger.
std::vector<int64_t> even_split(int64_t n, int parts);

// specs: the whole registry; the unit's parameters are those with spec.unit == unit.
UnitLayout even_layout(const std::vector<ParamSpec>& specs, int unit, int world_size);
// owners[p]: owner rank of matrix parameter p (0 ≤ owner < world_size); ignored for elementwise
// parameters (use -1). Throws dmuon::Error naming the parameter if an owner is out of range.
UnitLayout owner_aligned_layout(const std::vector<ParamSpec>& specs, const std::vector<int>& owners, int unit,
                                int world_size);

}  // namespace dmuon::shard
