"""Owner-held matrices under tensor parallelism (docs/pytorch.md, "Owner-held matrices", "Tensor parallelism";
docs/design.md section 7).

A matrix that tensor parallelism has made a DTensor (parallelize_module: Shard(0) column-wise, Shard(1)
row-wise) on a 1-D TP mesh is held as its T slices. Every rank of the optimizer's group is a cell
(d, t) of the frame mesh: the TP mesh's root mesh (whose named dims are the TP and data-parallel ones), or
the data-parallel mesh and the TP mesh joined (DeviceMesh._concatenate; torchtitan's meshes are views of one
flat "world" mesh); t its TP coordinate, d its coordinate on the other dims (the data-parallel ones
fully_shard gets), row-major. A matrix owned by group rank o lives on the TP group
of o's data-parallel coordinate d_o: rank (d_o, t) keeps slice t whole (its master), every other rank
(d, t) a placeholder of slice t. So over the data-parallel dims each slice is an owner-held tensor of
the data-parallel group of its TP rank (the D ranks (·, t)): the hooks move it there exactly as the
mode without TP moves a matrix (groups.py, run once per TP coordinate side by side). In DMuon's
step the matrix is pieces on the owner's TP group (holdings): its slices of U meet on o, which runs
its Newton–Schulz once, and its slices of O go back (the all-to-all exchange of exchange.py, every
byte of it within the TP group).

  group rank g = the frame mesh's flat index = (d, t)     dp_groups[t] = the group ranks (0, t), (1, t), …

Expert parallelism is the same frame with the EP mesh in the TP mesh's place: an (E, m, n) expert stack
Shard(0) over a 1-D EP mesh (transformers' grouped_gemm, torchtitan's routed experts) is held as its EP
slices, whole experts, on the owner's EP group; the data-parallel mesh is then the expert-FSDP one ("efsdp",
EP's sibling dims on the expert mesh). Every expert lies whole on one rank (d_o, t), which owns it in
DMuon's step (matrices.assign_owners): no byte of it moves there.

What cannot be held (refused by name, with the reason): a matrix replicated over the TP dim (its
Newton–Schulz would run once per TP rank, and TP may leave its gradient Partial()); an expert stack split
within its experts (Shard(1), Shard(2)) or a conv filter (≥ 3-D) under tensor parallelism; TP meshes of
more than one dim, or different TP meshes (TP slices and EP stacks: one hold_on_owners call each); a TP
mesh whose frame is not the optimizer group's ranks; held matrices mixed with matrices tensor parallelism
leaves whole; a DTensor that fully_shard already sharded over the data-parallel mesh. A root mesh's dims
other than the TP and data-parallel ones must have size 1 (transformers' pp and dp_replicate at 1). The
data-parallel mesh may be 1-D (FSDP2) or 2-D (HSDP: its replicas and columns per TP rank as groups.py has
them).
"""

import math
from dataclasses import dataclass

from dmuon.torch.dtensors import is_dtensor
from dmuon.torch.placements import Holding, Span, local_spans, unravel
from dmuon.torch.torch_private import concatenated_mesh, placement_kind


def _ranks(mesh):
    return [int(r) for r in mesh.mesh.flatten().tolist()]


def _names(mesh):
    return tuple(mesh.mesh_dim_names or ())


