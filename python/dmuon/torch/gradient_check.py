"""What one DMuon step learns from its gradients, kept on their device (no host sync in step()).

One all_reduce over the optimizer's group of a float64 vector (float32 on MPS, which has no float64)
[Σ g² over replica 0's local parts, per rank the first non-finite parameter (index + 1, 0 for none), per
parameter 1 where this rank has a gradient, per parameter 1 where this rank takes part in its update, and a
caller's `extra` values (QK-clip's per-rank maxima, qk_clip.py)] gives every rank, as device tensors:
  grad_scale  the clipping factor, max_norm / (norm + 1e-6) when the norm exceeds max_norm, else 1
              (torch.nn.utils.clip_grad_norm_'s); None without clipping
  keep        per parameter: it has a gradient on some rank and every gradient is finite (the update
              of a parameter whose keep is false changes nothing: update rules mask, not branch)
  extra       the sum over ranks of `extra` (float64), None without it
veto(ok) folds a caller's device-side verdict into them (QK-clip's maxima under nonfinite="error"): where ok is
false, finite and every keep are false, so the step's writes change nothing.
The host reads the vector only in settle(), once it has arrived on the host: a CPU step's at its own
end; a GPU step's (a pinned copy made without waiting) at a later step() that finds it arrived, or
when the optimizer's counters, last_grad_norm or a state_dict are read (which wait for it). So a GPU
step() queues its work and returns, and a non-finite gradient is reported by a later call, its step
already skipped on the device.
"""

import math
from dataclasses import dataclass

import torch

from dmuon.torch.devices import ready_event, wide_dtype

def to_device(values, dtype, device):
    """A host list as a tensor on `device` without making the host wait for the device's queue (a
    pageable host-to-device copy would)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class Verdict:
    """What settle() read: the non-finite gradients [(rank, parameter index)], whether any parameter
    had a gradient on any rank, the global gradient norm (of the finite gradients), the sum of the
    caller's `extra` values (a host list; empty without them)."""

    bad: list
    any_gradient: bool
    norm: float
    extra: list


class GradientCheck:
    """The step's gradient facts for parameters 0..n-1 (the optimizer's agreed order). grads[i]: this
    rank's local gradient or None; counted[i]: whether this rank's part of parameter i counts in the
    global norm (replica 0's cells hold every element once); taking_part[i]: whether this rank takes
    part in its update (requires_grad; every rank must say the same); extra: a float64 tensor to sum over the
    ranks in the same all-reduce, or None. Collective over comm."""

    def __init__(self, comm, grads, counted, taking_part, max_norm, device, extra=None):
        n, world = len(grads), comm.world
        present = [i for i, g in enumerate(grads) if g is not None]
        wide = wide_dtype(device)
        head = torch.zeros(1 + world, dtype=wide, device=device)  # [Σ g², first bad per rank]
        if present:
            norms = torch.stack(torch._foreach_norm([grads[i] for i in present])).to(device, wide)
            finite = torch.isfinite(norms)
            counts = to_device([bool(counted[i]) for i in present], torch.bool, device)
            head[0] = torch.where(finite & counts, norms * norms, 0.0).sum()
            place = to_device([i + 1.0 for i in present], wide, device)
            first_bad = torch.where(finite, math.inf, place).min()
            head[1 + comm.rank] = torch.where(torch.isinf(first_bad), 0.0, first_bad)
        has = [0.0] * n
        for i in present:
            has[i] = 1.0
        flags_device = comm.tensor_device()
        flags = torch.cat([head.to(flags_device), to_device(has + [float(t) for t in taking_part], wide,
                                                            flags_device)]
                          + ([] if extra is None else [extra.to(flags_device, wide)]))
        reduced = comm.all_reduce_sum(flags)
        totals = reduced.to(device)  # a CPU group's result moves to the gradients' device
        self._world, self._n = world, n
        self.finite = totals[1:1 + world].sum() == 0                      # () bool
        self.keep = (totals[1 + world:1 + world + n] > 0) & self.finite   # (n,) bool
        self.extra = None if extra is None else totals[1 + world + 2 * n:]
        self.grad_scale = None
        if max_norm is not None:
            norm = totals[0].sqrt()
            self.grad_scale = torch.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0)
        self._ready = None
        if reduced.device.type == "cpu":
            self._host = reduced
        else:  # copied without waiting; settle() waits on the event, by then long passed
            self._host = torch.empty(reduced.shape, dtype=reduced.dtype, pin_memory=True)
            self._host.copy_(reduced, non_blocking=True)
            self._ready = ready_event(reduced.device)

    def veto(self, ok):
        """Folds ok (a () bool device tensor) into the step's facts: where false, nothing is updated."""
        self.finite = self.finite & ok
        self.keep = self.keep & ok

    def first_disagreement(self):
        """(index, ranks taking part) of the first parameter that some ranks but not all take part in,
        else None. Reads the vector: call it only when arrived()."""
        parts = self._host[1 + self._world + self._n:1 + self._world + 2 * self._n].tolist()
        return next(((i, int(c)) for i, c in enumerate(parts) if 0 < c < self._world), None)

    def arrived(self):
        """Whether settle() would not wait: the vector is on the host (a CPU step's always is)."""
        return self._ready is None or self._ready.query()

    def settle(self):
        """Reads the vector (waiting for its copy if it has not arrived)."""
        if self._ready is not None:
            self._ready.synchronize()
        totals = self._host.tolist()
        world, n = self._world, self._n
        bad = [(r, int(totals[1 + r]) - 1) for r in range(world) if totals[1 + r] > 0]
        return Verdict(bad=bad, any_gradient=any(v > 0 for v in totals[1 + world:1 + world + n]),
                       norm=math.sqrt(totals[0]), extra=totals[1 + world + 2 * n:])
