"""Where a parameter's values live, as a grid of R replicas × S shards over the optimizer's group.

Every rank of the group holds one (replica, shard) cell of every parameter: the rows
torch.chunk(full, S, dim=0)[shard]. The three kinds of parameter map onto the grid as:
  plain tensor (DDP, or one process)          R = W, S = 1: every rank holds everything
  dmuon.torch.Sharded (hand-made dim-0 chunks) R = 1, S = W
  DTensor on a 1-D or 2-D DeviceMesh whose placements are Replicate() except at most one Shard(0):
    FSDP2 (Shard(0),)            R = 1, S = W
    HSDP (Replicate(), Shard(0)) R = mesh.size(0), S = mesh.size(1)
    Replicate() everywhere       R = W, S = 1
  owner-held (dmuon.torch.hold_on_owners)      R = 1, S = W, and the owner's shard holds every row
                                               (other ranks hold none: their copies come and go)
A DTensor's mesh must list exactly the optimizer group's ranks, in order, so that group rank g is the
mesh's g-th rank (row-major) and its coordinate gives g's (replica, shard).

FSDP2 and DTensor shard as torch.chunk does: shard s holds rows [s·c, min((s+1)·c, m)) with
c = ceil(m/S); the last shards may hold fewer rows or none. The arithmetic here is pure (no
communication) and matches torch.chunk exactly.
"""

import math
from dataclasses import dataclass

import torch


@dataclass
class Sharded:
    """An explicit description of a dim-0 sharded parameter, for code that shards by hand.

    local: this rank's rows, torch.chunk(full, W)[rank] (an empty (0, ...) tensor when it has none);
    the tensor the model trains, whose .grad holds the gradient of those rows.
    global_shape: the full parameter's shape. group: the process group it is sharded over (None: the
    default group); it must be the optimizer's process group.
    """

    local: torch.Tensor
    global_shape: tuple
    group: object = None


def chunk_rows(rows, world_size):
    """(start, count) of every rank's rows under torch.chunk(full, world_size, dim=0)."""
    per_rank = math.ceil(rows / world_size) if rows > 0 else 0
    out = []
    for r in range(world_size):
        start = min(r * per_rank, rows)
        out.append((start, max(0, min(per_rank, rows - start))))
    return out


@dataclass(frozen=True)
class Grid:
    """R replicas × S shards: group rank g holds shard cells[g][1] of replica cells[g][0]."""

    replicas: int
    shards: int
    cells: tuple  # ((replica, shard) of group rank 0, of rank 1, ...)

    def ranks_of_shard(self, shard):
        """Group ranks holding `shard`, one per replica, in replica order."""
        return [g for _, g in sorted((r, g) for g, (r, s) in enumerate(self.cells) if s == shard)]


def replicated_grid(world_size):
    return Grid(world_size, 1, tuple((g, 0) for g in range(world_size)))


def sharded_grid(world_size):
    return Grid(1, world_size, tuple((0, g) for g in range(world_size)))


@dataclass
class Layout:
    """How one parameter is laid out.

    tensor: what holds the values and sits in the param group (a DTensor, a Sharded's local tensor,
    or a plain parameter). global_shape: the full parameter's shape. grid: its replicas × shards.
    shard: the shard this rank holds. held: an owner-held parameter's HeldParam (owner_held.py), else None.
    """

    tensor: torch.Tensor
    global_shape: tuple
    grid: Grid
    shard: int
    held: object = None

    @property
    def held_elsewhere(self):
        """An owner-held parameter on a rank other than its owner: no values, gradient or state here."""
        return self.held is not None and self.held.owner != self.shard

    def local(self, t):
        """The local part of t (the parameter, its gradient or a state tensor) as a plain tensor."""
        return t.to_local() if is_dtensor(t) else t

    def rows_of_shard(self, shard):
        """(start, count) of the dim-0 rows that `shard` holds."""
        if self.held is not None:
            return (0, self.global_shape[0]) if shard == self.held.owner else (0, 0)
        return chunk_rows(self.global_shape[0], self.grid.shards)[shard]


def _or_world(group):
    import torch.distributed as dist

    return dist.group.WORLD if group is None else group


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


_DTENSOR = _dtensor_class()


def is_dtensor(t):
    return _DTENSOR is not None and isinstance(t, _DTENSOR)


