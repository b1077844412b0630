"""The pure parts of dmuon.torch's Muon step, single process (pytest, no process group): the piece every
rank holds of each Muon matrix (rows of FSDP2 and HSDP chunks, a column block under tensor parallelism,
experts of a stack whole), and the owner rule. Which part of a tensor a rank holds is placements.py's,
pinned to torch in torch_placements_test.py. Also the data-parallel mesh hold_on_owners takes from the whole
mesh a user has after parallelize_module (held/tensor_parallel.py's data_parallel_mesh), on stand-in meshes."""

import torch
from torch.distributed.tensor import Replicate, Shard

import pytest

from dmuon.torch.held.tensor_parallel import data_parallel_mesh
from dmuon.torch.layout import Layout
from dmuon.torch.muon_options import DEFAULTS, MuonOptions
from dmuon.torch.matrices import MuonMatrix, assign_owners, matrices_of
from dmuon.torch.placements import mesh_holdings, replicated_holdings, row_chunk_holdings

HSDP = ((2, 2), (Replicate(), Shard(0)))  # ranks [[0, 1], [2, 3]]: mesh dim 0 replicates, dim 1 shards


def layout(global_shape, holdings, rank):
    return Layout(torch.zeros(holdings[rank].shape), tuple(global_shape), holdings, rank)


def hsdp(global_shape):
    return mesh_holdings(global_shape, *HSDP)


def test_matrices_of_a_stack_a_matrix_and_a_conv():
    assert matrices_of((8, 24, 16), experts=True) == [(e, 24, 16) for e in range(8)]
    assert matrices_of((7, 12), experts=False) == [(None, 7, 12)]
    assert matrices_of((16, 8, 3), experts=False) == [(None, 16, 24)]  # a Conv1d's (out, in, k)
    assert matrices_of((6, 3, 2, 2), experts=False) == [(None, 6, 12)]


def pieces(k):
    return [(p.rows.runs, p.cols.runs) for p in k.pieces]


def test_rows_of_a_sharded_matrix_are_torch_chunk():
    k = MuonMatrix(0, None, "w", layout((7, 12), hsdp((7, 12)), 0), {}, 7, 12, 1.0)
    assert pieces(k) == [(((0, 4),), ((0, 12),)), (((4, 3),), ((0, 12),))] * 2
    assert [k.replica_of(g) for g in range(4)] == [0, 0, 1, 1]
    assert k.holders() == []


def test_a_row_wise_tensor_parallel_matrix_is_column_blocks():
    holdings = mesh_holdings((6, 7), (2,), (Shard(1),))
    k = MuonMatrix(0, None, "w", layout((6, 7), holdings, 1), {}, 6, 7, 1.0)
    assert pieces(k) == [(((0, 6),), ((0, 4),)), (((0, 6),), ((4, 3),))]
    local = torch.arange(18.0).reshape(6, 3)
    assert k.local_view(local).shape == (6, 3) and k.local_view(local).data_ptr() == local.data_ptr()


def test_experts_of_a_sharded_stack_are_whole_on_one_shard():
    holdings = row_chunk_holdings((5, 4, 6), 3)
    stack = [MuonMatrix(0, e, f"s[{e}]", layout((5, 4, 6), holdings, 2), {}, 4, 6, 1.0) for e in range(5)]
    assert [k.holders() for k in stack] == [[0], [0], [1], [1], [2]]  # torch.chunk(5 experts, 3): 2, 2, 1
    assert [p.count for p in stack[4].pieces] == [0, 0, 24]
    local = torch.arange(24.0).reshape(1, 4, 6)  # shard 2 holds expert 4 only
    assert torch.equal(stack[4].local_view(local), local[0])


def test_owner_rule_pins_experts_to_holders_spread_over_replicas_and_plans_the_rest():
    unsplit = MuonOptions.of_group(DEFAULTS)
    split = MuonOptions.of_group({**DEFAULTS, "split_heads": 2, "split_dim": 1})  # the planner gets its blocks
    experts = [MuonMatrix(0, e, f"s[{e}]", layout((4, 8, 8), hsdp((4, 8, 8)), 0), {}, 8, 8, unsplit) for e in range(4)]
    matrix = MuonMatrix(1, None, "w", layout((8, 8), hsdp((8, 8)), 0), {}, 8, 8, split)
    replicated = MuonMatrix(2, None, "r", layout((8, 8), replicated_holdings((8, 8), 4), 0), {}, 8, 8, unsplit)
    planned = []

    def plan(shapes, world, blocks):
        planned.append((shapes, world, blocks))
        return [3, 1]

    assign_owners(experts + [matrix, replicated], 4, plan)
    # shard 0 (ranks 0 and 2) holds experts 0, 1; shard 1 (ranks 1 and 3) holds experts 2, 3
    assert [k.owner for k in experts] == [0, 2, 1, 3]
    assert not any(k.u_travels for k in experts) and all(k.o_travels for k in experts)
    assert planned == [([(8, 8), (8, 8)], 4, [[(8, 4), (8, 4)], None])]
    assert (matrix.owner, replicated.owner) == (3, 1)
    assert matrix.u_travels and not replicated.u_travels


