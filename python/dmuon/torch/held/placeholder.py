"""What stands in for an owner-held parameter on the ranks that do not own it (and for its gradient
there): a tensor with the parameter's shape, dtype and device and no storage (DESIGN 7, "what real
FSDP2 scripts do to parameters").

A rank other than the owner has the matrix's values only while its module runs (hooks.py swaps the
module's working copy in); outside that, the module's registered parameter is a HeldElsewhere. On it:
  reads        raise HeldElsewhereError, naming the parameter, its owner and what to do instead
               (p.float().norm(), p.clone(), copy.deepcopy, torch.save, clip_grad_norm_ over its
               gradient): never a crash, never values that are not the owner's
  writes       are skipped: every rank runs the same script, and the owner's copy takes the write
               (init_weights, reset_parameters, load_state_dict, zero_grad(set_to_none=False))
  random fills draw as many numbers as on the owner, so every rank's generator stays in step with a
               materialised init: the fill runs on a scratch copy, which the placeholder then reads
               and writes as the owner does its master (trunc_normal_ resamples by the values it
               drew), until another placeholder's fill or the held hooks' next use drop it: one
               matrix at a time, the owner's values (every rank runs the same ops)
  .to(), .to_empty(), .half(), detach, views   give another HeldElsewhere (with the new dtype or
               device), so nn.Module._apply keeps the parameter object
"""

import torch
from torch.utils._pytree import tree_flatten, tree_map

# In-place fills that draw from the generator: run on a scratch tensor of the same shape, so that
# this rank's generator advances exactly as the owner's.
_RANDOM_FILLS = {torch.ops.aten.normal_, torch.ops.aten.uniform_, torch.ops.aten.bernoulli_, torch.ops.aten.random_,
                 torch.ops.aten.exponential_, torch.ops.aten.geometric_, torch.ops.aten.log_normal_,
                 torch.ops.aten.cauchy_}
# Ops that give a tensor like the placeholder without reading its values.
_RETYPES = {torch.ops.aten._to_copy, torch.ops.aten.empty_like, torch.ops.aten.detach, torch.ops.aten.alias}
# Factories that read only the placeholder's dtype and device: they give a real tensor.
_FACTORIES = {torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided, torch.ops.aten.new_zeros,
              torch.ops.aten.new_ones, torch.ops.aten.new_full}


class HeldElsewhereError(RuntimeError):
    """A read of an owner-held parameter (or of its gradient) on a rank that does not own it."""


class HeldElsewhere(torch.Tensor):
    """name: the parameter's name; owner: the global rank that owns it; gradient: whether this stands
    for the parameter's gradient (whose reads have another remedy)."""

    @staticmethod
    def __new__(cls, shape, dtype, device, name, owner, gradient=False, requires_grad=False):
        device = torch.device(device)
        if device.type == "cpu":  # as a CPU tensor's: "cpu" whatever index it was given ("cpu:0", accelerate's
            device = torch.device("cpu")  # CPU device), so a master's device compares equal to its working copy's
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)
        t.held_name, t.held_owner, t.held_gradient = name, owner, gradient
        t.scratch = None  # the values of a random fill, until drop_scratch()
        return t

    def like(self, shape=None, dtype=None, device=None):
        return HeldElsewhere(self.shape if shape is None else shape, dtype or self.dtype, device or self.device,
                             self.held_name, self.held_owner, self.held_gradient)

    def error(self):
        if self.held_gradient:
            return HeldElsewhereError(
                f"the gradient of parameter '{self.held_name}' is held on rank {self.held_owner} "
                "(dmuon.torch.hold_on_owners): this rank does not have it. Clip with "
                "dmuon.torch.clip_grad_norm_(model.parameters(), max_norm) (every rank) or DMuon's clip_grad_norm "
                "option; torch.nn.utils.clip_grad_norm_ would compute a different norm on every rank")
        return HeldElsewhereError(
            f"parameter '{self.held_name}' is held on rank {self.held_owner} (dmuon.torch.hold_on_owners): this rank "
            "has its values only while its module runs. Read it on every rank inside `with held.unshard():`, "
            f"on rank {self.held_owner} alone, or through get_model_state_dict(model, options=StateDictOptions("
            "full_state_dict=True)); fully_shard and DDP must be given ignored_params=held.params")

    def __repr__(self, *, tensor_contents=None):
        kind = "gradient of" if self.held_gradient else "parameter"
        return (f"HeldElsewhere({kind} '{self.held_name}', shape {tuple(self.shape)}, {self.dtype}, "
                f"held on rank {self.held_owner})")

    def __deepcopy__(self, memo):
        raise self.error()

    def __reduce_ex__(self, protocol):
        raise self.error()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        held = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, HeldElsewhere)]
        first = held[0]
        packet = func.overloadpacket
        if packet in _RANDOM_FILLS and isinstance(args[0], HeldElsewhere):
            target = args[0]
            if _live[0] is not target:
                drop_scratch()
                target.scratch = torch.empty(target.shape, dtype=target.dtype, device=target.device)
                _live[0] = target
            func(target.scratch, *args[1:], **kwargs)
            return target
        moves = packet in _RETYPES and ("device" in kwargs or "dtype" in kwargs)
        if not moves and any(t.scratch is not None for t in held):
            def values(t):
                return t.scratch if isinstance(t, HeldElsewhere) and t.scratch is not None else t
            out = func(*tree_map(values, args), **tree_map(values, kwargs))
            return args[0] if func._schema.is_mutable and isinstance(args[0], HeldElsewhere) else out
        if packet in _RETYPES:
            return first.like(dtype=kwargs.get("dtype"), device=kwargs.get("device"))
        if packet in _FACTORIES:
            stand_in = torch.empty(0, dtype=first.dtype, device=first.device)
            return func(*tree_map(lambda t: stand_in if t is first else t, args), **kwargs)
        if func.is_view:
            meta = tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")
                            if isinstance(t, HeldElsewhere) else t, args)
            out = func(*meta, **kwargs)
            return [first.like(shape=t.shape) for t in out] if isinstance(out, (list, tuple)) else first.like(shape=out.shape)
        if func._schema.is_mutable:
            return _write(func, args, kwargs)
        raise first.error()


_live = [None]  # the placeholder holding a scratch copy, if any


def drop_scratch():
    """Drops the scratch copy of the last random fill (hooks.py, before any use of held weights)."""
    if _live[0] is not None:
        _live[0].scratch = None
        _live[0] = None


def _written(func, args, kwargs):
    """The arguments func writes into (a tensor or a list of tensors each)."""
    out = []
    for k, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[k] if k < len(args) else kwargs.get(arg.name)
            out.append(value)
    return out


def _write(func, args, kwargs):
    """An in-place op with placeholders among its arguments: skipped for placeholder targets (the owner
    writes its own copy), run for real targets when no placeholder is read."""
    written = _written(func, args, kwargs)
    if func.name().startswith("aten::_foreach_") and written and isinstance(written[0], (list, tuple)):
        keep = [k for k, t in enumerate(written[0]) if not isinstance(t, HeldElsewhere)]
        if len(keep) == len(written[0]):
            raise next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, HeldElsewhere)).error()
        if keep:
            n = len(written[0])
            pick = [[a[k] for k in keep] if isinstance(a, (list, tuple)) and len(a) == n else a for a in args]
            func(*pick, **kwargs)
        return None
    if all(isinstance(t, HeldElsewhere) for t in written):
        return args[0]
    raise next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, HeldElsewhere)).error()
