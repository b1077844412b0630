// The parallel mesh the owner planner knows (issue 41 item 5; docs/planning.md, "Meshes"): which ranks hold which
// part of each Muon matrix when step() starts, under the layouts dmuon.torch takes (docs/pytorch.md), so that an
// owner is chosen among the ranks that hold the matrix and the plan reports what step() moves per rank.
//
// Pure: no MPI, no BLAS.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "dmuon/params.hpp"
#include "dmuon/plan.hpp"

namespace dmuon {

// dp_replicate × dp_shard × tp × ep ranks (HSDP's replicas, FSDP's shards, tensor parallel, expert parallel).
// Rank order, torchtitan's (tp innermost, on the fast links):
//   rank = ((replicate·dp_shard + shard)·ep + expert)·tp + slice
// Dense matrices: rows cut into tp slices (Shard(0), torch.chunk), each slice's rows cut over the dp_shard·ep ranks
// of its slice (FSDP2 over dp_shard × ep, flattened: _StridedShard), the whole replicated over dp_replicate.
// Experts (parameters named "….experts.<i>.…"): the n experts of one prefix cut over ep as torch.chunk cuts a stack's
// dim 0, each expert's rows over the dp_shard·tp ranks of its expert coordinate (expert FSDP; experts are not
// tensor-parallel), replicated over dp_replicate.
struct Mesh {
  int dp_replicate = 1;
  int dp_shard = 1;
  int tp = 1;
  int ep = 1;

  int ranks() const;         // the product
  std::string text() const;  // "RxSxTxE", as parse_mesh reads it
};

// "RxSxTxE" (dp_replicate x dp_shard x tp x ep), each a whole number ≥ 1. Throws dmuon::Error naming the text and
// what is wrong (a missing or extra size, a size that is not a number, a size of 0).
Mesh parse_mesh(std::string_view text);

// A rank's coordinate on each mesh dim.
struct MeshCoordinate {
  int replicate = 0, shard = 0, expert = 0, slice = 0;
};
MeshCoordinate coordinate_of(const Mesh& mesh, int rank);

// Elements of the matrix `param` that each rank holds (size mesh.ranks()), under the layout above.
std::vector<int64_t> held_on_mesh(const Mesh& mesh, const std::vector<ParamSpec>& params, int param);

// Gives every item its layout on the mesh (PlanItem::held, replicas): the planner then picks owners among the
// holders and reports step() bytes. Throws dmuon::Error when mesh.ranks() is not `ranks`.
void lay_out_on_mesh(std::vector<PlanItem>& items, const std::vector<ParamSpec>& params, const Mesh& mesh,
                     int ranks);

}  // namespace dmuon