def test_an_expert_split_over_expert_fsdp_is_owned_where_its_pieces_are():
    # (ep 2, efsdp 2): ranks 0, 1 hold rows of experts 0, 1; ranks 2, 3 of experts 2, 3. No rank holds an
    # expert whole; each is owned by a rank of its pair, spread over the pair.
    holdings = mesh_holdings((4, 6, 4), (2, 2), (Shard(0), Shard(1)))
    stack = [MuonMatrix(0, e, f"s[{e}]", layout((4, 6, 4), holdings, 0), {}, 6, 4, 1.0) for e in range(4)]
    assign_owners(stack, 4, lambda shapes, world, blocks: [])
    assert [k.owner for k in stack] == [0, 1, 2, 3]
    assert all(k.u_travels and k.o_travels for k in stack)


class StandInMesh:
    """What data_parallel_mesh reads of a DeviceMesh: named dims, their sizes, the root, slicing by names."""

    def __init__(self, names, sizes, root=None):
        self.mesh_dim_names, self.mesh, self._root = tuple(names), torch.zeros(sizes), root

    @property
    def ndim(self):
        return len(self.mesh_dim_names)

    def _get_root_mesh(self):
        return self._root or self

    def __getitem__(self, names):
        names = (names,) if isinstance(names, str) else names
        sizes = [self.mesh.shape[self.mesh_dim_names.index(n)] for n in names]
        return StandInMesh(names, sizes, self._get_root_mesh())


class StandInDTensor:
    def __init__(self, mesh):
        self.device_mesh = mesh


@pytest.fixture
def dtensor_class(monkeypatch):
    import dmuon.torch.held.tensor_parallel as tensor_parallel_module  # where data_parallel_mesh looks it up
    monkeypatch.setattr(tensor_parallel_module, "is_dtensor", lambda t: isinstance(t, StandInDTensor))


@pytest.mark.parametrize("names, sizes, slice_names", [
    (("dp", "tp"), (2, 2), ("dp",)), (("replicate", "dp", "tp"), (2, 2, 2), ("replicate", "dp")),
    (("pp", "dp", "tp"), (1, 2, 2), ("dp",)), (("dp", "ep"), (2, 2), ("dp",)), (("tp", "dp"), (2, 3), ("dp",))])
def test_the_whole_mesh_gives_hold_on_owners_its_data_parallel_dims(dtensor_class, names, sizes, slice_names):
    whole = StandInMesh(names, sizes)
    parallel = whole[names[-1] if names[-1] in ("tp", "ep") else "tp"]
    got = data_parallel_mesh([("q.weight", StandInDTensor(parallel))], whole)
    assert got.mesh_dim_names == slice_names and got._get_root_mesh() is whole


def test_a_data_parallel_mesh_or_plain_matrices_keep_the_mesh_given(dtensor_class):
    whole = StandInMesh(("dp", "tp"), (2, 2))
    assert data_parallel_mesh([("q.weight", StandInDTensor(whole["tp"]))], whole["dp"]).mesh_dim_names == ("dp",)
    assert data_parallel_mesh([("q.weight", torch.zeros(2, 2))], whole) is whole
    assert data_parallel_mesh([("q.weight", StandInDTensor(whole))], whole) is whole  # already 2-D: refused later


def test_a_mesh_with_more_than_two_other_dims_is_refused_naming_the_slice(dtensor_class):
    whole = StandInMesh(("replicate", "dp", "cp", "tp"), (2, 2, 2, 2))
    with pytest.raises(ValueError, match=r"more than two other dims of size > 1 \('replicate', 'dp', 'cp'\): give "
                                         r"the data-parallel mesh fully_shard gets, a slice of it \(mesh\[\"dp\"\]"):
        data_parallel_mesh([("q.weight", StandInDTensor(whole["tp"]))], whole)
