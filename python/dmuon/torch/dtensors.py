"""DTensor helpers every room of dmuon.torch shares: what is a DTensor, its local part, a local tensor placed as a
parameter, a gradient laid out as its parameter. Works on a torch built without torch.distributed (nothing is then
a DTensor)."""

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed
    DTensor = None


def is_dtensor(t):
    return DTensor is not None and isinstance(t, DTensor)


def local_part(t):
    """A DTensor's local tensor, else the tensor."""
    return t.to_local() if is_dtensor(t) else t


def like_param(p, local):
    """`local` as p's part: a DTensor with p's mesh, placements and global shape when p is one."""
    if not is_dtensor(p):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def as_placed(grad, param):
    """A DTensor gradient laid out as its parameter (tensor parallelism can leave a replicated parameter's
    gradient Partial()): redistributed where its placements differ, the same on every rank (collective)."""
    if is_dtensor(grad) and tuple(grad.placements) != tuple(param.placements):
        return grad.redistribute(param.device_mesh, param.placements)
    return grad
