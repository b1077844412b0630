// Memory per rank of each compared optimizer on the C++ engine's buffers (sim.hpp: rank_memory; docs/simulator.md,
// "Memory per rank").
#include <algorithm>
#include <map>

#include "dmuon/error.hpp"
#include "dmuon/sim.hpp"

namespace dmuon::sim {

namespace {

constexpr double kF32 = 4, kSlot = 8;

// n elements over `parts` ranks as the shard layouts split them (shard_layout.hpp: even_split): the first n % parts
// ranks one more.
int64_t even_share(int64_t n, int parts, int rank) { return n / parts + (rank < n % parts ? 1 : 0); }

// The elements of [lo, hi) in [a, b).
int64_t overlap(int64_t lo, int64_t hi, int64_t a, int64_t b) { return std::max<int64_t>(0, std::min(hi, b) - std::max(lo, a)); }

// Per rank: elements of the Muon matrices (role matrix) and of the elementwise parameters in its shard, in the even
// layout (each unit's packed parameters, in ParamSpec order, cut into even shards) or the owner-aligned one (each
// matrix whole on its owner, each unit's elementwise parameters cut evenly).
struct Pieces {
  std::vector<int64_t> matrix, elementwise;
  int64_t cut_copies = 0;  // owner-aligned: elements of the elementwise parameters cut across shards (every rank
                           // keeps a whole copy of each, and of its gradient: shard.hpp's multi-segment parameters)
};
Pieces shard_pieces(const std::vector<ParamSpec>& params, const std::vector<int>& owner, int devices, bool owned) {
  Pieces out{std::vector<int64_t>(devices, 0), std::vector<int64_t>(devices, 0)};
  int units = 0;
  for (const auto& p : params) units = std::max(units, p.unit + 1);
  for (int u = 0; u < units; ++u) {
    int64_t total = 0, pool = 0;
    for (const auto& p : params) {
      if (p.unit != u) continue;
      total += p.numel();
      if (p.role != ParamRole::matrix) pool += p.numel();
    }
    if (owned) {
      for (size_t i = 0; i < params.size(); ++i)
        if (params[i].unit == u && params[i].role == ParamRole::matrix) out.matrix[owner[i]] += params[i].numel();
      for (int r = 0; r < devices; ++r) out.elementwise[r] += even_share(pool, devices, r);
      int64_t at = 0;  // each elementwise parameter's range [at, at + n) of the pool, against the ranks' ranges
      for (const auto& p : params) {
        if (p.unit != u || p.role == ParamRole::matrix) continue;
        int ranks_holding = 0;
        int64_t lo = 0;
        for (int r = 0; r < devices; ++r) {
          const int64_t hi = lo + even_share(pool, devices, r);
          ranks_holding += overlap(lo, hi, at, at + p.numel()) > 0 ? 1 : 0;
          lo = hi;
        }
        if (ranks_holding > 1) out.cut_copies += p.numel();
        at += p.numel();
      }
      continue;
    }
    int64_t lo = 0;  // rank r's shard [lo, lo + share) of the unit's packed elements
    for (int r = 0; r < devices; ++r) {
      const int64_t hi = lo + even_share(total, devices, r);
      int64_t at = 0;
      for (const auto& p : params) {
        if (p.unit != u) continue;
        (p.role == ParamRole::matrix ? out.matrix : out.elementwise)[r] += overlap(lo, hi, at, at + p.numel());
        at += p.numel();
      }
      lo = hi;
    }
  }
  return out;
}

// The Newton–Schulz workspace one queue pools after running `batches` (per block shape, how many): grown, never shrunk,
// to two m×n and four m×m iterates (m ≤ n) per matrix of a chunk and two float32 norm slots per matrix; a chunk is the
// whole batch where the engine batches kernels, else one matrix (src/ns/workspace.cpp).
double pooled_workspace(const std::map<std::pair<int64_t, int64_t>, int>& batches, bool batched,
                        const HardwareProfile& hw) {
  double mn = 0, mm = 0, norms = 0;
  for (const auto& [shape, count] : batches) {
    const double m = static_cast<double>(std::min(shape.first, shape.second));
    const double n = static_cast<double>(std::max(shape.first, shape.second));
    const double chunk = batched ? count : 1;
    mn = std::max(mn, m * n * chunk);
    mm = std::max(mm, m * m * chunk);
    norms = std::max(norms, 2 * chunk);
  }
  return hw.ns_bytes_per_element * (2 * mn + 4 * mm) + kF32 * norms;
}

}  // namespace

double RankMemory::held() const { return weights + gradients + state + step_buffers + ns_workspace + slots; }

std::vector<RankMemory> rank_memory(const std::vector<ParamSpec>& params, const std::vector<int>& owner, int devices,
                                    ComparedOptimizer optimizer, const HardwareProfile& hw,
                                    const std::vector<std::vector<MatrixBlock>>& ns_blocks) {
  DMUON_CHECK(devices >= 1, "rank_memory: ", devices, " devices");
  DMUON_CHECK(owner.size() == params.size(), "rank_memory: ", owner.size(), " owners for ", params.size(),
              " parameters");
  DMUON_CHECK(ns_blocks.empty() || ns_blocks.size() == params.size(), "rank_memory: ", ns_blocks.size(),
              " parameters' blocks for ", params.size(), " parameters");
  const bool dmuon = optimizer == ComparedOptimizer::dmuon;
  const Pieces pieces = shard_pieces(params, owner, devices, dmuon);
  std::vector<RankMemory> out(devices);
  for (int r = 0; r < devices; ++r) {
    const double shard = static_cast<double>(pieces.matrix[r] + pieces.elementwise[r]);
    out[r].weights = out[r].gradients = kF32 * (shard + static_cast<double>(pieces.cut_copies));
    // AdamW: m and v of every element it updates; the Muon optimizers: momentum of their matrix pieces.
    out[r].state = optimizer == ComparedOptimizer::adamw
                       ? 2 * kF32 * shard
                       : kF32 * static_cast<double>(2 * pieces.elementwise[r] + pieces.matrix[r]);
    out[r].slots = kSlot * static_cast<double>(params.size());
  }
  if (optimizer == ComparedOptimizer::adamw) return out;
  // The Muon step's buffers, kept from its first update: U (then O) of each matrix the rank orthogonalizes, a column
  // split's blocks gathered contiguous beside it; the workspace of those matrices' batches.
  std::vector<std::map<std::pair<int64_t, int64_t>, int>> batches(devices);
  std::vector<double> u_elements(devices, 0);
  int64_t matrix_elements = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& p = params[i];
    if (p.role != ParamRole::matrix) continue;
    matrix_elements += p.numel();
    const bool split = !ns_blocks.empty() && ns_blocks[i].size() > 1;
    const bool by_columns = split && std::any_of(ns_blocks[i].begin(), ns_blocks[i].end(),
                                                 [](const MatrixBlock& b) { return b.col0 > 0; });
    for (int r = 0; r < devices; ++r) {
      if (dmuon && owner[i] != r) continue;
      u_elements[r] += static_cast<double>(p.numel()) * (by_columns ? 2 : 1);
      if (split) {
        for (const MatrixBlock& b : ns_blocks[i]) ++batches[r][{b.rows, b.cols}];
      } else {
        ++batches[r][{p.rows(), p.cols()}];
      }
      out[r].slots += kSlot * static_cast<double>(split ? ns_blocks[i].size() : 1);
    }
  }
  for (int r = 0; r < devices; ++r) {
    // Gather-then-compute's all-gather: its own pieces of the momenta sent, every matrix's received.
    const double exchange = dmuon ? 0 : static_cast<double>(pieces.matrix[r] + matrix_elements);
    out[r].step_buffers = kF32 * (u_elements[r] + exchange);
    out[r].ns_workspace =
        pooled_workspace(batches[r], hw.batched_kernels && optimizer != ComparedOptimizer::muon_gather_plain, hw);
  }
  return out;
}

int fullest_rank(const std::vector<RankMemory>& ranks) {
  DMUON_CHECK(!ranks.empty(), "fullest_rank: no ranks");
  return static_cast<int>(std::max_element(ranks.begin(), ranks.end(), [](const RankMemory& a, const RankMemory& b) {
                            return a.held() < b.held();
                          }) -
                          ranks.begin());
}

}  // namespace dmuon::sim
