"""One bucket of owner-held matrices: the parameters of one hook unit (a module) that share an owner,
a compute dtype and a device, with the working copy their module runs on and the collectives that
move it (groups.py names the stages).

Two tensors stand for each parameter (as FSDP2's sharded and unsharded parameters):
  the registered parameter  what model.parameters() gives outside the module's forward and backward:
                            on the owner the master weights (the optimizer updates them; any dtype, any
                            storage: .to(), .to_empty() and load_state_dict may replace it), elsewhere a
                            HeldElsewhere placeholder without storage (placeholder.py)
  the working parameter     a view of the bucket's flat working tensor, in the compute dtype
                            (MixedPrecisionPolicy.param_dtype, else the parameter's): what the module
                            computes with and autograd accumulates gradients into (hooks.py swaps it in)
The flat working tensor (numel,) is allocated on first use, on the parameters' device then, and its
storage is freed between uses (resized to 0 bytes, as FSDP2 frees unsharded parameters; autograd's
saved references stay valid views); the ranks of the owner's column other than the owner (HSDP) keep
it, as their replica's source. Before it is sent, the owner fills it from the master weights, cast to
the compute dtype.

Under tensor parallelism (tensor_parallel.py) each parameter is a DTensor on the TP mesh and the
bucket holds this rank's slices: masters, placeholders (a DTensor whose local tensor is a
HeldElsewhere), working parameters and gradients are DTensors with the parameter's placements over
their local slices, and the flat tensors are the slices'.

Gradients leave as one flat tensor per bucket in the reduce dtype (MixedPrecisionPolicy.reduce_dtype,
else the compute dtype), summed onto the owner; the owner divides by the group's size (the mean over
data-parallel ranks, as FSDP2 and DDP; hold_on_owners's gradient_divide_factor instead when given, else the
divide factor set on the unit's fully_shard, as FSDP2 divides its own gradients) and casts to the master's
dtype. All collectives are
asynchronous; each stage returns its Work handles, or None when nothing travels.
"""

import math

import torch
import torch.distributed as dist

from dmuon.torch.held.placeholder import HeldElsewhere
from dmuon.torch.dtensors import as_placed, like_param, local_part
from dmuon.torch.torch_private import gradient_divide_factor


