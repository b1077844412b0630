"""DMuon against microsoft/dion's own distributed Muon and NorMuon under real FSDP2 (issue 42), at the W ranks of
a torchrun (gloo, CPU), the cases of peer_agreement.py (DION_CASES) and its trick: one float32 Newton–Schulz for
both (the torch engine's, dion's newton_schulz_func), momentum 0, bfloat16-exact gradients, and the float64
reference of tests/python/muon_reference.py beside them as the arbiter. Per case, three copies of one model (its
matrices blocks.i.weight, shapes DION_CASES's), trained STEPS steps side by side:

  dion           fully_shard on a 1-D mesh (rows sharded: Shard(0)), dion's Muon or NorMuon with that mesh as
                 its distributed_mesh (its all-to-all of the rows to the matrices)
  all-to-all     fully_shard the same way, DMuon (engine="torch")
  owner-centric  hold_on_owners, then fully_shard of the rest, DMuon (engine="torch")

The loss is Σ_i ⟨W_i, G_i⟩ with the step's G_i the same on every rank, so FSDP2's reduce-scatter (and the held
matrices' reduce to their owner) hands every optimizer the mean of W equal gradients, G_i itself: each step checks
that every gradient arrived bit for bit. Figures per (W, mode, case), the worst step, Frobenius over the whole
matrices: |ours − dion| / |dion's change of the weights|; ours and dion against the float64 reference, over its
change; for NorMuon split by rows or not at all, dion also against a float64 model of what its distributed code
does by design (normuon.py: "normalization stays per-shard there"): the NorMuon normalization of each rank's rows
on their own, its Frobenius rescale over the shard instead of the matrix (or split_sizes block). A case that
dion refuses at W ranks (its split_sizes and num_heads need the rows and heads to divide by W) shows its error; a
peer that does not import is skipped with the reason. Rank 0 prints the table; --json OUT writes its rows. dion
is never part of dmuon: check it out beside it and put it on PYTHONPATH.

    PYTHONPATH=build/python:/path/to/dion OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \\
        torchrun --standalone --nproc_per_node W python/benchmarks/peer_agreement_fsdp2.py [--json OUT]
"""

import argparse
import json
import pathlib
import sys
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dmuon.torch import hold_on_owners
from dmuon.torch.mpirun import init_process_group
from peer_agreement import (BETA2, DION_CASES, STEPS, case_inputs, dion_optimizer, dmuon_optimizer, reference_weights,
                            relative)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "python"))
import torch_owner_held_test as held_test  # noqa: E402  (mesh_of, wrap, full_weights)
from muon_reference import newton_schulz_ref, normuon_ref, update_scale  # noqa: E402
from rank_checks import total_over_ranks  # noqa: E402

MODES = ("dion", "all-to-all", "owner-centric")


class Probe(torch.nn.Module):
    """Weight W (m, n); forward(G) = ⟨W, G⟩, so ∂/∂W = G (m, n) on every rank that calls it with G."""

    def __init__(self, start):
        super().__init__()
        self.weight = torch.nn.Parameter(start.clone())

    def forward(self, g):
        return (self.weight * g).sum()


class Model(torch.nn.Module):
    """The case's matrices as blocks.i.weight, each its own FSDP2 unit (and owner-held unit)."""

    def __init__(self, start):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Probe(w) for w in start)

    def forward(self, grads):
        return sum(block(g) for block, g in zip(self.blocks, grads))


def build(mode, start, theirs_opts, ours_opts):
    """(model, its parameters' module, optimizer) of one mode over a copy of the start weights."""
    mesh = held_test.mesh_of("fsdp2")
    net = Model(start)
    held = hold_on_owners(net, mesh) if mode == "owner-centric" else None
    model = held_test.wrap(net, mesh, held)
    if mode == "dion":
        return model, net, dion_optimizer(list(net.parameters()), theirs_opts, mesh)
    return model, net, dmuon_optimizer(list(net.named_parameters()), ours_opts)


