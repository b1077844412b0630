"""A rank's memory around an optimizer step, counted from what holds it and from the allocations the step makes,
for the benchmarks' memory tables (python/benchmarks/fsdp2_owner_step.py). CPU tensors; every optimizer is counted
the same way, from the outside, without changing its code path.

  held_bytes(model, optimizer, also)   the bytes kept between steps, by what keeps them (a dict):
      weights     the model's parameters as this rank stores them: FSDP2's shards (the float32 masters when
                  FSDP2 computes in bfloat16), an owner-held matrix whole on its owner (a placeholder, no
                  storage, elsewhere)
      state       the tensors in the values of every torch.optim.Optimizer's `state` reachable from `optimizer`
                  (DMuon's momentum, NorMuon's v, AdamW's step, m and v; a wrapper's inner optimizers' too)
      other       any other tensor reachable from the optimizer, the model or `also` (working copies such as full
                  matrices kept on every rank, buffers kept for the next step, gradients not freed)
      engine      the C++ engine's own buffers: its Newton–Schulz workspaces, pooled between calls
                  (dmuon.engine_bytes; 0 where libdmuon_c is not loaded)
      total       their sum
    Each storage is counted once (views and shared storages of one tensor are one), at its whole size; a DTensor
    by its local tensor. Reachable: through module attributes, the parameters and buffers, dicts, lists, tuples, sets
    and plain objects' attributes; not through functions, weak references or Python modules.

  StepAllocations()    a TorchDispatchMode: inside it, each storage that an op allocates (an output sharing no
                       input's storage) counts from its allocation until torch frees it (a finalizer on the
                       storage, which torch keeps exactly as long as its memory), and `peak` is the most bytes
                       alive at once, with the engine's growth above what it held on entry (its buffers) added at
                       each moment it happened (its high-water mark is read at every op and every free).
                       `live` after the block: what the step allocated and kept. Given the storages alive on
                       entry (existing=reachable_storages(...).values()), their frees inside lower `live`: a step
                       that replaces a buffer it held is not counted twice.

Not seen: memory allocated outside torch's dispatcher (a collective's internal buffers on gloo's threads, tensors
made from Python data), an op's temporaries inside a tensor subclass's own dispatch (a DTensor op's local
intermediates; its output counts), and storages resized outside ops.
"""

import types
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch without torch.distributed
    DTensor = ()


def engine_bytes(reset_peak=False):
    """(live, peak) of the C++ engine's buffers (dmuon.engine_bytes), (0, 0) where libdmuon_c is not loaded."""
    import dmuon
    if dmuon.library_error() is not None:
        return 0, 0
    return dmuon.engine_bytes(reset_peak)


def _storage(t):
    """The storage holding tensor t's values (a DTensor's local tensor's), or None for a tensor without one (a
    wrapper subclass such as dmuon.torch's placeholder, a meta tensor)."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    if t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
        storage.data_ptr()  # a wrapper subclass's stand-in storage has no memory: this raises
        return storage
    except (RuntimeError, NotImplementedError):
        return None


_NOT_FOLLOWED = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, type,
                 weakref.ref, weakref.ProxyType, str, bytes, int, float, bool, complex, type(None))


def reachable_storages(roots):
    """{storage key: storage} of every tensor reachable from roots (the module docstring's "reachable")."""
    found, seen, todo = {}, set(), list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _NOT_FOLLOWED):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = _storage(obj)
            if storage is not None and storage.nbytes():
                found[storage._cdata] = storage
            if obj.is_leaf:
                todo.append(obj.grad)
            todo.extend(getattr(obj, "__dict__", {}).values())  # a subclass's own tensors (a placeholder's scratch)
            continue
        if isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        else:
            if isinstance(obj, torch.nn.Module):
                todo.extend(obj.parameters(recurse=False))
                todo.extend(obj.buffers(recurse=False))
                todo.extend(obj.children())
            todo.extend(getattr(obj, "__dict__", {}).values())
            for slot in getattr(type(obj), "__slots__", ()):
                todo.append(getattr(obj, slot, None))
    return found


def _optimizers(optimizer):
    """Every torch.optim.Optimizer reachable from `optimizer` (itself and a wrapper's inner ones)."""
    out, seen, todo = [], set(), [optimizer]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _NOT_FOLLOWED) or isinstance(obj, (torch.Tensor, torch.nn.Module)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.optim.Optimizer):
            out.append(obj)
        if isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        else:
            todo.extend(getattr(obj, "__dict__", {}).values())
    return out


def held_bytes(model, optimizer, also=()):
    """The module docstring's held_bytes: {weights, state, other, engine, total} in bytes, this rank."""
    weights = {s._cdata: s for p in model.parameters() for s in [_storage(p)] if s is not None}
    state = {k: s for k, s in reachable_storages([list(o.state.values()) for o in _optimizers(optimizer)]).items()
             if k not in weights}
    other = {k: s for k, s in reachable_storages([optimizer, model, *also]).items()
             if k not in weights and k not in state}
    out = {name: sum(s.nbytes() for s in kept.values())
           for name, kept in (("weights", weights), ("state", state), ("other", other))}
    out["engine"] = engine_bytes()[0]
    out["total"] = sum(out.values())
    return out


class StepAllocations(TorchDispatchMode):
    """The module docstring's StepAllocations. engine: a function (reset_peak) → (live, peak) of memory torch does
    not allocate (engine_bytes; None: none); existing: the storages alive on entry (reachable_storages'
    values), whose frees inside then lower `live` below 0, so that a step that frees what it replaces is not
    counted twice."""

    def __init__(self, engine=engine_bytes, existing=()):
        super().__init__()
        self.live = self.peak = 0
        self._engine = engine
        self._engine_base = self._engine_extra = 0  # the engine's bytes on entry; its growth above them now
        self._counted = {}  # storage key → nbytes, of the storages allocated inside and alive, and of `existing`
        for storage in existing:
            self._track(storage, 0)

    def __enter__(self):
        if self._engine is not None:
            self._engine_base = self._engine(True)[0]
        return super().__enter__()

    def __exit__(self, *exc):
        self._engine_peak()  # an engine call after the last op
        return super().__exit__(*exc)

    def _engine_peak(self):
        """Adds the engine's most since the last look to the live count's peak; keeps its bytes now."""
        if self._engine is not None:
            live, peak = self._engine(True)
            self.peak = max(self.peak, self.live + peak - self._engine_base)
            self._engine_extra = live - self._engine_base

    def _note(self):
        self.peak = max(self.peak, self.live + self._engine_extra)

    def _freed(self, key):
        self._engine_peak()  # the engine's high-water mark came while this storage was still alive
        self.live -= self._counted.pop(key)

    def _track(self, storage, counted):
        """Lowers live by the storage's bytes when torch frees it; counted: what it adds to live now."""
        key, nbytes = storage._cdata, storage.nbytes()
        if nbytes == 0 or key in self._counted:
            return
        self._counted[key] = nbytes
        self.live += counted
        weakref.finalize(storage, self._freed, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._engine_peak()
        inputs = {s._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
                  for s in [_storage(t)] if s is not None}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = _storage(t)
                if storage is not None and storage._cdata not in inputs:
                    self._track(storage, storage.nbytes())
        self._note()
        return out