@dataclass(frozen=True)
class TensorParallel:
    """The cells of the group under a T-way TP mesh: cells[g] = (d, t) of group rank g, D data-parallel
    coordinates; tp_mesh: the parameters' DeviceMesh."""

    tp_mesh: object
    cells: tuple
    tp: int
    dp: int
    rank: int  # this process's group rank
    frame: object  # the DeviceMesh of every group rank: the TP mesh's root, or the data-parallel and TP meshes joined
    tp_dim: int  # the TP dim's index in frame

    def root_and_dim(self):
        """(the DeviceMesh of every group rank, the index of the TP dim in it)."""
        return self.frame, self.tp_dim

    def dp_of(self, g):
        return self.cells[g][0]

    def dp_groups(self):
        """Per TP coordinate t, the group ranks (d, t) in d order."""
        return [[g for d in range(self.dp) for g, c in enumerate(self.cells) if c == (d, t)] for t in range(self.tp)]

    def holdings(self, shape, placements, owner):
        """Every group rank's Holding of a matrix of global `shape` owned by `owner`: slice t of its TP
        placements on the ranks (d_owner, t), nothing elsewhere (one replica: every element once)."""
        d_owner = self.dp_of(owner)
        nothing = (Span(()),) + tuple(Span.whole(n) for n in shape[1:])
        return tuple(Holding(0, local_spans(shape, (self.tp,), (t,), placements) if d == d_owner else nothing)
                     for d, t in self.cells)


def data_parallel_mesh(chosen, mesh):
    """hold_on_owners's mesh as the data-parallel mesh fully_shard gets. The mesh itself, but for the whole mesh a user
    has after parallelize_module(model, mesh["tp"], plan) (the parameters' TP or EP mesh a named 1-D slice of it): its
    other dims, mesh["dp"] (HSDP: mesh["replicate", "dp"]; dims of size 1 left out where others remain). ValueError
    naming the slice to pass where more than two other dims leave it ambiguous which fully_shard gets."""
    meshes = {id(p.device_mesh): p.device_mesh for _, p in chosen if is_dtensor(p)}
    if mesh is None or mesh.ndim < 2 or len(meshes) != 1:
        return mesh  # a data-parallel mesh, or several parameter meshes (tensor_parallel refuses those)
    tp_mesh = next(iter(meshes.values()))
    names, tp_names = _names(mesh), _names(tp_mesh)
    if tp_mesh.ndim != 1 or not tp_names or tp_names[0] not in names or \
            tp_mesh._get_root_mesh() != mesh._get_root_mesh():
        return mesh
    others = [(n, size) for n, size in zip(names, mesh.mesh.shape) if n != tp_names[0]]
    if len(others) > 1:
        others = [(n, size) for n, size in others if size > 1] or others[:1]
    dims = tuple(n for n, _ in others)
    if len(dims) > 2:
        raise ValueError(f"dmuon.torch.hold_on_owners: the mesh {names} holds the parameters' TP mesh "
                         f"'{tp_names[0]}' and more than two other dims of size > 1 {dims}: give the data-parallel "
                         f"mesh fully_shard gets, a slice of it (mesh[\"dp\"], mesh[\"replicate\", \"dp\"] for HSDP)")
    return mesh[dims[0]] if len(dims) == 1 else mesh[dims]


def _refuse(name, reason):
    raise ValueError(f"dmuon.torch.hold_on_owners: parameter '{name}' {reason}")


