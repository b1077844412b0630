// Pure shard-layout arithmetic (see include/dmuon/shard_layout.hpp).
#include <algorithm>
#include <numeric>

#include "dmuon/error.hpp"
#include "dmuon/shard_layout.hpp"

namespace dmuon::shard {

namespace {
void check_world(int world_size) { DMUON_CHECK(world_size >= 1, "world size must be at least 1, got ", world_size); }

std::vector<int> unit_params(const std::vector<ParamSpec>& specs, int unit) {
  std::vector<int> out;
  for (int p = 0; p < static_cast<int>(specs.size()); ++p)
    if (specs[p].unit == unit) out.push_back(p);
  return out;
}

std::vector<int64_t> prefix(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> off(sizes.size() + 1, 0);
  std::partial_sum(sizes.begin(), sizes.end(), off.begin() + 1);
  return off;
}

// Appends the segments of `params` (concatenated) that fall in [from, to) of their concatenation,
// placing them at `packed_at` onward.
void append_range(const std::vector<ParamSpec>& specs, const std::vector<int>& params, int64_t from, int64_t to,
                  int64_t packed_at, std::vector<Segment>& out) {
  int64_t start = 0;
  for (int p : params) {
    const int64_t n = specs[p].numel();
    const int64_t lo = std::max(from, start), hi = std::min(to, start + n);
    if (lo < hi) out.push_back({p, lo - start, hi - lo, packed_at + (lo - from)});
    start += n;
  }
}
}  // namespace

std::vector<int64_t> even_split(int64_t n, int parts) {
  check_world(parts);
  std::vector<int64_t> sizes(parts, n / parts);
  for (int64_t r = 0; r < n % parts; ++r) ++sizes[r];
  return sizes;
}

std::vector<int64_t> UnitLayout::shard_sizes() const {
  std::vector<int64_t> s(world_size);
  for (int r = 0; r < world_size; ++r) s[r] = shard_size(r);
  return s;
}

std::vector<LocalPiece> UnitLayout::local_pieces(int rank) const {
  DMUON_CHECK(rank >= 0 && rank < world_size, "local_pieces: rank ", rank, " is not in a world of ", world_size);
  const int64_t lo = shard_offset[rank], hi = shard_offset[rank + 1];
  std::vector<LocalPiece> out;
  for (const Segment& s : segments) {
    const int64_t a = std::max(lo, s.offset_in_packed), b = std::min(hi, s.offset_in_packed + s.length);
    if (a < b) out.push_back({s.param, s.offset_in_param + (a - s.offset_in_packed), b - a, a - lo});
  }
  return out;
}

std::vector<Segment> UnitLayout::segments_of(int param) const {
  std::vector<Segment> out;
  for (const Segment& s : segments)
    if (s.param == param) out.push_back(s);
  std::sort(out.begin(), out.end(),
            [](const Segment& a, const Segment& b) { return a.offset_in_param < b.offset_in_param; });
  return out;
}

UnitLayout even_layout(const std::vector<ParamSpec>& specs, int unit, int world_size) {
  check_world(world_size);
  UnitLayout l{unit, Layout::even, world_size, unit_params(specs, unit), {}, {}};
  int64_t at = 0;
  for (int p : l.params) {
    l.segments.push_back({p, 0, specs[p].numel(), at});
    at += specs[p].numel();
  }
  l.shard_offset = prefix(even_split(at, world_size));
  return l;
}

UnitLayout owner_aligned_layout(const std::vector<ParamSpec>& specs, const std::vector<int>& owners, int unit,
                                int world_size) {
  check_world(world_size);
  DMUON_CHECK(owners.size() == specs.size(), "owner table has ", owners.size(), " entries for ", specs.size(),
              " parameters");
  UnitLayout l{unit, Layout::owner_aligned, world_size, unit_params(specs, unit), {}, {0}};
  std::vector<int> elementwise;
  int64_t pool = 0;
  for (int p : l.params) {
    if (specs[p].role == ParamRole::matrix) {
      DMUON_CHECK(owners[p] >= 0 && owners[p] < world_size, "matrix parameter '", specs[p].name, "' has owner ",
                  owners[p], ", not a rank of ", world_size);
    } else {
      elementwise.push_back(p);
      pool += specs[p].numel();
    }
  }
  const std::vector<int64_t> pool_offset = prefix(even_split(pool, world_size));
  int64_t at = 0;
  for (int r = 0; r < world_size; ++r) {
    for (int p : l.params) {
      if (specs[p].role == ParamRole::matrix && owners[p] == r) {
        l.segments.push_back({p, 0, specs[p].numel(), at});
        at += specs[p].numel();
      }
    }
    append_range(specs, elementwise, pool_offset[r], pool_offset[r + 1], at, l.segments);
    at += pool_offset[r + 1] - pool_offset[r];
    l.shard_offset.push_back(at);
  }
  return l;
}

}  // namespace dmuon::shard
