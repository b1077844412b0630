"""dmuon.torch.clip_grad_norm_: torch.nn.utils.clip_grad_norm_ for models with owner-held matrices.

The gradients of one model can live three ways at once: FSDP2's DTensors (sharded: each rank has a
part), owner-held matrices (the whole gradient on its owner, a placeholder elsewhere) and plain
replicated tensors (DDP's, or a single process's: every rank has all of it). The norm is the
single-process one, the same on every rank: each kind's sum of |g|^p counted once, the DTensors'
through DTensor's own reduction, the held ones by one all_reduce over their group. Collective:
every rank calls it with the same parameters. torch's own clip_grad_norm_ refuses held gradients
(their placeholders raise: its norm would differ on every rank). As torch's, it never waits for the
device: the norm and the clipping factor stay tensors on the gradients' device (only
error_if_nonfinite=True reads the norm back).
"""

import torch
import torch.distributed as dist

from dmuon.torch.collectives import Group
from dmuon.torch.dense import may_overlap
from dmuon.torch.dtensors import is_dtensor, local_part
from dmuon.torch.held.placeholder import HeldElsewhere


def _power_sum(grads, norm_type, device):
    """Σ |g|^p over plain tensors (max |g| for p = inf), as float64 on `device`."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float64).to(device) for g in grads])
    return norms.max() if norm_type == float("inf") else norms.pow(norm_type).sum()


def _local_device(g):
    """The device a gradient's values are on (a DTensor's: its local shard's)."""
    return g.to_local().device if is_dtensor(g) else g.device


def _check_scalable(params):
    """Raises ValueError naming the first gradient that cannot be scaled in place, before any is: one whose
    elements share memory (an expanded tensor; torch's clip_grad_norm_ fails on it too). Any other strides
    are scaled in place, each element once, nothing outside it touched."""
    for i, p in enumerate(params):
        g = p.grad.to_local() if is_dtensor(p.grad) else p.grad
        if not isinstance(g, HeldElsewhere) and may_overlap(g):
            raise ValueError(f"dmuon.torch.clip_grad_norm_: the gradient of parameter {i} (of those with one; shape "
                             f"{tuple(g.shape)}) has strides {g.stride()}, under which its elements share memory (an "
                             "expanded tensor), so it cannot be scaled in place: give it a gradient of its own (.clone())")


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, pipeline_group=None):
    """Clips the gradients of `parameters` (a model's parameters(), FSDP2, HSDP, DDP or one process,
    with or without owner-held matrices) in place so that their total norm is at most max_norm;
    returns the total norm before clipping (a float64 tensor, equal on every rank). As
    torch.nn.utils.clip_grad_norm_: norm_type p (inf: the largest |g|), scale max_norm / (norm + 1e-6)
    when below 1, error_if_nonfinite raises for a non-finite norm. Under pipeline parallelism give the
    parameters of this rank's stages and pipeline_group, the process group of one rank per stage (torchtitan's
    "pp" mesh's): the stages' sums are added over it (the largest taken for inf), as torchtitan's pp_mesh."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    norm_type = float(norm_type)
    params = [p for p in parameters if p.grad is not None]
    _check_scalable(params)
    held = [p for p in params if getattr(p, "_dmuon_held", None) is not None]
    held_ids = {id(p) for p in held}
    sharded = [p.grad for p in params if is_dtensor(p.grad) and id(p) not in held_ids]
    replicated = [p.grad for p in params if not is_dtensor(p.grad) and id(p) not in held_ids]
    # a held gradient here: the whole matrix's on its owner, or (tensor parallelism) this rank's slice's
    owned = [local_part(p.grad) for p in held if not isinstance(local_part(p.grad), HeldElsewhere)]

    inf = norm_type == float("inf")
    # The norm's device: the gradients' (the first one's), so that nothing waits for a copy to the host.
    first = next(iter(replicated + owned + sharded), None)
    device = _local_device(first) if first is not None else torch.device("cpu")
    total = _power_sum(replicated, norm_type, device)
    by_mesh = {}  # FSDP2 over TP: DTensors on the ("dp", "tp") mesh and on its "dp" slice, one norm each
    for g in sharded:
        by_mesh.setdefault(g.device_mesh, []).append(g)
    for grads in by_mesh.values():
        dtensor_norm = torch.nn.utils.get_total_norm(grads, norm_type).full_tensor().double().to(device)
        total = torch.maximum(total, dtensor_norm) if inf else total + dtensor_norm ** norm_type
    if held:
        part = _power_sum(owned, norm_type, device)
        comm = Group(held[0]._dmuon_held.process_group)
        if comm.distributed:
            part = part.to(comm.tensor_device())
            dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=comm.pg)
        total = torch.maximum(total, part.to(device)) if inf else total + part.to(device)
    if pipeline_group is not None:
        comm = Group(pipeline_group)
        staged = total.to(comm.tensor_device())
        dist.all_reduce(staged, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=comm.pg)
        total = staged.to(device)
    norm = total if inf else total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):  # a read of the norm, as torch's own makes here
        raise RuntimeError(f"dmuon.torch.clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
                           "non-finite, so it cannot be clipped (error_if_nonfinite=True)")
    # As torch's: every gradient times min(1, max_norm / (norm + 1e-6)), a tensor (times 1 changes nothing).
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    on_device = {}
    for g in replicated + owned + sharded:
        d = _local_device(g)
        if d not in on_device:
            on_device[d] = scale.to(d)
        g.mul_(on_device[d])
    return norm