def tensor_parallel(chosen, mesh, group_ranks, rank, stacks):
    """The TensorParallel frame of the parameters to hold ([(name, parameter)]), None when none is a
    DTensor (the mode without TP). mesh: hold_on_owners's (the data-parallel mesh fully_shard gets, or
    None: TP alone); stacks: name → whether it is a stack of experts (hold_on_owners's `experts` predicate,
    matrices.is_stack). ValueError naming the parameter and the reason for what cannot be held."""
    dtensors = [(n, p) for n, p in chosen if is_dtensor(p)]
    if not dtensors:
        return None
    data_names = set(_names(mesh)) if mesh is not None else set()
    for n, p in dtensors:  # (hold_on_owners refuses a model fully_shard has sharded before this)
        if mesh is not None and (p.device_mesh == mesh or data_names & set(_names(p.device_mesh))):
            _refuse(n, f"is a DTensor (placements {tuple(p.placements)}) on mesh {_names(p.device_mesh)}, which is "
                       f"the given mesh {tuple(_names(mesh))} or shares its dims: give hold_on_owners the "
                       "data-parallel mesh fully_shard gets (mesh[\"dp\"]), or the whole mesh the TP mesh was "
                       "sliced from")
    plain = next((n for n, p in chosen if not is_dtensor(p)), None)
    if plain is not None:
        _refuse(plain, f"is left whole by tensor parallelism while '{dtensors[0][0]}' is a tensor-parallel slice: "
                       "held matrices are all TP slices or none (leave it out with predicate=, or parallelize it)")
    name, first = dtensors[0]
    tp_mesh = first.device_mesh
    for n, p in dtensors:
        if p.device_mesh != tp_mesh:
            _refuse(n, f"is on DeviceMesh {p.device_mesh}, '{name}' on {tp_mesh}: held matrices share one TP mesh")
        kind = placement_kind(p.placements[0], p.dim()) if len(p.placements) == 1 else None
        if p.dim() != 2 and not (stacks[n] and kind == ("shard", 0)):
            _refuse(n, f"of shape {tuple(p.shape)} is a DTensor with placements {tuple(p.placements)}: only 2-D "
                       "matrices under tensor parallelism and (E, m, n) expert stacks under expert parallelism "
                       "(Shard(0): whole experts per EP rank) can be held (an expert stack split within experts "
                       "or a sharded conv filter: use DMuon's all-to-all mode)")
        if tp_mesh.ndim != 1 or kind is None or kind[0] == "replicate":
            _refuse(n, f"has placements {tuple(p.placements)} on a {tp_mesh.ndim}-D mesh: a held matrix under tensor "
                       "parallelism is one Shard(d) over one TP mesh dim (a matrix replicated over TP would be "
                       "orthogonalized once per TP rank, and its gradient may be Partial(): leave it out with "
                       "predicate=)")
    root, tp_dim = _frame(name, tp_mesh, mesh, data_names)
    if _ranks(root) != list(group_ranks):
        _refuse(name, f"is on a TP mesh whose root mesh has ranks {_ranks(root)}, not the process group's "
                      f"{list(group_ranks)}")
    shape = tuple(root.mesh.shape)
    cells = []
    for g in range(math.prod(shape)):
        c = unravel(g, shape)
        rest = [(c[i], shape[i]) for i in range(len(shape)) if i != tp_dim]
        d = 0
        for ci, si in rest:
            d = d * si + ci
        cells.append((d, c[tp_dim]))
    tp = shape[tp_dim]
    return TensorParallel(tp_mesh, tuple(cells), tp, len(cells) // tp, rank, root, tp_dim)


def _frame(name, tp_mesh, mesh, data_names):
    """(the DeviceMesh of every group rank, the TP dim's index in it): the TP mesh's root mesh when the TP and
    data-parallel meshes are its named dims (the root's other dims of size 1; parallelize_module's and
    transformers' meshes), else the data-parallel mesh and the TP mesh joined (torchtitan's meshes: views of
    one flat "world" mesh)."""
    root, tp_name = tp_mesh._get_root_mesh(), _names(tp_mesh)
    root_names = _names(root)
    if mesh is None:
        if root != tp_mesh:
            _refuse(name, f"is on TP mesh {tp_name} of a larger mesh {root_names}: give hold_on_owners the "
                          "data-parallel mesh fully_shard gets (mesh[\"dp\"])")
        return root, 0
    if mesh._get_root_mesh() == root and (data_names | set(tp_name)) <= set(root_names) and all(
            size == 1 for size, n in zip(root.mesh.shape, root_names) if n not in data_names | set(tp_name)):
        return root, root_names.index(tp_name[0])
    joined = concatenated_mesh([mesh, tp_mesh])
    if joined is None:
        _refuse(name, f"is on TP mesh {tp_name}; the data-parallel mesh {tuple(data_names)} and it must be the "
                      f"named dims of one root mesh {root_names} (its other dims of size 1), or meshes torch can "
                      "join")
    return joined, mesh.ndim
