"""One bucket of owner-held matrices: the parameters of one hook unit (a module) that share an owner
and a dtype, laid end to end in one flat tensor, with the collectives that move them (held_groups.py
names the stages).

Every parameter becomes a view of the flat tensor (p.data = flat[offset:offset + numel].view(shape)),
so one collective moves the whole bucket and no copy is made on either side of a broadcast. A rank
outside the owner's column frees the flat tensor's storage between uses (resize to 0 bytes, as FSDP2
frees unsharded parameters); the parameters keep their shapes and autograd's saved references, and
the storage is reallocated and broadcast into before the next use.

Gradients leave as one flat copy per bucket (torch.cat of the local gradients), summed onto the
owner; the owner divides by the group's size (the mean over data-parallel ranks, as FSDP2 and DDP).
All collectives are asynchronous; each stage returns its Work handles, or None when nothing travels.
"""

import torch
import torch.distributed as dist


class HeldBuffer:
    """params: [(name, nn.Parameter)] of one dtype and device, all owned by `owner` (group rank)."""

    def __init__(self, params, owner, groups):
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.owner = owner
        self.groups = groups
        self.is_owner = groups.rank == owner
        self.holds = groups.holds(owner)
        first = self.params[0]
        self.numel = sum(p.numel() for p in self.params)
        self.flat = torch.empty(self.numel, dtype=first.dtype, device=first.device)  # (numel,)
        self.nbytes = self.flat.untyped_storage().nbytes()
        offset = 0
        with torch.no_grad():
            for p in self.params:
                view = self.flat[offset:offset + p.numel()].view(p.shape)
                view.copy_(p)
                p.data = view
                offset += p.numel()

    # ---- weights ----

    @property
    def allocated(self):
        return self.flat.untyped_storage().nbytes() > 0

    def free(self):
        """Outside the column: releases the weights' storage (the parameters keep their shapes)."""
        if not self.holds and self.allocated:
            self.flat.untyped_storage().resize_(0)

    def allocate(self):
        if not self.allocated:
            self.flat.untyped_storage().resize_(self.nbytes)

    def broadcast_across_column(self):
        """Weights stage 1 (HSDP): the owner's updated weights to the rest of its column."""
        if not self.holds or self.groups.column_group is None:
            return None
        return dist.broadcast(_bytes(self.flat), src=self.groups.owner_global(self.owner),
                              group=self.groups.column_group, async_op=True)

    def broadcast_in_replica(self):
        """Weights stage 2: the column rank of this replica to the other ranks of the replica."""
        self.allocate()
        if self.groups.shard_group is None or self.groups.grid.shards == 1:
            return None
        return dist.broadcast(_bytes(self.flat), src=self.groups.source(self.owner),
                              group=self.groups.shard_group, async_op=True)

    # ---- gradients ----

    def local_gradients(self):
        """The bucket's local gradients as one new flat tensor (a missing gradient counts as zeros)."""
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.params])

    def reduce_in_replica(self, flat_grad):
        """Gradient stage 1: sums flat_grad onto this replica's column rank."""
        if self.groups.shard_group is None or self.groups.grid.shards == 1:
            return None
        return dist.reduce(flat_grad, dst=self.groups.source(self.owner), op=dist.ReduceOp.SUM,
                           group=self.groups.shard_group, async_op=True)

    def reduce_across_column(self, flat_grad):
        """Gradient stage 2 (HSDP): sums the column's stage-1 results onto the owner."""
        if not self.holds or self.groups.column_group is None:
            return None
        return dist.reduce(flat_grad, dst=self.groups.owner_global(self.owner), op=dist.ReduceOp.SUM,
                           group=self.groups.column_group, async_op=True)

    def gradient_views(self, flat_grad):
        """The parameters' (shape) views of a flat gradient, in bucket order."""
        out, offset = [], 0
        for p in self.params:
            out.append(flat_grad[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out


def _bytes(t):
    """A contiguous tensor as a flat uint8 view (shares memory): any dtype travels on any backend."""
    return t.view(-1).view(torch.uint8)
