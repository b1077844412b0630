"""dmuon.torch.placements against torch's own answer, single process (pytest, no process group).

For every layout below and every rank of its mesh, the part placements.local_spans says the rank holds
must be what torch gives that rank:
  values   torch's placements split an index tensor (arange over the global tensor) as distribute_tensor
           splits a parameter (each mesh dim's placement._split_tensor, left to right, keeping the rank's
           coordinate): the local tensor must equal the global index tensor at our spans' indices;
  shape    torch.distributed.tensor._utils._compute_local_shape_and_global_offset: the local shape, and
           the global offset of the first element when the rank holds any;
  Shard    Shard.local_shard_size_and_offset (1-D meshes) and torch.chunk (placements.chunk).
Sizes are uneven on purpose (7 rows over 2 and 4 ranks, 5 experts over 2, a dim of 3 over 4: an empty
part), and the layouts are those of FSDP2, HSDP, TP, FSDP2 over TP (_StridedShard), EP × expert-FSDP and
3-D meshes.
"""

import math

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from dmuon.torch.placements import (Span, chunk, kinds_of, local_spans, mesh_cell, mesh_holdings, rectangles,
                                    unravel)

LAYOUTS = [
    ((7, 5), (4,), (Shard(0),)),                                        # FSDP2, uneven
    ((3, 5), (4,), (Shard(0),)),                                        # an empty part
    ((7, 6), (2, 2), (Replicate(), Shard(0))),                          # HSDP
    ((7, 6), (2,), (Shard(1),)),                                        # TP row-wise: a column block
    ((7, 6), (2, 2), (Shard(0), Shard(1))),                             # FSDP2 × row-wise TP
    ((8, 6), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),     # FSDP2 over column-wise TP, even
    ((7, 6), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),     # ... uneven
    ((11, 3), (3, 2), (_StridedShard(0, split_factor=2), Shard(0))),    # ... uneven, 3 × 2
    ((10, 4), (2,), (_StridedShard(0, split_factor=3),)),               # a strided part of several runs
    ((5, 6, 4), (2, 2), (Shard(0), Shard(1))),                          # experts: EP × expert-FSDP
    ((5, 6, 4), (2, 2), (Shard(0), _StridedShard(1, split_factor=2))),
    ((7, 6, 5), (2, 2, 2), (Replicate(), Shard(0), Shard(1))),          # a 3-D mesh: HSDP × TP
    ((9, 4), (2, 2, 2), (Shard(0), Replicate(), Shard(0))),             # two Shard(0), left to right
    ((6, 4), (2, 2), (Shard(-1), Replicate())),                         # a negative dim
]


def torch_local(index, mesh_shape, coordinate, placements):
    """The rank's local tensor of `index` as distribute_tensor makes it: each mesh dim's split, left to right."""
    local = index
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        split = Shard(p.dim % index.dim()) if isinstance(p, Shard) else p
        pieces, _ = split._split_tensor(local, mesh_shape[mesh_dim], with_padding=False)
        local = pieces[coordinate[mesh_dim]]
    return local


@pytest.mark.parametrize("global_shape, mesh_shape, placements", LAYOUTS)
def test_every_rank_holds_what_torch_gives_it(global_shape, mesh_shape, placements):
    index = torch.arange(math.prod(global_shape)).reshape(global_shape)
    for rank in range(math.prod(mesh_shape)):
        coordinate = unravel(rank, mesh_shape)
        spans = local_spans(global_shape, mesh_shape, coordinate, placements)
        expected = torch_local(index, mesh_shape, coordinate, placements)
        ours = index
        for d, span in enumerate(spans):
            ours = ours.index_select(d, torch.tensor(span.indices(), dtype=torch.long))
        assert torch.equal(ours, expected), (rank, spans)
        shape, offset = _compute_local_shape_and_global_offset(global_shape, mesh_shape, list(coordinate),
                                                              placements)
        assert tuple(s.count for s in spans) == tuple(shape)
        if all(s.count for s in spans):
            assert tuple(s.runs[0][0] for s in spans) == tuple(offset)
        # the rectangles, in local order, cover the part once
        assert sum(math.prod(lengths) for _, lengths in rectangles(spans)) == ours.numel()


@pytest.mark.parametrize("size, parts", [(7, 2), (7, 4), (3, 4), (0, 3), (8, 4), (1, 1)])
def test_chunk_is_torch_chunk_and_shard_local_size_and_offset(size, parts):
    pieces = torch.chunk(torch.arange(size), parts) if size else ()
    for r in range(parts):
        start, length = chunk(size, parts, r)
        expected = pieces[r].tolist() if r < len(pieces) else []
        assert list(range(start, start + length)) == expected
        assert (length, start) == tuple(int(v) for v in Shard.local_shard_size_and_offset(size, parts, r)) \
            or length == 0


def test_replicas_are_the_replicate_dims_and_shards_the_others():
    # A (2, 2, 2) mesh (dp_replicate, dp_shard, tp): replica = coordinate on dim 0, shard on dims 1, 2.
    placements = (Replicate(), Shard(0), Shard(1))
    cells = [mesh_cell((2, 2, 2), unravel(g, (2, 2, 2)), placements, 2) for g in range(8)]
    assert [c for c, _ in cells] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    assert cells[0][1] == (2, 4)
    holdings = mesh_holdings((8, 6), (2, 2, 2), placements)
    assert [h.replica for h in holdings] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert holdings[1].spans == holdings[5].spans and holdings[1].shape == (4, 3)


def test_a_span_takes_and_finds_local_positions():
    span = Span(((0, 2), (5, 2)))               # rows 0, 1, 5, 6 in local order
    assert span.take(1, 2) == Span(((1, 1), (5, 1)))
    assert [span.position_of(i) for i in (0, 1, 5, 6, 3)] == [0, 1, 2, 3, None]
    assert span.split(2, 1) == Span(((5, 2),))
    assert Span.whole(0) == Span(()) and Span(()).count == 0


@pytest.mark.parametrize("placement", [Partial(), Partial("max")])
def test_a_partial_value_is_refused_by_name(placement):
    with pytest.raises(ValueError, match="Partial.*mesh dim 1"):
        kinds_of((Replicate(), placement), 2)


def test_every_layout_is_a_disjoint_cover_per_replica():
    for global_shape, mesh_shape, placements in LAYOUTS:
        holdings = mesh_holdings(global_shape, mesh_shape, placements)
        for replica in {h.replica for h in holdings}:
            seen = torch.zeros(global_shape, dtype=torch.int64)
            for h in holdings:
                if h.replica == replica:
                    for offsets, lengths in rectangles(h.spans):
                        seen[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))] += 1
            assert bool((seen == 1).all()), (global_shape, mesh_shape, placements, replica)


def test_the_layouts_exercise_every_kind_and_several_runs():
    kinds = {k[0] for _, _, placements in LAYOUTS for k in kinds_of(placements, 3)}
    assert kinds == {"replicate", "shard", "strided"}
    several = [(g, m, p) for g, m, p in LAYOUTS for h in mesh_holdings(g, m, p) if any(len(s.runs) > 1 for s in h.spans)]
    assert several, "no layout leaves a rank several runs of one dim"
