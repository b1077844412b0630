"""Who talks to whom for owner-held matrices (DESIGN 7 "owner-centric"), on a grid of R replicas ×
S shards (FSDP2 and DDP: R = 1, S = W; HSDP: the (replicate, shard) mesh; placements.mesh_cell).

A matrix's owner o is one rank of the whole group, at cell (replica r_o, shard s_o). The ranks of
shard s_o, one per replica, are its *column*: each keeps the weights between uses, as its replica's
source; every other rank frees them. Gradients flow in two stages, weights in two stages back:
  reduce   stage 1: within each replica, to the column rank (shard group, SUM)
           stage 2: across the column, to the owner (column group, SUM; HSDP only)
  weights  stage 1: from the owner across the column, after the owner's update (HSDP only)
           stage 2: within each replica, from the column rank (shard group)
The arithmetic is pure; HeldGroups adds the process groups, created by every rank in one order.
Under tensor parallelism (tensor_parallel.py) the grid is each TP rank's data-parallel group's: the
TP ranks run it side by side, each over its own group, with the process groups of all of them made
by every rank.
"""

from dataclasses import dataclass

import torch.distributed as dist

from dmuon.torch.placements import mesh_cell, unravel


@dataclass(frozen=True)
class Grid:
    """R replicas × S shards: group rank g holds shard cells[g][1] of replica cells[g][0]."""

    replicas: int
    shards: int
    cells: tuple  # ((replica, shard) of group rank 0, of rank 1, ...)

    def ranks_of_shard(self, shard):
        """Group ranks holding `shard`, one per replica, in replica order."""
        return [g for _, g in sorted((r, g) for g, (r, s) in enumerate(self.cells) if s == shard)]


def shard_of(grid, group_rank):
    return grid.cells[group_rank][1]


def replica_of(grid, group_rank):
    return grid.cells[group_rank][0]


def column_of(grid, owner):
    """Group ranks holding the owner's weights between uses: one per replica, in replica order."""
    return grid.ranks_of_shard(shard_of(grid, owner))


def replica_ranks(grid, replica):
    """Group ranks of one replica, in shard order."""
    return [g for _, g in sorted((s, g) for g, (r, s) in enumerate(grid.cells) if r == replica)]


def source_in_replica(grid, owner, replica):
    """The column rank of the owner in `replica`: the source of stage-2 broadcasts there."""
    return column_of(grid, owner)[replica]


def grid_of(mesh, world):
    """The Grid of a DeviceMesh (1-D: FSDP2 shards; 2-D: (replicate, shard)) or, with mesh None, of a
    plain process group of `world` ranks (R = 1, S = W)."""
    from torch.distributed.tensor import Replicate, Shard

    if mesh is None:
        shape, placements = (world,), (Shard(0),)
    elif mesh.ndim <= 2:
        shape, placements = tuple(mesh.shape), ((Replicate(), Shard(0)) if mesh.ndim == 2 else (Shard(0),))
    else:
        raise ValueError(f"dmuon.torch.hold_on_owners: a {mesh.ndim}-D mesh; a 1-D (FSDP2) or 2-D (HSDP: "
                         "replicate, shard) mesh is supported")
    cells = [mesh_cell(shape, unravel(g, shape), placements, 1) for g in range(world)]
    return Grid(*cells[0][1], tuple(cell for cell, _ in cells))


class HeldGroups:
    """The grid, this rank's place in it, and a process group per replica (its shard group) and per
    column, all made here: our broadcasts and reduces then never queue behind FSDP2's collectives.

    grids: the global ranks of each data-parallel group, each in grid order (group rank g of a grid is
    its g-th rank: the mesh's ranks row-major, or the process group's); one grid without tensor
    parallelism, one per TP (or EP) rank with it. mine: this rank's grid; rank: its group rank there.
    divide_factor: what the owner divides a summed gradient by, when hold_on_owners was given one (None: the
    factor set on the unit's fully_shard, else the group's size, the number of data-parallel batches
    (buffer.py); under expert parallelism more batches reach an expert than its group has ranks).
    Collective: every rank of the default group builds it in the same order, or, where the grids hold some of its
    ranks (a pipeline stage's), every rank of the grids."""

    def __init__(self, grids, mine, grid, rank, divide_factor=None):
        self.global_ranks = list(grids[mine])
        self.grid = grid
        self.rank = rank
        self.world = len(self.global_ranks)
        self.divide_factor = float(divide_factor) if divide_factor else None
        self.replica = replica_of(grid, rank)
        self.shard = shard_of(grid, rank)
        self.shard_group = self.column_group = None
        if self.world == 1:
            return
        # A pipeline stage's grids hold some of the ranks only; the other stages make theirs: each group is made by
        # its members alone (torch's local synchronization), in the same order on each of them.
        local = len({r for ranks in grids for r in ranks}) < dist.get_world_size()
        for k, ranks in enumerate(grids):
            for r in range(grid.replicas):
                pg = dist.new_group([ranks[g] for g in replica_ranks(grid, r)], use_local_synchronization=local)
                if k == mine and r == self.replica:
                    self.shard_group = pg
            if grid.replicas > 1:
                for s in range(grid.shards):
                    pg = dist.new_group([ranks[g] for g in grid.ranks_of_shard(s)], use_local_synchronization=local)
                    if k == mine and s == self.shard:
                        self.column_group = pg

    def holds(self, owner):
        """Whether this rank keeps the owner's weights between uses (it is in the owner's column)."""
        return self.shard == shard_of(self.grid, owner)

    def source(self, owner):
        """Global rank of the stage-2 source (and stage-1 reduce target) in this rank's replica."""
        return self.global_ranks[source_in_replica(self.grid, owner, self.replica)]

    def owner_global(self, owner):
        return self.global_ranks[owner]
