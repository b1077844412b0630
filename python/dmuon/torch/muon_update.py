"""Muon's update rule (DESIGN 1) on tensors, by the engine's multi-tensor calls (include/dmuon/dmuon_c.h):
the part before Newton–Schulz (momentum and U), the part after it (the apply), and, for matrices held whole
here by their owner, both with the Newton–Schulz between them in one call: libdmuon_c's side of the engine seam
(engine.py's DmuonEngine, which exchange.py calls once per bucket and param group for each part); this module
turns tensors into the engine's pointers.

The step's values stay on the device (gradient_check.py): per parameter `keep` (it has a gradient on some
rank and every gradient is finite; false: its update changes nothing, bit for bit) and the clipping factor
are float32 device tensors whose addresses the engine's kernels read. The host reads neither.

The engine takes float32 and bfloat16 operands (bfloat16 is widened, computed on in float32 and rounded
back once). A tensor of another dtype (a float64 parameter, float16 state) goes through a float32 copy, one
that is not contiguous (a strided view, a channels_last weight) through a row-major copy (dense.py), an
output's copied back after the call: the arithmetic is float32 either way."""

import torch

import dmuon
from dmuon.torch.dense import DenseOperands
from dmuon.torch.gradient_check import to_device

CODES = {torch.float32: dmuon.DTYPE_F32, torch.bfloat16: dmuon.DTYPE_BF16}


def engine_device(device):
    """(device code, stream) of the engine's calls on tensors on `device`: the CPU (no stream) or a CUDA device
    (torch's current stream on it). Raises dmuon.UnsupportedError naming any other device."""
    if device.type == "cuda":
        return dmuon.DEVICE_CUDA, torch.cuda.current_stream(device).cuda_stream
    if device.type == "cpu":
        return dmuon.DEVICE_CPU, None
    raise dmuon.UnsupportedError(f"device {device}: libdmuon_c runs on cpu and cuda only")


def host_number(value):
    """A hyper-parameter as a float: a float as it is, a 1-element tensor read (on the CPU, where LR
    schedulers keep it, no wait for a device)."""
    return float(value) if torch.is_tensor(value) else value


class StepValues:
    """The engine's view of a step's GradientCheck: per parameter index a pointer to its keep flag, and a
    pointer to the clipping factor (None without clipping), both float32 on the gradients' device."""

    def __init__(self, check):
        self._keep = check.keep.to(torch.float32)
        self._grad_scale = None if check.grad_scale is None else check.grad_scale.to(torch.float32)

    def keep(self, indices):
        base, size = self._keep.data_ptr(), self._keep.element_size()
        return [base + i * size for i in indices]

    def keep_of(self, indices):
        """The keep flags of parameters `indices`, a float32 device tensor (len(indices),)."""
        return self._keep[to_device(list(indices), torch.long, self._keep.device)]

    @property
    def grad_scale(self):
        return None if self._grad_scale is None else self._grad_scale.data_ptr()

    @property
    def clip_factor(self):
        """The clipping factor, a float32 () device tensor, or None without clipping."""
        return self._grad_scale


class Operands:
    """The tensors of one engine call, which takes dense row-major memory of float32 or bfloat16 (dense.py):
    a tensor of another dtype or not contiguous is read through a copy (float32 for another dtype), an
    output written through one and copied back by write_back(). Holds the copies until the call has
    returned (the engine orders its work in the tensors' stream, so the caching allocator may then reuse
    them)."""

    def __init__(self):
        self._dense = DenseOperands()

    def read(self, t):
        return None if t is None else self._dense.read(t, _engine_dtype(t))

    def write(self, t):
        return self._dense.write(t, _engine_dtype(t))

    def write_back(self):
        self._dense.write_back()


def _engine_dtype(t):
    return t.dtype if t.dtype in CODES else torch.float32


def muon_momentum(entries, beta, nesterov, values, u_dtype):
    """M ← lerp(M, g, 1−β) in place and U = nesterov ? lerp(g, M, β) : M for each (index, momentum, grad)
    of `entries` (grad None: zeros; momentum contiguous, float32 or bfloat16); returns the U tensors (u_dtype, the
    momentum's shape), in order: U from M's float32 value before M is rounded into its dtype. values: the step's
    StepValues."""
    ops = Operands()
    u = [torch.empty_like(m, dtype=u_dtype) for _, m, _ in entries]
    device, stream = engine_device(entries[0][1].device)
    dmuon.muon_momentum([m.numel() for _, m, _ in entries], [ops.read(g) for _, _, g in entries],
                        [ops.write(m) for _, m, _ in entries], [ops.write(x) for x in u],
                        values.keep([i for i, _, _ in entries]), values.grad_scale, beta, nesterov,
                        device=device, stream=stream)
    ops.write_back()
    return u


def muon_apply(entries, lr, weight_decay, values, cautious_wd):
    """W ← W·(1 − lr·wd) − lr·(O·scale) in place for each (index, W, O, scale) of `entries`, where the
    parameter is kept (cautious_wd: the decay only where W·O ≥ 0); computed in float32 and rounded once to
    W's dtype."""
    ops = Operands()
    device, stream = engine_device(entries[0][1].device)
    dmuon.muon_apply([w.numel() for _, w, _, _ in entries], [ops.write(w) for _, w, _, _ in entries],
                     [ops.read(o) for _, _, o, _ in entries], values.keep([i for i, _, _, _ in entries]),
                     host_number(lr), weight_decay, [s for _, _, _, s in entries], cautious_wd, device=device,
                     stream=stream)
    ops.write_back()


def muon_update(ns, entries, rows, cols, group, scale, cautious_wd, values, names):
    """The whole update of rows×cols matrices held here whole, one call: for each (index, W, momentum,
    grad) of `entries` (views of shape (rows, cols)), the momentum, O = orth(U) by the Orthogonalizer
    `ns`, and the apply with `scale`, cautious_wd and the param group's hyper-parameters."""
    ops = Operands()
    device, stream = engine_device(entries[0][1].device)
    grads = [ops.read(g) for _, _, _, g in entries]
    momenta = [ops.write(m) for _, _, m, _ in entries]
    params = [ops.write(w) for _, w, _, _ in entries]
    ns.muon_update(grads, momenta, params, rows, cols, values.keep([i for i, _, _, _ in entries]), values.grad_scale,
                   group["momentum"], group["nesterov"], host_number(group["lr"]), group["weight_decay"], scale,
                   cautious_wd, device=device, stream=stream, names=names)
    ops.write_back()
