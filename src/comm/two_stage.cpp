// Two-stage reduce-scatter(v) over a two-level topology, built only from the Comm interface (so
// any backend gets it). With K nodes of L ranks, rank (k, j) at world rank rank_at[k·L + j]:
//   1. permute the send buffer so that the blocks of all ranks with local index j are adjacent
//      (ordered by node k): piece j has c_j = Σ_k counts[rank_at(k, j)] elements;
//   2. reduce-scatter(v) inside the node: local rank j receives piece j summed over its node;
//   3. reduce-scatter(v) across nodes among ranks with local index j: node k receives its block.
// Every byte crosses the node boundary once, in stage 3, at 1/L of the volume of a flat call.
#include <cstring>
#include <memory>
#include <vector>

#include "dmuon/comm.hpp"

namespace dmuon::comm {

Work reduce_scatterv_two_stage(Comm& world, const void* send, void* recv, std::span<const int64_t> counts, DType t,
                               ReduceOp op) {
  const Topology& topo = world.topology();
  if (!topo.two_level()) return world.reduce_scatterv_raw(send, recv, counts, t, op);
  DMUON_CHECK(counts.size() == static_cast<std::size_t>(world.size()), "reduce_scatterv_two_stage on rank ",
              world.rank(), ": ", counts.size(), " per-rank counts for ", world.size(), " ranks");
  const int K = topo.nodes, L = topo.ranks_per_node;
  const int my_local = world.node().rank();
  DMUON_CHECK(op != ReduceOp::average || t == DType::f32 || t == DType::f64, "reduce_scatterv_two_stage on rank ",
              world.rank(), ": average needs a floating dtype, got ", to_string(t));
  const std::size_t esize = dtype_size(t);

  std::vector<int64_t> displ(world.size() + 1, 0);
  for (int r = 0; r < world.size(); ++r) displ[r + 1] = displ[r] + counts[r];

  // Stage-1 buffer: pieces j = 0..L-1, each the blocks of ranks (0, j), (1, j), ... (K-1, j).
  auto permuted = std::make_shared<std::vector<char>>(esize * static_cast<std::size_t>(displ[world.size()]));
  std::vector<int64_t> piece(L, 0);
  std::size_t at = 0;
  for (int j = 0; j < L; ++j) {
    for (int k = 0; k < K; ++k) {
      const int r = topo.rank_at[k * L + j];
      std::memcpy(permuted->data() + at, static_cast<const char*>(send) + esize * displ[r], esize * counts[r]);
      at += esize * counts[r];
      piece[j] += counts[r];
    }
  }
  auto node_sum = std::make_shared<std::vector<char>>(esize * static_cast<std::size_t>(piece[my_local]));
  auto cross_counts = std::make_shared<std::vector<int64_t>>(K);
  for (int k = 0; k < K; ++k) (*cross_counts)[k] = counts[topo.rank_at[k * L + my_local]];
  auto node_counts = std::make_shared<std::vector<int64_t>>(piece);

  const ReduceOp partial = op == ReduceOp::average ? ReduceOp::sum : op;
  Work stage1 = world.node().reduce_scatterv_raw(permuted->data(), node_sum->data(), *node_counts, t, partial);
  Comm* cross = &world.cross();
  const int n = world.size();
  const int64_t mine = counts[world.rank()];
  Work both = Work::then_start(std::move(stage1), *cross, [=]() {
    (void)permuted;  // kept alive until stage 1 is done
    (void)node_counts;
    Work stage2 = cross->reduce_scatterv_raw(node_sum->data(), recv, *cross_counts, t, partial);
    return Work::then_run(std::move(stage2), [=] {
      (void)node_sum;
      (void)cross_counts;
      if (op != ReduceOp::average) return;
      if (t == DType::f32)
        for (int64_t i = 0; i < mine; ++i) static_cast<float*>(recv)[i] /= static_cast<float>(n);
      else
        for (int64_t i = 0; i < mine; ++i) static_cast<double*>(recv)[i] /= n;
    });
  });
  return both;
}

}  // namespace dmuon::comm
