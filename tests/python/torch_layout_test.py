"""The pure parts of dmuon.torch's layouts and Muon step, single process (pytest, no process group):
the replicas × shards grid of a DTensor's mesh and placements, the rows every rank holds of each
Muon matrix (experts of a stack are whole matrices), and the owner rule."""

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from dmuon.torch.layout import Layout, chunk_rows, mesh_grid, replicated_grid, sharded_grid
from dmuon.torch.muon_step import MuonMatrix, assign_owners, matrices_of

HSDP = torch.arange(4).reshape(2, 2)  # ranks [[0, 1], [2, 3]]: mesh dim 0 replicates, dim 1 shards


def test_fsdp2_mesh_is_one_replica_of_world_shards():
    grid = mesh_grid("w", torch.arange(3), [Shard(0)], 2, [0, 1, 2])
    assert (grid.replicas, grid.shards, grid.cells) == (1, 3, ((0, 0), (0, 1), (0, 2)))
    assert grid == sharded_grid(3)


def test_hsdp_mesh_rows_are_replicas():
    grid = mesh_grid("w", HSDP, [Replicate(), Shard(0)], 2, [0, 1, 2, 3])
    assert (grid.replicas, grid.shards) == (2, 2)
    assert grid.cells == ((0, 0), (0, 1), (1, 0), (1, 1))
    assert grid.ranks_of_shard(1) == [1, 3]


def test_shard_on_the_first_mesh_dim_and_negative_dim():
    grid = mesh_grid("w", HSDP, [Shard(-2), Replicate()], 2, [0, 1, 2, 3])
    assert (grid.replicas, grid.shards) == (2, 2)
    assert grid.cells == ((0, 0), (1, 0), (0, 1), (1, 1))


def test_replicated_dtensor_is_every_rank_a_replica():
    assert mesh_grid("w", HSDP, [Replicate(), Replicate()], 2, [0, 1, 2, 3]) == replicated_grid(4)


def test_mesh_of_a_subgroup_matches_its_global_ranks():
    grid = mesh_grid("w", torch.tensor([4, 6]), [Shard(0)], 2, [4, 6])
    assert grid == sharded_grid(2)


@pytest.mark.parametrize("placements, needle", [
    ([Shard(1)], "Shard(dim=1)"),
    ([Partial()], "Partial"),
    ([_StridedShard(0, split_factor=2)], "_StridedShard"),
])
def test_unsupported_placements_are_named(placements, needle):
    with pytest.raises(ValueError, match="'layers.3.w'") as e:
        mesh_grid("layers.3.w", torch.arange(2), placements, 2, [0, 1])
    assert needle in str(e.value)


def test_two_shard_dims_and_3d_meshes_are_refused():
    with pytest.raises(ValueError, match="'w'.*one Shard"):
        mesh_grid("w", HSDP, [Shard(0), Shard(0)], 2, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="'w'.*3-D mesh"):
        mesh_grid("w", torch.arange(8).reshape(2, 2, 2), [Replicate(), Replicate(), Shard(0)], 2, list(range(8)))


@pytest.mark.parametrize("mesh, group", [
    (torch.tensor([1, 0]), [0, 1]),                 # permuted
    (torch.tensor([2, 3]), [0, 1]),                 # foreign, same size
    (torch.tensor([[0, 2], [1, 3]]), [0, 1, 2, 3]),  # the right ranks, another order
])
def test_a_mesh_is_checked_by_its_ranks(mesh, group):
    with pytest.raises(ValueError, match="'w': DTensor mesh ranks .* not the optimizer's process group ranks"):
        mesh_grid("w", mesh, [Shard(0)] if mesh.dim() == 1 else [Replicate(), Shard(0)], 2, group)


def layout(global_shape, grid, shard):
    rows = chunk_rows(global_shape[0], grid.shards)[shard][1]
    return Layout(torch.zeros((rows,) + tuple(global_shape[1:])), tuple(global_shape), grid, shard)


def test_matrices_of_a_stack_a_matrix_and_a_conv():
    assert matrices_of((8, 24, 16), experts=True) == [(e, 24, 16) for e in range(8)]
    assert matrices_of((7, 12), experts=False) == [(None, 7, 12)]
    assert matrices_of((16, 8, 3), experts=False) == [(None, 16, 24)]  # a Conv1d's (out, in, k)
    assert matrices_of((6, 3, 2, 2), experts=False) == [(None, 6, 12)]


def test_rows_of_a_sharded_matrix_are_torch_chunk():
    grid = mesh_grid("w", HSDP, [Replicate(), Shard(0)], 2, [0, 1, 2, 3])
    k = MuonMatrix(0, None, "w", layout((7, 12), grid, 0), {}, 7, 12, 1.0)
    assert k.rank_rows == ((0, 4), (4, 3), (0, 4), (4, 3))
    assert k.holders() == []


def test_experts_of_a_sharded_stack_are_whole_on_one_shard():
    grid = sharded_grid(3)
    stack = [MuonMatrix(0, e, f"s[{e}]", layout((5, 4, 6), grid, 2), {}, 4, 6, 1.0) for e in range(5)]
    assert [k.holders() for k in stack] == [[0], [0], [1], [1], [2]]  # torch.chunk(5 experts, 3): 2, 2, 1
    assert stack[4].rank_rows == ((0, 0), (0, 0), (0, 4))
    local = torch.arange(24.0).reshape(1, 4, 6)  # shard 2 holds expert 4 only
    assert torch.equal(stack[4].local_view(local), local[0])


def test_owner_rule_pins_experts_to_holders_spread_over_replicas_and_plans_the_rest():
    grid = mesh_grid("w", HSDP, [Replicate(), Shard(0)], 2, [0, 1, 2, 3])
    experts = [MuonMatrix(0, e, f"s[{e}]", layout((4, 8, 8), grid, 0), {}, 8, 8, 1.0) for e in range(4)]
    matrix = MuonMatrix(1, None, "w", layout((8, 8), grid, 0), {}, 8, 8, 1.0)
    replicated = MuonMatrix(2, None, "r", layout((8, 8), replicated_grid(4), 0), {}, 8, 8, 1.0)
    planned = []

    def plan(shapes, world):
        planned.append((shapes, world))
        return [3, 1]

    assign_owners(experts + [matrix, replicated], 4, plan)
    # shard 0 (ranks 0 and 2) holds experts 0, 1; shard 1 (ranks 1 and 3) holds experts 2, 3
    assert [k.owner for k in experts] == [0, 2, 1, 3]
    assert not any(k.u_travels for k in experts) and all(k.o_travels for k in experts)
    assert planned == [([(8, 8), (8, 8)], 4)]
    assert (matrix.owner, replicated.owner) == (3, 1)
    assert matrix.u_travels and not replicated.u_travels