def mesh_grid(name, mesh, placements, ndim, group_ranks):
    """The Grid of a DTensor parameter `name` with `ndim` dimensions, laid out with `placements` on a
    DeviceMesh whose rank tensor is `mesh` (device_mesh.mesh), for an optimizer over `group_ranks`
    (global ranks in group order). ValueError naming the parameter for an unsupported layout."""
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(placements)
    if mesh.dim() > 2:
        raise ValueError(f"parameter '{name}': DTensor on a {mesh.dim()}-D mesh {tuple(mesh.shape)}; "
                         "dmuon supports a 1-D mesh (FSDP2) or a 2-D one (HSDP)")
    shard_dims = []
    for d, p in enumerate(placements):
        if type(p) is Shard and ndim > 0 and p.dim % ndim == 0:
            shard_dims.append(d)
        elif type(p) is not Replicate:
            raise ValueError(f"parameter '{name}': DTensor placement {p} on mesh dim {d} is not supported "
                             f"(placements {placements}; dmuon supports Replicate() and one Shard(0))")
    if len(shard_dims) > 1:
        raise ValueError(f"parameter '{name}': DTensor sharded on dim 0 over {len(shard_dims)} mesh dims "
                         f"(placements {placements}); dmuon supports one Shard(0)")
    mesh_ranks = [int(r) for r in mesh.flatten().tolist()]
    if mesh_ranks != list(group_ranks):
        raise ValueError(f"parameter '{name}': DTensor mesh ranks {mesh_ranks} (shape {tuple(mesh.shape)}) are not "
                         f"the optimizer's process group ranks {list(group_ranks)} in order")
    shape = tuple(mesh.shape)
    shards = shape[shard_dims[0]] if shard_dims else 1
    cells = []
    for g in range(len(mesh_ranks)):
        coord = []
        for size in reversed(shape):  # row-major unravel of g
            coord.append(g % size)
            g //= size
        coord.reverse()
        shard = coord[shard_dims[0]] if shard_dims else 0
        others = [(c, s) for d, (c, s) in enumerate(zip(coord, shape)) if not shard_dims or d != shard_dims[0]]
        replica = 0
        for c, s in others:
            replica = replica * s + c
        cells.append((replica, shard))
    return Grid(len(mesh_ranks) // shards, shards, tuple(cells))


def describe(name, param, group, group_ranks, rank):
    """The Layout of `param` (a tensor, a DTensor or a Sharded) for the optimizer's group, whose
    global ranks are `group_ranks` and in which this process is `rank`.

    Raises ValueError naming the parameter for a layout the optimizer cannot handle.
    """
    world = len(group_ranks)
    held = getattr(param, "_dmuon_held", None)
    if held is not None:
        if list(held.global_ranks) != list(group_ranks):
            raise ValueError(f"parameter '{name}': held on its owner over ranks {list(held.global_ranks)} "
                             f"(dmuon.torch.hold_on_owners), not the optimizer's process group ranks {list(group_ranks)}")
        return Layout(param, tuple(param.shape), sharded_grid(world), rank, held)
    if isinstance(param, Sharded):
        if _or_world(param.group) is not _or_world(group):
            raise ValueError(f"parameter '{name}': Sharded over another process group than the optimizer's")
        shape = tuple(int(d) for d in param.global_shape)
        if len(shape) == 0:
            raise ValueError(f"parameter '{name}': a scalar cannot be sharded by rows")
        layout = Layout(param.local, shape, sharded_grid(world), rank)
        expected = (layout.rows_of_shard(rank)[1],) + shape[1:]
        if tuple(param.local.shape) != expected:
            raise ValueError(f"parameter '{name}' on rank {rank}: local shard has shape {tuple(param.local.shape)}, "
                             f"torch.chunk of {shape} over {world} ranks gives {expected}")
        return layout
    if is_dtensor(param):
        grid = mesh_grid(name, param.device_mesh.mesh, param.placements, param.dim(), group_ranks)
        layout = Layout(param, tuple(param.shape), grid, grid.cells[rank][1])
        expected = (layout.rows_of_shard(layout.shard)[1],) + layout.global_shape[1:] if grid.shards > 1 \
            else layout.global_shape
        local = param.to_local()
        if tuple(local.shape) != expected:
            raise ValueError(f"parameter '{name}' on rank {rank}: DTensor local shape {tuple(local.shape)}, "
                             f"torch.chunk of {layout.global_shape} over {grid.shards} shards gives {expected}")
        return layout
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"parameter '{name}' is a {type(param).__name__}, not a tensor or dmuon.torch.Sharded")
    return Layout(param, tuple(param.shape), replicated_grid(world), 0)
