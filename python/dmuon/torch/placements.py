"""Which part of a global tensor each rank holds: pure arithmetic on shapes, mesh coordinates and DTensor
placements, no process group (unit-tested against torch's own answer in tests/python/torch_placements_test.py).

A rank's part of a tensor is, per tensor dim, a Span: the global indices of that dim it holds, in the order
of its local tensor, as runs (start, length). Each placement shards one tensor dim, so the part is the
product of the dims' spans: one rectangle per combination of runs (rectangles()).

Placements apply left to right over the mesh dims (DTensor's default shard order), each to the span its
tensor dim has so far, for the rank's coordinate c on a mesh dim of size n:
  Replicate()              the span is unchanged
  Shard(d)                 the span's positions split as torch.chunk into n parts; the rank keeps part c
  _StridedShard(d, sf)     the span's positions split as torch.chunk into sf parts, each of those into n;
                           the rank keeps part c of each, concatenated (FSDP2 over tensor parallelism:
                           rows sharded by TP first, then by FSDP)
torch.chunk's parts: ceil(L/n) positions each, the last ones shorter or empty. Shard and even
_StridedShard leave one run per dim; an uneven _StridedShard may leave several.

The replicas of a tensor: ranks whose coordinates differ only on mesh dims where it is Replicate() hold
equal parts. A rank's replica is its coordinate on those dims (row-major), its shard its coordinate on the
others: the ranks of one replica hold every element once.
"""

import math
from dataclasses import dataclass

from dmuon.torch.torch_private import placement_kind


def chunk(count, parts, index):
    """(start, length) of part `index` of `count` positions split as torch.chunk(…, parts)."""
    size = -(-count // parts)
    start = min(index * size, count)
    return start, max(0, min(size, count - start))


@dataclass(frozen=True)
class Span:
    """The global indices of one tensor dim a rank holds, in local order: runs ((start, length), ...)."""

    runs: tuple

    @staticmethod
    def whole(size):
        return Span(((0, size),) if size else ())

    @property
    def count(self):
        return sum(n for _, n in self.runs)

    def take(self, start, length):
        """The span of local positions [start, start + length)."""
        out, position = [], 0
        for s, n in self.runs:
            lo, hi = max(start, position), min(start + length, position + n)
            if lo < hi:
                out.append((s + lo - position, hi - lo))
            position += n
        return _merged(out)

    def split(self, parts, index, split_factor=1):
        """Part `index` of this span under Shard (split_factor 1) or _StridedShard over `parts` ranks."""
        out = []
        for j in range(split_factor):
            first, length = chunk(self.count, split_factor, j)
            start, count = chunk(length, parts, index)
            out.extend(self.take(first + start, count).runs)
        return _merged(out)

    def position_of(self, index):
        """The local position of global index `index`, None when not held."""
        position = 0
        for s, n in self.runs:
            if s <= index < s + n:
                return position + index - s
            position += n
        return None

    def indices(self):
        """Every global index, in local order."""
        return [i for s, n in self.runs for i in range(s, s + n)]


def _merged(runs):
    """Runs with adjacent ones joined (one run per contiguous stretch, local order kept)."""
    out = []
    for s, n in runs:
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((s, n))
    return Span(tuple(out))


@dataclass(frozen=True)
class Holding:
    """What one rank holds of a tensor: its replica (see the module docstring) and per tensor dim a Span."""

    replica: int
    spans: tuple

    @property
    def shape(self):
        """The local tensor's shape."""
        return tuple(s.count for s in self.spans)

    def whole_along(self, global_shape, dims):
        """Whether it holds all of each tensor dim in `dims` (of a tensor of `global_shape`)."""
        return all(self.spans[d] == Span.whole(global_shape[d]) for d in dims)


def unravel(index, shape):
    """The row-major coordinate of flat `index` in `shape`."""
    coordinate = []
    for size in reversed(shape):
        coordinate.append(index % size)
        index //= size
    return tuple(reversed(coordinate))


def _ravel(coordinate, shape):
    flat = 0
    for c, s in zip(coordinate, shape):
        flat = flat * s + c
    return flat


def kinds_of(placements, ndim):
    """placement_kind of each placement; ValueError naming the first one dmuon cannot take."""
    out = []
    for mesh_dim, p in enumerate(placements):
        kind = placement_kind(p, ndim)
        if kind is None:
            raise ValueError(f"placement {p!r} on mesh dim {mesh_dim} is not supported (dmuon takes Replicate(), "
                             "Shard(d) and _StridedShard(d, sf))")
        out.append(kind)
    return out


def local_spans(global_shape, mesh_shape, coordinate, placements):
    """Per tensor dim, the Span the rank at `coordinate` holds of a tensor of `global_shape` laid out with
    `placements` on a mesh of `mesh_shape`."""
    spans = [Span.whole(n) for n in global_shape]
    for mesh_dim, kind in enumerate(kinds_of(placements, len(global_shape))):
        if kind[0] != "replicate":
            split_factor = kind[2] if kind[0] == "strided" else 1
            spans[kind[1]] = spans[kind[1]].split(mesh_shape[mesh_dim], coordinate[mesh_dim], split_factor)
    return tuple(spans)


def mesh_cell(mesh_shape, coordinate, placements, ndim):
    """(replica, shard) of the rank at `coordinate` (the module docstring), and (replicas, shards) counts."""
    kinds = kinds_of(placements, ndim)
    replicate = [d for d, k in enumerate(kinds) if k[0] == "replicate"]
    shard = [d for d, k in enumerate(kinds) if k[0] != "replicate"]

    def on(dims):
        return _ravel([coordinate[d] for d in dims], [mesh_shape[d] for d in dims])
    return (on(replicate), on(shard)), (math.prod(mesh_shape[d] for d in replicate),
                                        math.prod(mesh_shape[d] for d in shard))


def mesh_holdings(global_shape, mesh_shape, placements):
    """The Holding of every rank of the mesh, in row-major rank order."""
    out = []
    for index in range(math.prod(mesh_shape)):
        coordinate = unravel(index, mesh_shape)
        (replica, _), _ = mesh_cell(mesh_shape, coordinate, placements, len(global_shape))
        out.append(Holding(replica, local_spans(global_shape, mesh_shape, coordinate, placements)))
    return tuple(out)


def replicated_holdings(global_shape, world):
    """Every rank holds everything (a plain parameter: DDP or one process); rank g is replica g."""
    return tuple(Holding(g, tuple(Span.whole(n) for n in global_shape)) for g in range(world))


def row_chunk_holdings(global_shape, world):
    """torch.chunk(full, world, dim=0)[g] on rank g (dmuon.torch.Sharded, FSDP2 over a plain group)."""
    rest = tuple(Span.whole(n) for n in global_shape[1:])
    return tuple(Holding(0, (Span.whole(global_shape[0]).split(world, g),) + rest) for g in range(world))


def owner_holdings(global_shape, world, owner):
    """The owner holds everything, every other rank nothing (an owner-held parameter)."""
    nothing = (Span(()),) + tuple(Span.whole(n) for n in global_shape[1:])
    everything = tuple(Span.whole(n) for n in global_shape)
    return tuple(Holding(0, everything if g == owner else nothing) for g in range(world))


def rectangles(spans):
    """The rectangles of a part, in local order: [(global offsets, lengths)], one per combination of runs."""
    out = [((), ())]
    for span in spans:
        out = [(o + (s,), l + (n,)) for o, l in out for s, n in span.runs]
    return out