class HeldBuffer:
    """params: [(name, registered parameter)], all owned by `owner` (group rank); param_dtype,
    reduce_dtype: the mixed-precision policy's (None: the parameters' own dtype). on_gradient(working
    parameter), set by the schedule: run when autograd has accumulated a working parameter's gradient."""

    def __init__(self, params, owner, groups, param_dtype=None, reduce_dtype=None):
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.owner = owner
        self.groups = groups
        self.is_owner = groups.rank == owner
        self.keeps = groups.holds(owner) and not self.is_owner  # an HSDP column rank: its replica's source
        self.param_dtype = param_dtype
        self._reduce_dtype = reduce_dtype
        self.shapes = [tuple(local_part(p).shape) for p in self.params]  # this rank's part (a TP slice, or all)
        self.numel = sum(math.prod(s) for s in self.shapes)
        self.on_gradient = None
        self.fsdp_group = None  # the FSDPParamGroup of the unit's fully_shard (hold.py), whose divide factor we follow
        self.flat = None      # (numel,) in dtype, made on first use
        self.working = []     # the working parameters, views of flat, in bucket order

    # ---- weights ----

    @property
    def device(self):
        return self.params[0].device

    @property
    def dtype(self):
        """The compute dtype: the policy's, else the (first) master's."""
        return self.param_dtype or self.params[0].dtype

    @property
    def reduce_dtype(self):
        return self._reduce_dtype or self.dtype

    def follow_masters(self):
        """Drops a working copy made for another device or dtype than the masters' now (the model was
        moved, or cast without a policy, after its first forward); returns whether it did. Only
        between uses (nothing of autograd's refers to it then)."""
        if self.flat is None or (self.flat.device == self.device and self.flat.dtype == self.dtype):
            return False
        self.flat, self.working = None, []
        return True

    @property
    def allocated(self):
        return self.flat is not None and self.flat.untyped_storage().nbytes() > 0

    def _make(self):
        """The flat working tensor and its parameter views, on the parameters' device now."""
        self.flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.working, offset = [], 0
        for p, shape in zip(self.params, self.shapes):
            n = math.prod(shape)
            w = torch.nn.Parameter(like_param(p, self.flat[offset:offset + n].view(shape)))
            w.register_post_accumulate_grad_hook(lambda w: self.on_gradient(w))
            w.requires_grad_(p.requires_grad)
            self.working.append(w)
            offset += n

    def allocate(self):
        if self.flat is None:
            self._make()
        elif not self.allocated:
            self.flat.untyped_storage().resize_(self.numel * self.flat.element_size())

    def free(self):
        """Releases the working copy's storage (not on the column ranks that keep it)."""
        if not self.keeps and self.allocated:
            self.flat.untyped_storage().resize_(0)

    def _fill_from_master(self):
        """The owner's master weights into the working copy, cast to the compute dtype. The version
        counters are kept (a working DTensor's and its local tensor's, which has its own): autograd's saved
        references see the same values again (a refill before backward), as for a broadcast into the
        storage; and a view that a custom autograd Function made of the local tensor (DTensor.to_local(), as
        transformers' expert-parallel forward takes its weights) may not see it change before backward."""
        self.allocate()
        with torch.no_grad():
            for p, w in zip(self.params, self.working):
                local = local_part(w)
                with torch.autograd._unsafe_preserve_version_counter(w), \
                        torch.autograd._unsafe_preserve_version_counter(local):
                    local.copy_(local_part(p))

    def _make_present(self):
        """Storage for the working copy; on the owner, its masters in it (the source of every broadcast)."""
        if self.is_owner:
            self._fill_from_master()
        else:
            self.allocate()

    def broadcast_across_column(self):
        """Weights stage 1 (HSDP): the owner's weights to the rest of its column."""
        if not self.groups.holds(self.owner) or self.groups.column_group is None:
            return None
        self._make_present()
        return dist.broadcast(_bytes(self.flat), src=self.groups.owner_global(self.owner),
                              group=self.groups.column_group, async_op=True)

    def broadcast_in_replica(self):
        """Weights stage 2: the column rank of this replica to the other ranks of the replica."""
        self._make_present()
        if self.groups.shard_group is None or self.groups.grid.shards == 1:
            return None
        return dist.broadcast(_bytes(self.flat), src=self.groups.source(self.owner),
                              group=self.groups.shard_group, async_op=True)

    # ---- gradients ----

    def local_gradients(self):
        """The working parameters' gradients as one new flat tensor in the reduce dtype (a missing
        gradient counts as zeros); the working gradients are cleared."""
        flat = torch.cat([(local_part(as_placed(w.grad, w)) if w.grad is not None
                           else torch.zeros_like(local_part(w))).reshape(-1).to(self.reduce_dtype)
                          for w in self.working])
        for w in self.working:
            w.grad = None
        return flat

    def reduce_in_replica(self, flat_grad):
        """Gradient stage 1: sums flat_grad onto this replica's column rank."""
        if self.groups.shard_group is None or self.groups.grid.shards == 1:
            return None
        return dist.reduce(flat_grad, dst=self.groups.source(self.owner), op=dist.ReduceOp.SUM,
                           group=self.groups.shard_group, async_op=True)

    def reduce_across_column(self, flat_grad):
        """Gradient stage 2 (HSDP): sums the column's stage-1 results onto the owner."""
        if not self.groups.holds(self.owner) or self.groups.column_group is None:
            return None
        return dist.reduce(flat_grad, dst=self.groups.owner_global(self.owner), op=dist.ReduceOp.SUM,
                           group=self.groups.column_group, async_op=True)

    def gradient_views(self, flat_grad):
        """The parameters' (local shape) views of a flat gradient, in bucket order."""
        out, offset = [], 0
        for shape in self.shapes:
            out.append(flat_grad[offset:offset + math.prod(shape)].view(shape))
            offset += math.prod(shape)
        return out

    def finish_gradients(self, flat_grad):
        """The owner's .grad: the reduced sum in flat_grad divided by the groups' divide_factor when
        hold_on_owners was given one, else by the gradient divide factor set on the unit's fully_shard
        (FSDPModule.set_gradient_divide_factor: torchtitan sets 1.0, a sum), else by the group's size (the mean
        over the data-parallel ranks), in the master's dtype, added to what .grad held before this backward.
        Elsewhere .grad is a placeholder that refuses reads."""
        if not self.is_owner:
            for p in self.params:
                if p.requires_grad:
                    held = local_part(p)
                    p.grad = like_param(p, HeldElsewhere(held.shape, held.dtype, held.device, held.held_name,
                                                    held.held_owner, gradient=True))
            return
        flat_grad.div_(self.groups.divide_factor or gradient_divide_factor(self.fsdp_group)
                       or self.groups.world)
        for p, g in zip(self.params, self.gradient_views(flat_grad)):
            if not p.requires_grad:
                continue
            g = g.to(p.dtype)
            if p.grad is None:
                p.grad = like_param(p, g)
            else:
                local_part(p.grad).add_(g)


def _bytes(t):
    """A contiguous tensor as a flat uint8 view (shares memory): any dtype travels on any backend."""
    return t.view(-1).view(torch.uint8)
