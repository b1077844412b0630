"""channels_last conv nets under real multi-rank layouts (issue 40), at 1–2 ranks (gloo, CPU):

  fsdp2       a ConvNet and a ViT-style patch embedding (torch_strides_test.py) under fully_shard, on
              channels_last inputs (fully_shard refuses channels_last parameters itself: torch's
              NotImplementedError "FSDP does not support non-contiguous parameters", at fully_shard or at a
              later .to(memory_format=...)), train 5 steps as on contiguous inputs, and as one process
              trains the contiguous net on the global batch (within float32 rounding of their different
              convolution and reduction orders)
  held        the nets converted to channels_last with their Muon matrices owner-held
              (dmuon.torch.hold_on_owners, the rest under fully_shard: the channels_last masters stay on
              their owners), dmuon.torch.clip_grad_norm_ clipping every step, against the contiguous held
              run

Run: PYTHONPATH=build/python:tests/python python tests/python/run_ranks.py --nproc 2 --timeout 300 -- \
     tests/python/torch_strides_ranks_test.py
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dmuon.torch
from dmuon.torch import DMuon, hold_on_owners
from dmuon.torch.mpirun import init_process_group
from rank_checks import check, finish, total_over_ranks
from rank_exit import exit_rank
from torch_strides_test import CONV_TOLERANCE, HYPER, ConvNet, PatchEmbedding

STEPS, BATCH = 5, 4
CLIP = 0.5


def batches():
    """The global batches (x (B, 3, 16, 16), labels (B,)), the same on every rank."""
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        yield torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def train(net_class, fmt, mode):
    """{name: full weight} after STEPS steps of net_class in memory format fmt. mode: "one" (one process, the
    global batch), "fsdp2" (fully_shard of every conv and the root, this rank's slice of the batch) or "held"
    (the Muon matrices owner-held, the rest under fully_shard, clipping every step). The inputs are in fmt;
    so are the parameters, but under fsdp2, whose fully_shard takes contiguous parameters only."""
    torch.manual_seed(0)
    net = net_class()
    if mode != "fsdp2":  # fully_shard refuses non-contiguous parameters (torch's NotImplementedError)
        net = net.to(memory_format=fmt)
    mesh = init_device_mesh("cpu", (WORLD,)) if mode != "one" else None
    held = hold_on_owners(net, mesh) if mode == "held" else None
    if mode != "one":
        ignored = held.params if held is not None else None
        for m in net.modules():
            if isinstance(m, torch.nn.Conv2d):
                fully_shard(m, mesh=mesh, ignored_params=ignored)
        fully_shard(net, mesh=mesh, ignored_params=ignored)
    opt = DMuon(net, **HYPER)
    for x, y in batches():
        if mode != "one":
            x, y = x[RANK::WORLD], y[RANK::WORLD]
        # each rank's mean over its equal slice: FSDP2's (and the owners') mean over ranks is the global batch's
        torch.nn.functional.cross_entropy(net(x.contiguous(memory_format=fmt)), y).backward()
        if mode == "held":
            dmuon.torch.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    if mode == "held" and fmt is torch.channels_last:
        owned = [(n, p) for n, p in net.named_parameters() if n in held.owners and held.owners[n] == RANK and p.dim() == 4]
        for name, p in owned:
            check(p.is_contiguous(memory_format=fmt) and not p.is_contiguous(),
                  f"{net_class.__name__} held: '{name}' has strides {p.stride()} after the steps, not channels_last")
        check(total_over_ranks(len(owned)) > 0, f"{net_class.__name__} held: no conv filter is held")
    return full_weights(net, held)


def full_weights(net, held):
    out = {}
    for name, p in net.named_parameters():
        if held is not None and name in held.owners:
            info = p._dmuon_held
            value = p.detach().contiguous() if info.owner == RANK else torch.empty(p.shape, dtype=p.dtype)
            dist.broadcast(value, src=info.global_ranks[info.owner])
        else:
            value = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = value.detach().contiguous().clone()
    return out


def compare(label, got, expected):
    for name, w in expected.items():
        error = float((got[name] - w).abs().max())
        check(error <= CONV_TOLERANCE, f"{label}: '{name}' differs by {error:.2e} (> {CONV_TOLERANCE})")


def main():
    for net_class in (ConvNet, PatchEmbedding):
        label = net_class.__name__
        reference = train(net_class, torch.contiguous_format, "one")
        for mode in ("fsdp2", "held"):
            contiguous = train(net_class, torch.contiguous_format, mode)
            channels_last = train(net_class, torch.channels_last, mode)
            compare(f"{label} {mode}: channels_last against contiguous", channels_last, contiguous)
            if mode == "fsdp2":
                compare(f"{label} fsdp2 channels_last against one process", channels_last, reference)
    return finish(f"torch_strides_ranks_test np {WORLD}: channels_last ConvNet and patch embedding under FSDP2 "
                  "and owner-held, against contiguous")


if __name__ == "__main__":
    RANK, WORLD = init_process_group("gloo")
    exit_rank(main())
