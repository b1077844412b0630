"""Where a parameter's values live: per rank of the optimizer's group, the part of the global tensor it holds
(placements.Holding: a replica index and per tensor dim the global indices held).

  plain tensor (DDP, or one process)          every rank holds everything; rank g is replica g
  dmuon.torch.Sharded (hand-made dim-0 chunks) rank g holds torch.chunk(full, W, dim=0)[g]
  DTensor on a DeviceMesh of any dimension     what its placements give (placements.py): Replicate(),
                                               Shard(d) and _StridedShard(d, sf) in any mix (FSDP2,
                                               HSDP, tensor and expert parallelism, FSDP2 over TP)
  owner-held (dmuon.torch.hold_on_owners)      the owner holds everything, the other ranks nothing
                                               (their copies come and go); under tensor parallelism
                                               each rank of the owner's TP group its slice
A DTensor's mesh must list exactly the optimizer group's ranks, in order (a pipeline stage's DMuon: its
stage's mesh and process group), so that group rank g is the mesh's g-th rank (row-major); or be a slice
by name of such a mesh (FSDP2's "dp" slice of a ("dp", "tp") mesh), Replicate() on the other dims.
"""

from dataclasses import dataclass

import torch

from dmuon.torch.dtensors import is_dtensor, local_part
from dmuon.torch.held.placeholder import HeldElsewhere
from dmuon.torch.placements import chunk, kinds_of, mesh_holdings, replicated_holdings, row_chunk_holdings
from dmuon.torch.torch_private import default_shard_order, on_root_mesh


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
    return [chunk(rows, world_size, r) for r in range(world_size)]


@dataclass
class Layout:
    """How one parameter is laid out.

    tensor: what holds the values and sits in the param group (a DTensor, a Sharded's local tensor,
    or a plain parameter). global_shape: the full parameter's shape. holdings: the placements.Holding
    of every group rank. rank: this process's group rank. placements: a DTensor's, for messages.
    held: an owner-held parameter's HeldParam (held/hold.py), else None.
    """

    tensor: torch.Tensor
    global_shape: tuple
    holdings: tuple
    rank: int
    placements: tuple = ()
    held: object = None

    @property
    def held_elsewhere(self):
        """An owner-held parameter that this rank does not keep (neither its owner nor, under tensor
        parallelism, a rank of the owner's TP group): no values, gradient or state here."""
        return self.held is not None and self.held.owner != self.rank and 0 in self.mine.shape

    @property
    def mine(self):
        """This rank's Holding."""
        return self.holdings[self.rank]

    def local(self, t):
        """The local part of t (the parameter, its gradient or a state tensor) as a plain tensor."""
        return local_part(t)


def _or_world(group):
    import torch.distributed as dist

    return dist.group.WORLD if group is None else group


def _ranks(device_mesh):
    return [int(r) for r in device_mesh.mesh.flatten().tolist()]


def mesh_layout(name, param, group_ranks, rank):
    """The Layout of DTensor parameter `name` for an optimizer over `group_ranks` (global ranks in group
    order). ValueError naming the parameter for a layout dmuon cannot take."""
    placements = tuple(param.placements)
    try:
        kinds_of(placements, param.dim())
    except ValueError as e:
        raise ValueError(f"parameter '{name}': DTensor {e}; placements {placements}") from None
    if not default_shard_order(param):
        raise ValueError(f"parameter '{name}': DTensor placements {placements} applied in a shard order other "
                         "than left to right over the mesh dims; dmuon takes the default order")
    mesh = param.device_mesh
    root = on_root_mesh(mesh, placements)
    if root is not None and _ranks(root[0]) == list(group_ranks):
        mesh, placements = root
    mesh_ranks = _ranks(mesh)
    if mesh_ranks != list(group_ranks):
        raise ValueError(f"parameter '{name}': DTensor mesh ranks {mesh_ranks} (shape {tuple(mesh.shape)}) are not "
                         f"the optimizer's process group ranks {list(group_ranks)} in order")
    shape = tuple(param.shape)
    layout = Layout(param, shape, mesh_holdings(shape, tuple(mesh.mesh.shape), placements), rank, placements)
    local = tuple(param.to_local().shape)
    if local != layout.mine.shape:
        raise ValueError(f"parameter '{name}' on rank {rank}: DTensor local shape {local}, placements "
                         f"{placements} of {shape} on mesh {tuple(mesh.mesh.shape)} give {layout.mine.shape}")
    return layout


def describe(name, param, group, group_ranks, rank):
    """The Layout of `param` (a tensor, a DTensor or a Sharded) for the optimizer's group, whose
    global ranks are `group_ranks` and in which this process is `rank`.

    Raises ValueError naming the parameter for a layout the optimizer cannot handle.
    """
    world = len(group_ranks)
    held = getattr(param, "_dmuon_held", None)
    if held is None and isinstance(param, HeldElsewhere):
        raise ValueError(f"parameter '{name}': a placeholder of a matrix held on rank {param.held_owner} "
                         "(dmuon.torch.hold_on_owners) without its marks: .to_empty() or .to() replaced it after "
                         "hold_on_owners. Build DMuon from the model (DMuon(model)), or read held.params first: "
                         "either marks the new parameters")
    if held is not None:
        if list(held.global_ranks) != list(group_ranks):
            raise ValueError(f"parameter '{name}': held on its owner over ranks {list(held.global_ranks)} "
                             f"(dmuon.torch.hold_on_owners), not the optimizer's process group ranks {list(group_ranks)}")
        return Layout(param, tuple(param.shape), held.holdings, rank,
                      tuple(param.placements) if is_dtensor(param) else (), held=held)
    if isinstance(param, Sharded):
        if _or_world(param.group) is not _or_world(group):
            raise ValueError(f"parameter '{name}': Sharded over another process group than the optimizer's")
        shape = tuple(int(d) for d in param.global_shape)
        if len(shape) == 0:
            raise ValueError(f"parameter '{name}': a scalar cannot be sharded by rows")
        layout = Layout(param.local, shape, row_chunk_holdings(shape, world), rank)
        if tuple(param.local.shape) != layout.mine.shape:
            raise ValueError(f"parameter '{name}' on rank {rank}: local shard has shape {tuple(param.local.shape)}, "
                             f"torch.chunk of {shape} over {world} ranks gives {layout.mine.shape}")
        return layout
    if is_dtensor(param):
        return mesh_layout(name, param, group_ranks, rank)
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"parameter '{name}' is a {type(param).__name__}, not a tensor or dmuon.torch.Sharded")
    return Layout(param, tuple(param.shape), replicated_holdings(tuple(param.shape), world), rank)