def gradients_arrived(net, step_grads):
    """Whether every gradient this rank holds is G's rows (a DTensor's local shard: FSDP2 chunks rows as
    torch.chunk, rank r's from r·ceil(m/W)) or the whole G (an owner's), bit for bit."""
    exact = True
    for p, g in zip(net.parameters(), step_grads):
        if isinstance(p.grad, DTensor):
            local = p.grad.to_local()  # (rows, n), rows possibly 0
            first = dist.get_rank() * -(-g.shape[0] // dist.get_world_size())
            exact &= torch.equal(local, g[first:first + local.shape[0]])
        elif not hasattr(p, "_dmuon_held") or p._dmuon_held.owner == dist.get_rank():  # elsewhere: a placeholder
            exact &= torch.equal(p.grad, g)
    return exact


def per_shard_normuon_ref(u, options, variance):
    """s·Ô of dion's NorMuon on FSDP2's row shards, in float64: O of each split_sizes block (its scale over the
    whole matrix's, as dion's split_scales), then NorMuon's normalization of each rank's rows on their own (its
    Frobenius rescale over the shard, not the block or the matrix), then the whole matrix's scale. variance: the
    shards' v by shard index. u (m, n)."""
    m, n = u.shape
    s = update_scale(m, n, options["scale"])
    o = torch.cat([newton_schulz_ref(b) * update_scale(b.shape[0], n, options["scale"]) / s
                   for b in torch.split(u, options.get("split_sizes") or [m])])
    chunk = -(-m // dist.get_world_size())  # FSDP2's rows per rank
    parts = []
    for index, rows in enumerate(torch.split(o, chunk)):
        v = variance.get(index, torch.zeros(rows.shape[0], dtype=torch.float64))
        normalized, variance[index] = normuon_ref(rows, v, BETA2)
        parts.append(normalized)
    return torch.cat(parts) * s


def run_case(case, shapes, theirs_opts, ours_opts):
    """The case's rows, one per mode: the worst step's gaps, or dion's error."""
    start, grads = case_inputs(case, shapes)
    runs, refused = {}, None
    for mode in MODES:
        try:
            runs[mode] = build(mode, start, theirs_opts, ours_opts)
        except ImportError as error:  # dion absent: every rank alike
            refused = f"skipped: {error}"
    # dion's NorMuon on row shards normalizes each shard on its own (its per-head path normalizes whole heads)
    per_shard = (reference_weights(start, grads, ours_opts, per_shard_normuon_ref)
                 if theirs_opts.get("normuon") and "num_heads" not in theirs_opts and dist.get_world_size() > 1
                 else None)
    worst = {mode: {"vs_dion": 0.0, "vs_f64": 0.0, "vs_per_shard": 0.0} for mode in MODES}
    exact = True
    for step, (step_grads, ref) in enumerate(zip(grads, reference_weights(start, grads, ours_opts))):
        for mode, (model, net, opt) in list(runs.items()):
            model(step_grads).backward()
            exact &= gradients_arrived(net, step_grads)
            try:
                opt.step()
            except (ValueError, NotImplementedError) as error:  # dion's checks, the same on every rank
                if mode != "dion":
                    raise
                refused = f"dion refuses: {type(error).__name__}: {error}"
                del runs[mode]
            opt.zero_grad()
        weights = {mode: held_test.full_weights(net) for mode, (_, net, _) in runs.items()}
        for mode, w in weights.items():
            for i, (r, s) in enumerate(zip(ref, start)):
                got = w[f"blocks.{i}.weight"]
                worst[mode]["vs_f64"] = max(worst[mode]["vs_f64"], relative(got, r, s))
                if per_shard is not None and mode == "dion":
                    worst[mode]["vs_per_shard"] = max(worst[mode]["vs_per_shard"], relative(got, per_shard[step][i], s))
                if "dion" in weights and mode != "dion":
                    worst[mode]["vs_dion"] = max(worst[mode]["vs_dion"],
                                                 relative(got, weights["dion"][f"blocks.{i}.weight"], s))
    exact = total_over_ranks(int(not exact)) == 0
    dion = "dion" in runs
    return [{"world": dist.get_world_size(), "mode": mode, "case": case, "steps": STEPS,
             "vs_dion": worst[mode]["vs_dion"] if dion else None, "vs_f64": worst[mode]["vs_f64"],
             "dion_vs_f64": worst["dion"]["vs_f64"] if dion else None,
             "dion_vs_per_shard": worst["dion"]["vs_per_shard"] if dion and per_shard is not None else None,
             "grads_exact": exact, "note": refused} for mode in ("all-to-all", "owner-centric")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # dion's and FSDP2's notices
    held_test.RANK, held_test.WORLD = dist.get_rank(), dist.get_world_size()
    rows = [row for case in DION_CASES for row in run_case(*case)]
    if dist.get_rank() != 0:
        return
    print("| ranks | mode | case | steps | ours vs dion | ours vs f64 | dion vs f64 | dion vs f64 per shard | note |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        figures = " | ".join("" if r[k] is None else f"{r[k]:.2e}"
                             for k in ("vs_dion", "vs_f64", "dion_vs_f64", "dion_vs_per_shard"))
        note = "; ".join(n for n in (r["note"], None if r["grads_exact"] else "gradients not G bit for bit") if n)
        print(f"| {r['world']} | {r['mode']} | {r['case']} | {r['steps']} | {figures} | {note} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    init_process_group("gloo")
    main()
    dist.destroy_process_group()
