"""Dense operands for code that takes a tensor as flat row-major memory (the engine's C ABI, torch's fused
AdamW kernel) from tensors of any strides torch allows: non-contiguous views, transposed matrices,
channels_last and channels_last_3d conv weights, expanded or sliced gradients, a .grad whose strides are
not its parameter's (docs/pytorch.md, "Layouts").

A contiguous tensor (row-major and dense: torch's is_contiguous) of the wanted dtype is used as it is, no
copy; any other is read through a row-major copy, and written through one that write_back() copies into it
(torch's copy_ follows the strides). So memory handed on never reaches past a tensor's own elements, and
the arithmetic sees the tensor's values in row-major order, as on a contiguous tensor of the same values.
A parameter whose elements may share memory (an expanded tensor) cannot be written element by element:
DMuon refuses it at construction (check_writable)."""

import torch


def may_overlap(t):
    """Whether two elements of t may share memory: false when, over the dims of more than one element
    sorted by stride, each stride exceeds the span of the dims before it (every non-overlapping layout
    torch makes: views, slices, permutations, as_strided with gaps), true for an expanded tensor."""
    span = 0
    for size, stride in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n > 1), key=lambda d: d[1]):
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False


def check_writable(name, t):
    """Raises ValueError naming parameter `name` and its strides when an optimizer cannot write t's
    elements one by one (they may share memory)."""
    if may_overlap(t):
        raise ValueError(f"DMuon: parameter '{name}' of shape {tuple(t.shape)} has strides {t.stride()}, under "
                         "which its elements may share memory (an expanded tensor); an optimizer writes every "
                         "element: give it a tensor of its own (.clone())")


class DenseOperands:
    """The dense forms of one call's operands: read(t) and write(t) return t itself when it is contiguous and
    of `dtype` (None: its own), else a row-major copy in `dtype`; write_back() copies the written copies
    into their tensors once the call has returned (rounding once to their dtype). Holds the copies until
    then."""

    def __init__(self):
        self._copies = []  # (tensor, its dense copy, written)

    def read(self, t, dtype=None):
        return self._dense(t, dtype, written=False)

    def write(self, t, dtype=None):
        return self._dense(t, dtype, written=True)

    def _dense(self, t, dtype, written):
        dtype = dtype or t.dtype
        if t.dtype == dtype and t.is_contiguous():
            return t
        copy = torch.empty(t.shape, dtype=dtype, device=t.device)
        copy.copy_(t)
        self._copies.append((t, copy, written))
        return copy

    def write_back(self):
        for t, copy, written in self._copies:
            if written:
                t.copy_(copy)
