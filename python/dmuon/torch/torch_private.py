"""The private torch.distributed APIs dmuon.torch's layouts read, in one place (torch >= 2.11).

_StridedShard: the placement FSDP2 gives a parameter it shards over a mesh dim after tensor
parallelism has sharded the same tensor dim (placement_types.py). A DTensor's shard order: torch
2.10+ lets a DTensorSpec apply its shardings in an order other than left to right over the mesh dims
(DTensorSpec.shard_order); dmuon's arithmetic (placements.py) is the default order's.
"""

from torch.distributed.tensor import Replicate, Shard

try:
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - every supported torch has it
    _StridedShard = None


def placement_kind(placement, ndim):
    """("replicate",), ("shard", dim) or ("strided", dim, split_factor) with dim in [0, ndim); None for any
    other placement (Partial, a user's own)."""
    if type(placement) is Replicate:
        return ("replicate",)
    if type(placement) is Shard:
        return ("shard", placement.dim % ndim) if ndim else None
    if _StridedShard is not None and type(placement) is _StridedShard:
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

