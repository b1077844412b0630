"""A ledger of torch.distributed's collectives, for tests: while it is open, every collective called
through the torch.distributed package (FSDP2, DDP, DMuon and our hooks all call it there) is recorded
as (label, op, group size, payload bytes, this rank's share of the wire bytes, async_op).

Wire bytes are what a ring/tree-optimal algorithm moves over the links for the whole group,
nccl-tests' "bus bytes" (NVIDIA/nccl-tests doc/PERFORMANCE.md), for a payload of n bytes over g
ranks: broadcast and reduce (g−1)·n; all-gather (n: the gathered output) and reduce-scatter (n: the
input) (g−1)·n; all-reduce 2·(g−1)·n; gather and scatter of n bytes per rank (g−1)·n; all-to-all the
bytes each rank sends to the others. A rank's
share is the group's total over g (all-to-all: what this rank sends), so the shares summed over the
ranks give the job's wire bytes. Object collectives and barriers are recorded with 0 bytes.

Each record also has "blocked": the seconds this rank spent blocked on it, in the call itself (a
synchronous collective) plus in its Work's wait() (an asynchronous one): the exposed communication.
"""

import inspect
import time
from contextlib import contextmanager

import torch.distributed as dist

_BYTES = {
    # op: (argument holding the payload, wire-bytes factor over (g − 1)/g · payload)
    "broadcast": ("tensor", 1), "reduce": ("tensor", 1), "all_reduce": ("tensor", 2),
    "all_gather_into_tensor": ("output_tensor", 1), "all_gather_single": ("output_tensor", 1),
    "reduce_scatter_tensor": ("input", 1), "reduce_scatter_single": ("input", 1),
    "gather": ("tensor", 1), "scatter": ("tensor", 1),
}
_OTHERS = ("all_to_all_single", "all_gather", "reduce_scatter", "all_to_all",
           "all_gather_object", "broadcast_object_list", "barrier", "send", "recv", "isend", "irecv",
           "batch_isend_irecv", "all_reduce_coalesced", "all_gather_coalesced")


def _nbytes(t):
    return t.numel() * t.element_size()


def _share(op, args, g):
    """This rank's share of the wire bytes of one call, and its payload bytes."""
    if op in _BYTES:
        name, factor = _BYTES[op]
        n = _nbytes(args[name])
        return factor * (g - 1) / g * n, n
    if op == "all_to_all_single":
        t = args["input"]
        rank = dist.get_rank(args.get("group"))
        splits = args.get("input_split_sizes")
        per_row = _nbytes(t) // max(t.shape[0], 1) if t.dim() else 0
        own = splits[rank] * per_row if splits else _nbytes(t) // g
        return _nbytes(t) - own, _nbytes(t)
    if op == "all_gather":
        n = _nbytes(args["tensor"])
        return (g - 1) * n, g * n
    if op == "reduce_scatter":
        n = sum(_nbytes(t) for t in args["input_list"])
        return (g - 1) / g * n, n
    if op == "all_to_all":
        n = sum(_nbytes(t) for t in args["input_tensor_list"])
        return (g - 1) / g * n, n
    return 0.0, 0


class Ledger:
    """The records of one recording() in call order, each under the label set when it was called."""

    def __init__(self):
        self.records = []   # dicts: label, op, group_size, payload, wire, async_op
        self.label = None   # set by the test: what the program is doing now ("forward", "step", ...)

    def note(self, label):
        """Records an event of the program (not a collective) in the same order as the collectives."""
        self.records.append(dict(label=label, op="event", group_size=1, payload=0, wire=0.0, async_op=False,
                                 blocked=0.0))

    def wire(self, label=None):
        """This rank's share of the wire bytes recorded under `label` (None: all)."""
        return sum(r["wire"] for r in self.records if label is None or r["label"] == label)

    def blocked(self, label=None):
        """Seconds this rank was blocked on collectives recorded under `label` (None: all)."""
        return sum(r["blocked"] for r in self.records if label is None or r["label"] == label)

    def under(self, label):
        return [r for r in self.records if r["label"] == label]


class _TimedWork(dist.Work):
    """A collective's Work whose wait() adds the seconds it blocked to its record."""

    def __init__(self, inner, record):
        super().__init__()
        self._inner, self._record = inner, record

    def wait(self, timeout=None):
        t0 = time.perf_counter()
        try:
            return self._inner.wait() if timeout is None else self._inner.wait(timeout)
        finally:
            self._record["blocked"] += time.perf_counter() - t0

    def is_completed(self):
        return self._inner.is_completed()

    def is_success(self):
        return self._inner.is_success()

    def exception(self):
        return self._inner.exception()

    def get_future(self):
        return self._inner.get_future()

    def result(self):
        return self._inner.result()


@contextmanager
def recording(ledger, also=()):
    """Wraps torch.distributed's collectives while open (and the same names in the modules `also`,
    for code that imported them by name); restores them after."""
    originals = {}
    for op in list(_BYTES) + list(_OTHERS):
        if hasattr(dist, op):
            originals[op] = getattr(dist, op)

    def wrapped(op, original):
        signature = inspect.signature(original)

        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            group = a.get("group")
            g = dist.get_world_size(group) if "group" in a else 1
            wire, payload = _share(op, a, g) if g > 1 else (0.0, 0)
            record = dict(label=ledger.label, op=op, group_size=g, payload=payload, wire=wire,
                          async_op=bool(a.get("async_op", False)), blocked=0.0)
            ledger.records.append(record)
            t0 = time.perf_counter()
            result = original(*args, **kwargs)
            if isinstance(result, dist.Work):
                return _TimedWork(result, record)
            record["blocked"] += time.perf_counter() - t0
            return result
        return call

    patched = [(module, op, getattr(module, op)) for module in (dist, *also) for op in originals
               if getattr(module, op, None) is originals[op]]
    for module, op, original in patched:
        setattr(module, op, wrapped(op, original))
    try:
        yield ledger
    finally:
        for module, op, original in patched:
            setattr(module, op, original)
