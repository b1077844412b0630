"""Where a parameter's values live: whole on every rank (replicated: DDP or no wrapper) or split
by rows across the ranks of a group (sharded: FSDP2's dim-0 layout).

FSDP2 shards a parameter of global shape (m, ...) as torch.chunk(full, W, dim=0) does: rank r holds
rows [r·c, min((r+1)·c, m)) with c = ceil(m/W); the last ranks may hold fewer rows or none. The row
arithmetic here is pure (no communication) and matches torch.chunk exactly.
"""

import math
from dataclasses import dataclass

import torch


@dataclass
class Sharded:
    """An explicit description of a dim-0 sharded parameter, for torch without DTensor.

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


@dataclass
class Layout:
    """How one parameter is laid out on this rank.

    tensor: what holds the values (a DTensor, a Sharded's local tensor, or a plain parameter).
    global_shape: the full parameter's shape. sharded: rows split over the group, else whole here.
    rows: chunk_rows(global_shape[0], W) for sharded parameters, else None.
    """

    tensor: torch.Tensor
    global_shape: tuple
    sharded: bool
    rows: list = None

    def local(self, t):
        """The local part of t (the parameter or its gradient) as a plain tensor."""
        return t.to_local() if _is_dtensor(t) else t


def _or_world(group):
    import torch.distributed as dist

    return dist.group.WORLD if group is None else group


def _dtensor_class():
    for module in ("torch.distributed.tensor", "torch.distributed._tensor"):
        try:
            return __import__(module, fromlist=["DTensor"]).DTensor
        except (ImportError, AttributeError):
            continue
    return None


_DTENSOR = _dtensor_class()


def _is_dtensor(t):
    return _DTENSOR is not None and isinstance(t, _DTENSOR)


def describe(name, param, group, world_size, rank):
    """The Layout of `param` (a tensor, a DTensor or a Sharded) for the optimizer's group.

    Raises ValueError naming the parameter for a layout the optimizer cannot handle.
    """
    import torch.distributed as dist

    if isinstance(param, Sharded):
        if _or_world(param.group) is not _or_world(group):
            raise ValueError(f"parameter '{name}': Sharded over another process group than the optimizer's")
        shape = tuple(int(d) for d in param.global_shape)
        if len(shape) == 0:
            raise ValueError(f"parameter '{name}': a scalar cannot be sharded by rows")
        rows = chunk_rows(shape[0], world_size)
        expected = (rows[rank][1],) + shape[1:]
        if tuple(param.local.shape) != expected:
            raise ValueError(f"parameter '{name}' on rank {rank}: local shard has shape {tuple(param.local.shape)}, "
                             f"torch.chunk of {shape} over {world_size} ranks gives {expected}")
        return Layout(param.local, shape, True, rows)
    if _is_dtensor(param):
        placements = tuple(param.placements)
        kinds = [type(p).__name__ for p in placements]
        if len(placements) != 1:
            raise ValueError(f"parameter '{name}': DTensor on a {len(placements)}-D mesh ({kinds}); "
                             "dmuon supports a 1-D mesh (Shard(0) or Replicate())")
        mesh_group = param.device_mesh.get_group()
        if dist.get_world_size(mesh_group) != world_size:
            raise ValueError(f"parameter '{name}': DTensor mesh has {dist.get_world_size(mesh_group)} ranks, "
                             f"the optimizer's process group {world_size}")
        shape = tuple(param.shape)
        if kinds[0] == "Replicate":
            return Layout(param, shape, False)
        if kinds[0] == "Shard" and placements[0].dim == 0:
            return Layout(param, shape, True, chunk_rows(shape[0], world_size))
        raise ValueError(f"parameter '{name}': DTensor placement {placements[0]} is not supported "
                         "(Shard(0) or Replicate())")
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"parameter '{name}' is a {type(param).__name__}, not a tensor or dmuon.torch.Sharded")
    return Layout(param, tuple(param.shape), False)
