"""Muon's options per param group at N ranks (gloo), in both modes: all-to-all after the fact (every
block under fully_shard) and owner-centric (hold_on_owners, then fully_shard of the rest). The model of
torch_owner_held_test.py trains 10 steps with param groups of Muon options:
  blocks.0   scale="spectral", ns_steps=4, cautious_wd=True
  blocks.1   scale="unit_rms", extra_scale_factor=0.1, algo="gram"
  blocks.2   split Newton–Schulz: mix (12×12) and the experts (3 of 12×12) in 4 heads of 3 rows, up (20×12)
             in row blocks of 8 and 12, down (12×20) in 2 heads of 10 columns (no divisibility by the
             world size: 4, 3 and 2 blocks at 3 ranks)
  blocks.3   the constructor's options (match_rms_adamw, 5 steps, no cautious weight decay)
and AdamW for the rest. Every tensor must be within 1e-5 (relative Frobenius) of the float64 reference
(torch_dmuon_mpi_test.Reference, which applies each group's options by their definitions) and of the
other mode; a bucket holds matrices of one options value only.

Run: torchrun --standalone --nproc_per_node N tests/python/torch_muon_options_ranks_test.py (N = 1..4),
with PYTHONPATH=build/python:tests/python and one BLAS thread per rank.
"""

import torch
import torch.distributed as dist

import torch_owner_held_test as held_test
from dmuon.torch import DMuon, hold_on_owners
from dmuon.torch.mpirun import init_process_group
from dmuon.torch.params import module_groups
from owner_held_model import global_batches, loss_of, make_net, rank_slice
from rank_checks import check, finish
from rank_exit import exit_rank

NET = dict(layers=4)
# (name prefix, options): a Muon matrix takes the first whose prefix its name starts with.
OPTIONS = [("blocks.0.", dict(scale="spectral", ns_steps=4, cautious_wd=True)),
           ("blocks.1.", dict(scale="unit_rms", extra_scale_factor=0.1, algo="gram")),
           ("blocks.2.mix", dict(split_heads=4)),
           ("blocks.2.experts", dict(split_heads=4)),
           ("blocks.2.up", dict(split_sizes=[8, 12])),
           ("blocks.2.down", dict(split_heads=2, split_dim=1)),
           ("blocks.3.", dict())]


def groups_of(net):
    """module_groups(net) with its Muon group split into one group per entry of OPTIONS."""
    out = []
    for group in module_groups(net):
        if not group["use_muon"]:
            out.append(group)
            continue
        for prefix, options in OPTIONS:
            members = [(n, p) for n, p in group["params"]
                       if next(q for q, _ in OPTIONS if n.startswith(q)) == prefix]
            out.append({"params": members, "use_muon": True, **options})
    return out


def train(hold):
    """(full weights after the steps, the optimizer)."""
    mesh = held_test.mesh_of("fsdp2")
    net = make_net(**NET)
    held = hold_on_owners(net, mesh) if hold else None
    model = held_test.wrap(net, mesh, held)
    opt = DMuon(groups_of(net), **held_test.HYPER)
    for tokens in global_batches(held_test.STEPS, held_test.BATCH):
        loss_of(model, rank_slice(tokens, dist.get_rank(), dist.get_world_size())).backward()
        opt.step()
        opt.zero_grad()
    return held_test.full_weights(net), opt


def main():
    held_test.RANK, held_test.WORLD = dist.get_rank(), dist.get_world_size()
    results = {mode: train(hold=mode == "owner-centric") for mode in ("all-to-all", "owner-centric")}
    ref_w, _ = held_test.reference_run({"net": NET}, held_test.hyper_of(results["all-to-all"][1]))
    worst = 0.0
    for mode, (weights, opt) in results.items():
        for bucket in opt._buckets:
            check(len({k.options for k in bucket}) == 1, f"{mode}: a bucket mixes options: {[k.name for k in bucket]}")
        for name, w in weights.items():
            to_ref = held_test.relative(w, ref_w[name])
            to_other = held_test.relative(w, results["all-to-all"][0][name])
            worst = max(worst, to_ref, to_other)
            check(to_ref <= held_test.TOLERANCE, f"{mode}: {name} relative error {to_ref:.2e} to the float64 reference")
            check(to_other <= held_test.TOLERANCE, f"{mode}: {name} relative difference {to_other:.2e} to all-to-all")
    return finish(f"torch_muon_options_ranks_test np {dist.get_world_size()}: worst relative difference {worst:.1e}")


if __name__ == "__main__":
    init_process_group("gloo")
    torch.manual_seed(0)
    exit_rank(main())
