"""The model state_dict's view of owner-held matrices, on every rank, without communication.

model.state_dict() lists each held matrix on every rank as a HeldEntry: a DTensor over the held
group's 1-D mesh with a Partial(sum) placement, whose local tensor is the master on the owner and a
tensor of -0.0 everywhere else (NegativeZeros: no storage; x + (-0.0) is x bit for bit, -0.0 and NaN
included). So torch.distributed.checkpoint's ways through a state dict all hold every matrix:
  full_state_dict=True (get_model_state_dict, with or without cpu_offload)  the DTensor is made
      Replicate by an all-reduce: every rank (or rank 0) gets the owner's values exactly
  sharded save and load (dcp.save / dcp.load)  the owner alone writes and reads the whole matrix
      (__create_write_items__, __create_chunk_list__); a load at another world size or layout
      finds it under the same key
  broadcast_from_rank0 / full loads  writes land in the owner's master and are skipped elsewhere
model.load_state_dict accepts HeldEntry values, other DTensors (made full first: collective, as the
call is on every rank) and plain full tensors; the owner copies them into its master, the other
ranks skip them (their placeholder's writes are skipped), and every working copy is refreshed from
the owners before its next use.

Under tensor parallelism (tensor_parallel.py) a HeldEntry is a DTensor over the TP mesh's root mesh:
the held TP placement on the TP dim, Partial(sum) on the data-parallel dims; its local tensor is this
rank's slice on the ranks that keep it and -0.0 elsewhere. DCP writes and reads each slice where it is
kept (the chunk at the slice's offsets), a full state dict is all-reduced over the data-parallel dims and
gathered over TP, and a load keeps on each keeping rank its slice of what it is given.
"""

import functools

import torch
from torch.distributed.tensor import DTensor, Partial

from dmuon.torch.dtensors import like_param, local_part
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._pytree import tree_map

_RETYPES = {torch.ops.aten._to_copy, torch.ops.aten.detach, torch.ops.aten.alias}


