"""channels_last conv nets under real multi-rank layouts (issue 40), at 1–2 ranks (gloo, CPU):

  ddp         a ConvNet and a ViT-style patch embedding (conv_nets.py) in channels_last under
              DistributedDataParallel (the all-to-all mode: every rank applies its rows of O to its
              channels_last filter) train 5 steps as in contiguous format, and as one process trains the
              contiguous net on the global batch (within float32 rounding of their different convolution
              and reduction orders)
  fsdp2       the nets under fully_shard (every conv and the root), on
              channels_last inputs (fully_shard refuses channels_last parameters itself: torch's
              NotImplementedError "FSDP does not support non-contiguous parameters", at fully_shard or at a
              later .to(memory_format=...)), the same
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
from torch.nn.parallel import DistributedDataParallel

import dmuon.torch
from dmuon.torch import DMuon, hold_on_owners
from dmuon.torch.mpirun import init_process_group
from rank_checks import check, finish, total_over_ranks
from rank_exit import exit_rank
from conv_nets import CONV_TOLERANCE, HYPER, ConvNet, PatchEmbedding

STEPS, BATCH = 5, 4
CLIP = 0.5


def batches():
    """The global batches (x (B, 3, 16, 16), labels (B,)), the same on every rank."""
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        yield torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


def train(net_class, fmt, mode):
    """{name: full weight} after STEPS steps of net_class in memory format fmt. mode: "one" (one process, the
    global batch), "ddp" (DistributedDataParallel: replicated parameters, the all-to-all mode's rows of O sent
    to every rank), "fsdp2" (fully_shard of every conv and the root) or "held" (the Muon matrices owner-held,
    the rest under fully_shard, clipping every step); all but "one" on this rank's slice of the batch. The inputs are in fmt;
    so are the parameters, but under fsdp2, whose fully_shard takes contiguous parameters only."""
    torch.manual_seed(0)
    net = net_class()
    if mode != "fsdp2":  # fully_shard refuses non-contiguous parameters (torch's NotImplementedError)
        net = net.to(memory_format=fmt)
    mesh = init_device_mesh("cpu", (WORLD,)) if mode in ("fsdp2", "held") else None
    held = hold_on_owners(net, mesh) if mode == "held" else None
    forward = DistributedDataParallel(net) if mode == "ddp" else net
    if mode in ("fsdp2", "held"):
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
        torch.nn.functional.cross_entropy(forward(x.contiguous(memory_format=fmt)), y).backward()
        if mode == "held":
            dmuon.torch.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    if mode in ("ddp", "held") and fmt is torch.channels_last:  # the filters DMuon updated here kept their layout
        filters = [(n, p) for n, p in net.named_parameters()
                   if p.dim() == 4 and (held is None or (n in held.owners and held.owners[n] == RANK))]
        for name, p in filters:
            check(p.is_contiguous(memory_format=fmt) and not p.is_contiguous(),
                  f"{net_class.__name__} {mode}: '{name}' has strides {p.stride()} after the steps, not channels_last")
        check(total_over_ranks(len(filters)) > 0, f"{net_class.__name__} {mode}: no channels_last filter")
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
        for mode in ("ddp", "fsdp2", "held"):
            contiguous = train(net_class, torch.contiguous_format, mode)
            channels_last = train(net_class, torch.channels_last, mode)
            compare(f"{label} {mode}: channels_last against contiguous", channels_last, contiguous)
            if mode != "held":  # (clipping changes the held runs)
                compare(f"{label} {mode} channels_last against one process", channels_last, reference)
    return finish(f"torch_strides_ranks_test np {WORLD}: channels_last ConvNet and patch embedding under DDP, "
                  "FSDP2 and owner-held, against contiguous")


if __name__ == "__main__":
    RANK, WORLD = init_process_group("gloo")
    exit_rank(main())
