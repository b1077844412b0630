"""NorMuon (Li et al. 2025, arXiv 2510.05491; microsoft/dion's normuon.py): Muon whose orthogonalized update O of
an m × n matrix is normalized per row (neuron) by a running second moment before the apply:
    v ← β₂·v + (1 − β₂)·mean_j(O_ij²)                 v: one value per row, state "variance_neuron"
    Ô = O / (√v + 1e-8);  Ô ← Ô·‖O‖_F / max(‖Ô‖_F, 1e-8)
    W ← W·(1 − lr·wd) − lr·s·Ô                        as Muon (the scale s, cautious weight decay)
β₂ is the option normuon_beta2 (a Muon param group's key, default 0.95).
A matrix split for Newton–Schulz (MuonOptions.blocks) is normalized per block, as if each block were a parameter:
a row block with its rows' v, a column block with a v of its own per row. So v is (m, B) per matrix, B the
column blocks (1 without a column split): state laid out as the parameter's rows, (m, B) for a 2-D parameter,
(E, m, B) for a stack of experts, (out, B) for a filter, sharded over the ranks as the parameter's rows are.

The matrix's owner normalizes it whole, exactly (dion normalizes each shard on its own, an approximation): v is
this variant's row_state (base.py), so every holder's rows of v travel to the owner with its piece of U and back
with its piece of O, in the step's two all-to-alls (exchange.py); a matrix held whole by its owner alone
(owner-held, one process) needs no travel. A step whose update of the parameter is skipped (no gradient anywhere,
a non-finite one) leaves v as it was.
"""


import math

import torch

from dmuon.torch.dtensors import is_dtensor
from dmuon.torch.variants.base import Muon

EPS = 1e-8


class NorMuon(Muon):
    """The Variant (base.py) of this module's docstring."""

    options = {"normuon_beta2": 0.95}
    row_state = "variance_neuron"
    rewrites_o = True

    def check(self, values, where):
        beta2 = values.get("normuon_beta2", 0.0)
        if isinstance(beta2, bool) or not isinstance(beta2, (int, float)) or not 0.0 <= beta2 < 1.0:
            raise ValueError(f"{where}: normuon_beta2 must be a number in [0, 1), got {beta2!r}")

    def width(self, options, rows, cols, name):
        """B: the columns of a matrix's v (its column blocks, 1 without a column split)."""
        blocks = options.blocks(rows, cols, name)
        return len(blocks[1]) if blocks is not None and blocks[0] == 1 else 1

    def zero_state(self, layout, stack, width, dtype):
        return {self.row_state: zero_variance(layout, stack, width, dtype)}

    def after_orthogonalize(self, o, rows, first, keep):
        keep = keep()
        for o_block, v in block_views(o, rows, first.blocks):
            normalize(o_block, v, first.options.option("normuon_beta2"), keep)


def zero_variance(layout, experts, width, dtype):
    """The parameter's zero v, laid out as its rows: a DTensor parameter's v is a DTensor on its mesh with its
    placements on the row dims (dim 0, and dim 1 of a stack) and Replicate() on the others."""
    p = layout.tensor
    rank = 2 if experts else 1  # the dims of the parameter that v keeps

    def shape(full):
        return tuple(full[:rank]) + (width,)

    if not is_dtensor(p):
        return torch.zeros(shape(p.shape), dtype=dtype, device=p.device)
    from torch.distributed.tensor import DTensor, Replicate

    placements = tuple(q if not q.is_shard() or q.dim < rank else Replicate() for q in p.placements)
    local = torch.zeros(shape(p.to_local().shape), dtype=dtype, device=p.to_local().device)
    global_shape = shape(p.shape)
    stride = tuple(math.prod(global_shape[d + 1:]) for d in range(len(global_shape)))
    return DTensor.from_local(local, p.device_mesh, placements, run_check=False, shape=global_shape, stride=stride)


def block_views(stack, variance, blocks):
    """(O, v) views of a stack of matrices (K, m, n) and their v (K, m, B) per block: (K, rows, cols), (K, rows)."""
    if blocks is None:
        yield stack, variance[..., 0]
        return
    dim, sizes = blocks
    start = 0
    for b, size in enumerate(sizes):
        if dim == 0:
            yield stack[:, start:start + size, :], variance[:, start:start + size, 0]
        else:
            yield stack[:, :, start:start + size], variance[:, :, b]
        start += size


def normalize(o, v, beta2, keep):
    """The module's normalization in place, for a stack of matrices o (K, rows, cols) and their v (K, rows),
    computed in float32 (or v's wider dtype); keep (K,), float: where 0, v keeps its value."""
    dtype = torch.promote_types(v.dtype, torch.float32)
    x, old = o.to(dtype), v.to(dtype)
    norm = x.norm(dim=(-2, -1), keepdim=True)
    new = torch.lerp(old, (x * x).mean(dim=-1), 1 - beta2)
    y = x / (new.sqrt() + EPS).unsqueeze(-1)
    y = y * (norm / y.norm(dim=(-2, -1), keepdim=True).clamp(min=EPS))
    o.copy_(y)
    v.copy_(torch.where(keep.view(-1, 1) > 0, new, old))
