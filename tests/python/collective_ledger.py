"""A ledger of torch.distributed's collectives, for tests: while it is open, every collective called
through the torch.distributed package (FSDP2, DDP, DMuon and our hooks all call it there) is recorded
as (label, op, group size, payload bytes, this rank's share of the wire bytes, async_op).

Wire bytes are what a ring/tree-optimal algorithm moves over the links for the whole group,
nccl-tests' "bus bytes" (NVIDIA/nccl-tests doc/PERFORMANCE.md), for a payload of n bytes over g
ranks: broadcast and reduce (g−1)·n; all-gather (n: the gathered output) and reduce-scatter (n: the
input) (g−1)·n; all-reduce 2·(g−1)·n; all-to-all the bytes each rank sends to the others. A rank's
share is the group's total over g (all-to-all: what this rank sends), so the shares summed over the
ranks give the job's wire bytes. Object collectives and barriers are recorded with 0 bytes.
"""

import inspect
from contextlib import contextmanager

import torch.distributed as dist

_BYTES = {
    # op: (argument holding the payload, wire-bytes factor over (g − 1)/g · payload)
    "broadcast": ("tensor", 1), "reduce": ("tensor", 1), "all_reduce": ("tensor", 2),
    "all_gather_into_tensor": ("output_tensor", 1), "all_gather_single": ("output_tensor", 1),
    "reduce_scatter_tensor": ("input", 1), "reduce_scatter_single": ("input", 1),
}
_OTHERS = ("all_to_all_single", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter",
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
        self.records.append(dict(label=label, op="event", group_size=1, payload=0, wire=0.0, async_op=False))

    def wire(self, label=None):
        """This rank's share of the wire bytes recorded under `label` (None: all)."""
        return sum(r["wire"] for r in self.records if label is None or r["label"] == label)

    def under(self, label):
        return [r for r in self.records if r["label"] == label]


@contextmanager
def recording(ledger):
    """Wraps torch.distributed's collectives while open; restores them after."""
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
            ledger.records.append(dict(label=ledger.label, op=op, group_size=g, payload=payload, wire=wire,
                                       async_op=bool(a.get("async_op", False))))
            return original(*args, **kwargs)
        return call

    for op, original in originals.items():
        setattr(dist, op, wrapped(op, original))
    try:
        yield ledger
    finally:
        for op, original in originals.items():
            setattr(dist, op, original)
