"""The collectives DMuon uses, on torch's own process group (DESIGN 7): all_reduce, all_to_all_single
with uneven splits, the *_object helpers. Tensors of any dtype travel as bytes (uint8 views), so
bfloat16 works on every backend. Without an initialised process group everything is single-process.

Contract: every rank of the group calls the same functions in the same order with matching sizes.
"""

import torch
import torch.distributed as dist

from dmuon.torch.devices import accelerator_device


class Group:
    """A process group (None: the default one) with its size and this rank's place in it."""

    def __init__(self, process_group=None):
        self.distributed = dist.is_available() and dist.is_initialized()
        self.pg = process_group
        self.world = dist.get_world_size(process_group) if self.distributed else 1
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        if self.distributed and self.rank < 0:
            raise ValueError("DMuon: this process is not a member of the given process_group")
        self.ranks = [self.global_rank(g) for g in range(self.world)]  # global rank of each group rank

    def __deepcopy__(self, memo):
        """A deep copy of an optimizer shares its communicator, as it would share a file handle."""
        return self

    def __reduce__(self):
        """Pickled as the default group (rebuilt where it is unpickled); another group has no name
        that outlives this process."""
        if self.pg is not None:
            raise TypeError("DMuon over a process_group other than the default one cannot be pickled; "
                            "pickle its state_dict(), or copy.deepcopy it")
        return Group, (None,)

    def global_rank(self, group_rank):
        if not self.distributed or self.pg is None or self.pg is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.pg, group_rank)

    def all_gather_object(self, obj):
        """Every rank's obj, in rank order."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast_object(self, obj, src=0):
        """src's obj on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.global_rank(src), group=self.pg)
        return box[0]

    def tensor_device(self):
        """Where this group's collectives take their tensors: the CPU where its backend takes CPU tensors (gloo,
        mpi, or "cpu:gloo,cuda:nccl"), else the current accelerator's device (an NCCL- or RCCL-only group's cuda,
        XCCL's xpu), as such a group refuses CPU tensors."""
        if self.distributed and not any(b in dist.get_backend(self.pg) for b in ("gloo", "mpi")):
            return accelerator_device()
        return torch.device("cpu")

    def all_reduce_sum(self, tensor):
        if self.world > 1:
            dist.all_reduce(tensor, group=self.pg)
        return tensor

    def all_to_all(self, send, out_numel, in_numel, async_op=True):
        """1-D send → 1-D receive of the same dtype: in_numel[r] elements go to rank r, out_numel[r]
        come from rank r. Returns (receive tensor, work or None)."""
        if self.world == 1:
            return send, None
        recv = torch.empty(sum(out_numel), dtype=send.dtype, device=send.device)
        size = send.element_size()
        work = dist.all_to_all_single(_bytes(recv), _bytes(send), [n * size for n in out_numel],
                                      [n * size for n in in_numel], group=self.pg, async_op=async_op)
        return recv, work


def _bytes(t):
    """A contiguous tensor as a flat uint8 view (shares memory)."""
    if not t.is_contiguous():
        raise ValueError("DMuon internal error: a non-contiguous tensor was passed to a collective")
    return t.reshape(-1).view(torch.uint8)
