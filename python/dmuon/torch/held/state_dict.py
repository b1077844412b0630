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
"""

import torch
from torch.distributed.tensor import DTensor, Partial
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
    def make(local, mesh, owner_here):
        spec = DTensorSpec(mesh, (Partial("sum"),),
                           TensorMeta(local.shape, torch._prims_common.make_contiguous_strides_for(local.shape),
                                      local.dtype))
        entry = torch.Tensor._dtensor__new__(HeldEntry, local, spec, requires_grad=False)
        entry._spec, entry._local_tensor, entry.owner_here = spec, local, owner_here
        return entry

    def __create_write_items__(self, fqn, object):
        from torch.distributed.checkpoint.planner_helpers import _create_write_item_for_tensor

        return [_create_write_item_for_tensor(fqn, self._local_tensor)] if self.owner_here else []

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.planner_helpers import _create_chunk_from_tensor

        return [_create_chunk_from_tensor(self._local_tensor)] if self.owner_here else []

    def __get_tensor_shard__(self, index):
        return self._local_tensor


def install_state_dict_hooks(model, mesh, schedule, tensor_parallel=False):
    """Registers the model's hooks for the held parameters of `schedule` (schedule.registry): its
    state_dict lists HeldEntry values for them; load_state_dict takes any of the values above.
    tensor_parallel: the held matrices are TP slices (tensor_parallel.py), whose entries are not written
    yet: both raise NotImplementedError, on every rank (no collective has run)."""

    def refuse_tensor_parallel():
        if tensor_parallel:
            raise NotImplementedError("dmuon.torch.hold_on_owners: the state_dict of owner-held matrices under "
                                      "tensor parallelism is not implemented yet (read the weights inside "
                                      "`with held.unshard():`, or train in DMuon's all-to-all mode to checkpoint)")

    def entries(module, state_dict, prefix, local_metadata):
        refuse_tensor_parallel()
        schedule.adopt()
        for name, (p, owner_here) in schedule.registry.items():
            key = prefix + name
            if key not in state_dict:
                continue
            local = p.detach() if owner_here else NegativeZeros(p.shape, p.dtype, p.device)
            state_dict[key] = HeldEntry.make(local, mesh, owner_here)

    def to_plain(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        refuse_tensor_parallel()
        schedule.adopt()
        for name in schedule.registry:
            key = prefix + name
            value = state_dict.get(key)
            if isinstance(value, HeldEntry):
                if value.owner_here:
                    state_dict[key] = value._local_tensor
                else:
                    state_dict.pop(key)  # nothing to write here; not reported missing (below)
            elif isinstance(value, DTensor):
                state_dict[key] = value.full_tensor()

    def not_missing(module, incompatible_keys):
        incompatible_keys.missing_keys[:] = [
            k for k in incompatible_keys.missing_keys
            if not any(k == n or k.endswith("." + n) for n, (_, here) in schedule.registry.items() if not here)]
        schedule.after_step()

    model.register_state_dict_post_hook(entries)
    model.register_load_state_dict_pre_hook(to_plain)
    model.register_load_state_dict_post_hook(not_missing)
