"""DMuon(step_memory=...): the owners' Newton–Schulz batches cut to a byte budget (matrices.step_budget, buckets_of),
at N ranks (gloo), on owner_held_model's Net of 4 blocks (dim 48, hidden 80: 16 matrices of 48 × 48 — each block's
mix and its 3 experts — 4 of 80 × 48, 4 of 48 × 80), under fully_shard, in both modes (all-to-all; owner-held by
hold_on_owners) and on both engines (libdmuon_c, torch):
  bit for bit   3 steps with a budget of one 80 × 48 matrix's step_bytes (every Newton–Schulz batch one matrix) and
                without one (None: each bucket one batch): every local weight and state tensor equal, bit for bit
  batches       with the budget no engine call takes more than one matrix; without it some takes several
  peak          the torch engine's step (all of its allocations seen by memory_count.StepAllocations): the transient
                peak with the budget below the peak without it, on every rank, in both modes
  errors        a budget below one matrix's step_bytes: ValueError naming the parameter, on every rank; a budget
                that is not "auto", None or an int ≥ 0: ValueError naming step_memory
Run: torchrun --standalone --nproc_per_node N tests/python/torch_step_memory_test.py (N = 1, 2), with
PYTHONPATH=build/python:tests/python and one BLAS thread per rank.
"""

import pathlib
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon.torch import DMuon, hold_on_owners
from dmuon.torch.dtensors import local_part
from dmuon.torch.held.placeholder import HeldElsewhere
from dmuon.torch.matrices import step_bytes
from dmuon.torch.mpirun import init_process_group
from owner_held_model import global_batches, loss_of, make_net, rank_slice
from rank_checks import check, finish
from rank_exit import exit_rank

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python" / "benchmarks"))
from memory_count import StepAllocations, reachable_storages  # noqa: E402

STEPS, BATCH = 3, 4
NET = dict(layers=4, dim=48, hidden=80)
ONE_MATRIX = step_bytes(80, 48)  # the largest matrix's: a budget of one matrix per batch
HYPER = dict(lr=0.02, momentum=0.9, weight_decay=0.01, adamw_lr=3e-3, clip_grad_norm=0.3, ns_dtype="float32")


def build(mode, engine, step_memory):
    """(net, optimizer) on a 1-D mesh: fully_shard every block and the root (owner-held: after hold_on_owners)."""
    mesh = init_device_mesh("cpu", (WORLD,))
    net = make_net(**NET)
    held = hold_on_owners(net, mesh) if mode == "owner" else None
    ignored = held.params if held is not None else None
    for block in net.blocks:
        fully_shard(block, mesh=mesh, ignored_params=ignored)
    fully_shard(net, mesh=mesh, ignored_params=ignored)
    return net, DMuon(net, engine=engine, step_memory=step_memory, **HYPER)


def count_batches(opt):
    """A list that receives the matrices of every engine Newton–Schulz call of opt (orthogonalize, update)."""
    sizes, engine = [], opt.engine
    orthogonalize, update = engine.orthogonalize, engine.update

    def orthogonalizing(ns, matrices, names):
        sizes.append(len(matrices))
        return orthogonalize(ns, matrices, names)

    def updating(ns, entries, *rest):
        sizes.append(len(entries))
        return update(ns, entries, *rest)
    engine.orthogonalize, engine.update = orthogonalizing, updating
    return sizes


def train(mode, engine, step_memory):
    """(this rank's local weights and states after STEPS steps, matrices per engine call, the last step's peak)."""
    net, opt = build(mode, engine, step_memory)
    sizes = count_batches(opt)
    peak = None
    for tokens in global_batches(STEPS, BATCH):
        loss_of(net, rank_slice(tokens, RANK, WORLD)).backward()
        with StepAllocations(existing=reachable_storages([opt, net]).values()) as count:
            opt.step()
        peak = count.peak
        opt.zero_grad()
    local = {}
    for name, p in net.named_parameters():
        if isinstance(local_part(p), HeldElsewhere):
            continue
        local[name] = local_part(p).detach().clone()
        for key, value in opt.state[p].items():
            local[f"{name} {key}"] = local_part(value).clone()
    return local, sizes, peak


def check_same(label, bounded, unbounded):
    check(bounded.keys() == unbounded.keys(), f"{label}: tensors {sorted(bounded)} vs {sorted(unbounded)}")
    for name in bounded.keys() & unbounded.keys():
        check(torch.equal(bounded[name], unbounded[name]), f"{label}: {name} differs with the budget")


def check_modes():
    for mode in ("a2a", "owner"):
        for engine in ("dmuon", "torch"):
            label = f"{mode} {engine}"
            bounded, cut, peak_cut = train(mode, engine, ONE_MATRIX)
            unbounded, whole, peak_whole = train(mode, engine, None)
            check_same(label, bounded, unbounded)
            check(max(cut, default=0) == 1, f"{label}: with the budget an engine call took {max(cut, default=0)}")
            check(max(whole, default=0) > 1, f"{label}: without a budget no engine call took several matrices "
                                             f"({whole}): the model does not test the cut")
            if engine == "torch":
                check(peak_cut < peak_whole, f"{label}: the step's peak {peak_cut} B with the budget, {peak_whole} "
                                             "B without")
                print(f"rank {RANK}: {label}: step peak {peak_cut} B with step_memory={ONE_MATRIX}, {peak_whole} B "
                      "without", flush=True)


def expect_error(label, step_memory, *needles):
    try:
        build("a2a", "torch", step_memory)
    except ValueError as e:
        check(all(n in str(e) for n in needles), f"{label}: message {e} lacks {needles}")
        return
    check(False, f"{label}: no error")


def main():
    check_modes()
    expect_error("below one matrix", ONE_MATRIX - 1, "step_memory", "blocks.0.up.weight", str(ONE_MATRIX))
    expect_error("not bytes", 1.5e6, "step_memory", "1500000.0")
    return finish(f"torch_step_memory_test np {WORLD}: both modes, both engines, bit for bit with a budget of one "
                  "matrix per batch")


if __name__ == "__main__":
    RANK, WORLD = init_process_group("gloo")
    exit_rank(main())