class NegativeZeros(torch.Tensor):
    """A tensor of -0.0 with no storage: reads see -0.0 (made when read), writes are skipped."""

    @staticmethod
    def __new__(cls, shape, dtype, device):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)

    def __repr__(self, *, tensor_contents=None):
        return f"NegativeZeros({tuple(self.shape)}, {self.dtype})"

    def untyped_storage(self):
        """An empty storage (torch's wrapper subclasses have none to show): torchtitan's checkpointer compares
        the storages of successive state dicts' entries (ModelWrapper), and finds two of these alike."""
        return torch.UntypedStorage(0, device=self.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in _RETYPES:
            t = args[0]
            return NegativeZeros(t.shape, kwargs.get("dtype") or t.dtype, kwargs.get("device") or t.device)
        if func._schema.is_mutable and isinstance(args[0], NegativeZeros):
            return args[0]

        def real(t):
            return torch.full(t.shape, -0.0, dtype=t.dtype, device=t.device) if isinstance(t, NegativeZeros) else t
        return func(*tree_map(real, args), **tree_map(real, kwargs))


class HeldEntry(DTensor):
    """A held matrix in a state dict (see the module's text). Operations on it give plain DTensors."""

    @staticmethod
    def make(local, mesh, owner_here, placements=(Partial("sum"),), shape=None):
        """local: this rank's part (the whole matrix on its owner; a TP slice); placements on mesh and the
        global shape (default: the whole matrix held on one owner of a 1-D mesh)."""
        shape = local.shape if shape is None else torch.Size(shape)
        spec = DTensorSpec(mesh, tuple(placements),
                           TensorMeta(shape, torch._prims_common.make_contiguous_strides_for(shape), local.dtype))
        entry = torch.Tensor._dtensor__new__(HeldEntry, local, spec, requires_grad=False)
        entry._spec, entry._local_tensor, entry.owner_here = spec, local, owner_here
        return entry

    def __create_write_items__(self, fqn, object):
        from torch.distributed.checkpoint.planner_helpers import _create_write_items_for_dtensor

        return [_create_write_items_for_dtensor(fqn, self)] if self.owner_here else []  # at its offsets

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.planner_helpers import _create_chunk_from_dtensor

        return [_create_chunk_from_dtensor(self)] if self.owner_here else []

    def __get_tensor_shard__(self, index):
        return self._local_tensor


def install_state_dict_hooks(model, mesh, schedule, tensor_parallel=None):
    """Registers the model's hooks for the held parameters of `schedule` (schedule.registry): its
    state_dict lists HeldEntry values for them; load_state_dict takes any of the values above.
    tensor_parallel: the TensorParallel frame of held TP slices (tensor_parallel.py), else None; mesh is
    then unused (the entries lie on the TP mesh's root mesh)."""

    def entry(p, owner_here):
        local = local_part(p)
        local = local.detach() if owner_here else NegativeZeros(local.shape, p.dtype, p.device)
        if tensor_parallel is None:
            return HeldEntry.make(local, mesh, owner_here)
        root, tp_dim = tensor_parallel.root_and_dim()
        placements = [p.placements[0] if d == tp_dim else Partial("sum") for d in range(root.ndim)]
        return HeldEntry.make(local, root, owner_here, placements, p.shape)

    def my_part(p, full):
        """This rank's part of a full value of held parameter p (a TP or EP slice: its spans)."""
        if tensor_parallel is None:
            return full
        spans = p._dmuon_held.holdings[tensor_parallel.rank].spans  # one run per dim: a Shard(d) slice
        return like_param(p, full[tuple(slice(s.runs[0][0], s.runs[0][0] + s.count) for s in spans)])

    def entries(slots, module, state_dict, prefix, local_metadata):
        for unit, bucket, j, attr in slots:
            key = prefix + attr
            if key in state_dict:
                unit.adopt(schedule.marks)
                state_dict[key] = entry(bucket.params[j], bucket.is_owner)

    def to_plain(slots, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs):
        for unit, bucket, j, attr in slots:
            key = prefix + attr
            value = state_dict.get(key)
            if value is None:
                continue
            unit.adopt(schedule.marks)
            p, owner_here = bucket.params[j], bucket.is_owner
            if isinstance(value, HeldEntry):
                if value.owner_here:
                    state_dict[key] = like_param(p, value._local_tensor)
                else:
                    state_dict.pop(key)  # nothing to write here; not reported missing (below)
                continue
            if isinstance(value, DTensor):
                value = value.full_tensor()  # collective: every rank loads every key
            if owner_here:
                state_dict[key] = my_part(p, value)
            elif tensor_parallel is not None:
                state_dict.pop(key)  # a placeholder DTensor takes no plain tensor; the keeper loads it
            else:
                state_dict[key] = value  # the placeholder skips the write

    def not_missing(module, incompatible_keys):
        incompatible_keys.missing_keys[:] = [
            k for k in incompatible_keys.missing_keys
            if not any(k == n or k.endswith("." + n) for n, (_, here) in schedule.registry.items() if not here)]
        schedule.after_step()

    # On each held parameter's own module: its hooks run before those of the modules above it (a state dict is
    # made bottom-up and loaded top-down), so theirs see HeldEntry values (torchtitan's FusedQKVLinear splits
    # wqkv into wq, wk, wv on save and joins them on load: then through a Replicate DTensor, all-reduced)
    slots = {}  # module → [(unit, bucket, index in the bucket, attribute)]
    for unit in schedule.units:
        places = iter(unit.slots)
        for bucket in unit.buckets:
            for j in range(len(bucket.params)):
                module, attr, _ = next(places)
                slots.setdefault(module, []).append((unit, bucket, j, attr))
    for module, its in slots.items():
        module.register_state_dict_post_hook(functools.partial(entries, its))
        module.register_load_state_dict_pre_hook(functools.partial(to_plain, its))
    model.register_load_state_dict_post_hook(not_missing)
