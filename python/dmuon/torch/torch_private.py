"""The private torch APIs dmuon.torch reads, in one place (torch >= 2.11): torch.distributed's for the layouts, FSDP2's
state of a fully_shard'ed module for the held matrices (its param group and mixed precision policy), and torch.cpu's
bf16 matrix units (AMX) for the CPU's Newton–Schulz default.

_StridedShard: the placement FSDP2 gives a parameter it shards over a mesh dim after tensor
parallelism has sharded the same tensor dim (placement_types.py). A DTensor's shard order: torch
2.10+ lets a DTensorSpec apply its shardings in an order other than left to right over the mesh dims
(DTensorSpec.shard_order); dmuon's arithmetic (placements.py) is the default order's.
"""

try:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # a torch built without distributed: no DTensor reaches these functions
    Replicate = Shard = _StridedShard = None


def placement_kind(placement, ndim):
    """("replicate",), ("shard", dim) or ("strided", dim, split_factor) with dim in [0, ndim); None for any
    other placement (Partial, a user's own)."""
    if type(placement) is Replicate:
        return ("replicate",)
    if type(placement) is Shard:
        return ("shard", placement.dim % ndim) if ndim else None
    if type(placement) is _StridedShard:
        return ("strided", placement.dim % ndim, int(placement.split_factor)) if ndim else None
    return None


def default_shard_order(dtensor):
    """Whether the DTensor's shardings apply left to right over its mesh dims (its spec's shard_order is
    the default one, or _StridedShard placements encode the order; torch before shard_order: always)."""
    spec = dtensor._spec
    if getattr(spec, "use_strided_shard_as_shard_order", False):
        return True
    order = getattr(spec, "shard_order", None)
    return order is None or order == type(spec).compute_default_shard_order(spec.placements)



def on_root_mesh(device_mesh, placements):
    """(root DeviceMesh, placements on it) of a DTensor on a mesh sliced by name from a larger one (FSDP2's
    "dp" mesh of a ("dp", "tp") mesh: parameters tensor parallelism leaves alone): the slice's placements on
    its dims, Replicate() on the root's others. None for a mesh that is no such slice (a root, a flattened
    or reordered slice)."""
    root = device_mesh._get_root_mesh()
    names, root_names = device_mesh.mesh_dim_names, root.mesh_dim_names
    if root is device_mesh or not names or not root_names or any(n not in root_names for n in names):
        return None
    if [n for n in root_names if n in names] != list(names):
        return None
    return root, tuple(placements[names.index(n)] if n in names else Replicate() for n in root_names)


def concatenated_mesh(meshes):
    """The DeviceMesh whose dims are those of `meshes` in order (torchtitan's "fsdp" and "tp" meshes, views of
    one flat "world" mesh: their (fsdp, tp) grid), made without new process groups; None where torch cannot
    (meshes of different roots, overlapping dims, a torch without DeviceMesh._concatenate)."""
    from torch.distributed.device_mesh import DeviceMesh

    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is None:
        return None
    try:
        return concatenate(list(meshes))
    except (RuntimeError, AttributeError, TypeError):
        return None


def fsdp_state_of(module):
    """(FSDPParamGroup or None, MixedPrecisionPolicy) of a module that fully_shard wrapped (FSDP2's state: a module
    of its own parameters has a param group, one whose parameters all belong to its children has none); None for
    any other module."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return None
    state = get_state()
    return getattr(state, "_fsdp_param_group", None), state._mp_policy


def gradient_divide_factor(param_group):
    """The gradient divide factor an FSDPParamGroup was given (set_gradient_divide_factor), None where it has none
    (FSDP2 then divides by its data-parallel size) or there is no group."""
    return getattr(param_group, "gradient_divide_factor", None)


def cpu_has_bf16_matrix_units():
    """Whether the CPU has AMX, the bf16 matrix units torch's CPU products run on (with AVX-512 BF16 alone, torch's
    bf16 matmul ran at about half its float32 rate: docs/ns.md); False where this torch cannot tell (the private check
    is gone)."""
    import torch

    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return check is not None and bool(check())


def pipeline_stages(schedule):
    """The PipelineStages a torch.distributed.pipelining schedule runs on this rank (a multi-stage schedule's
    _stages, a single-stage one's _stage)."""
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]
