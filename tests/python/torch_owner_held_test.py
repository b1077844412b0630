"""dmuon.torch.hold_on_owners (the owner-centric mode) against a float64 single-process reference and
against the all-to-all mode (the same model and optimizer without hold_on_owners), at N ranks (gloo).

Run: torchrun --standalone --nproc_per_node N tests/python/torch_owner_held_test.py (N = 1..4), with
PYTHONPATH=build/python:tests/python and one BLAS thread per rank. One launch runs every variant:
  fsdp2                  blocks and root under fully_shard on a 1-D mesh, held matrices ignored
  fsdp2 kept             hold_on_owners(reshard_after_forward=False): no broadcast in backward
  micro-batches          3 per step, the first two without gradient sync (the owners' and FSDP2's)
  micro-batches synced   3 per step, each reduced to the owners (the owner accumulates)
  checkpointing          every block under torch.utils.checkpoint (non-reentrant): the recompute in
                         backward broadcasts the weights again
  checkpointing reentrant  the same with use_reentrant=True (the recompute's own backward reduces)
  uneven owners          two held matrices of 96×12 and 12×12 (at 3-4 ranks some own nothing), the
                         other Muon matrices left to FSDP2 (both modes in one optimizer)
  hsdp                   a (2, N/2) mesh (N even): two-stage reduce and broadcast
  ddp                    no mesh: DDP over the rest, told to ignore the held matrices
  fsdp2 torch engine     fsdp2 with DMuon(engine="torch") (torch_engine.py), at 2 ranks: also within twice the
                         tolerance of fsdp2's libdmuon_c run (each is within it of float64)
Each trains 10 steps of Muon (3-D experts as their own matrices) + AdamW with weight decay and
clipping by the global gradient norm (which must equal the reference's, within 1e-5); every
tensor must be within 1e-5 (relative Frobenius) of the float64 reference that trains the global batch
in one process, and of the all-to-all run. Every Muon matrix is orthogonalized once per step in the
whole job (counted across ranks), and every rank's owned bytes stay within the planner's bound.
Errors: hold_on_owners after fully_shard, a fully_shard without ignored_params, a held matrix in an
AdamW group, step() after a backward without sync, predicates that differ across ranks, a split
(hold_on_owners's split=) that does not fit its matrix or is not a split — each the same error on every rank.
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from dmuon.torch import DMuon, hold_on_owners
from dmuon.torch.mpirun import init_process_group
from owner_held_model import global_batches, loss_of, make_net, rank_slice
from owner_held_runs import (BATCH, CLIP, HYPER, STEPS, TOLERANCE, full_weights, hyper_of, mesh_of, reference_run,
                             relative, wrap)
from rank_checks import check, finish, total_over_ranks
from muon_reference import muon_matrices
from rank_exit import exit_rank


def uneven(name, p):
    return name in ("blocks.0.up.weight", "blocks.0.mix.weight")


VARIANTS = {
    "fsdp2": dict(),
    "fsdp2 kept": dict(hold=dict(reshard_after_forward=False)),
    "micro-batches": dict(micro=3),
    "micro-batches synced": dict(micro=3, sync_each=True),
    "checkpointing": dict(net=dict(checkpointing="non-reentrant")),
    "checkpointing reentrant": dict(net=dict(checkpointing="reentrant")),
    "uneven owners": dict(net=dict(layers=1, hidden=96), hold=dict(predicate=uneven)),
    "hsdp": dict(mesh="hsdp"),
    "ddp": dict(mesh=None),
    "fsdp2 torch engine": dict(engine="torch", worlds=(2,)),
}


def set_sync(model, held, sync):
    if held is not None:
        held.set_requires_gradient_sync(sync)
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)


def train(variant, hold):
    """(full weights after STEPS steps, the optimizer, HeldMatrices or None, NS counts per step, the
    gradient norms DMuon measured per step)."""
    mesh = mesh_of(variant.get("mesh", "fsdp2"))
    net = make_net(**variant.get("net", {}))
    held = hold_on_owners(net, mesh, **variant.get("hold", {})) if hold else None
    model = wrap(net, mesh, held)
    opt = DMuon(net, engine=variant.get("engine", "auto"), **HYPER)
    micro = variant.get("micro", 1)
    ns_counts, norms = [], []
    for tokens in global_batches(STEPS, BATCH):
        mine = rank_slice(tokens, RANK, WORLD)
        for k, part in enumerate(mine.chunk(micro)):
            if micro > 1 and not variant.get("sync_each"):
                set_sync(model, held, k == micro - 1)
            (loss_of(model, part) / micro).backward()
        opt.step()
        opt.zero_grad()
        ns_counts.append(int(total_over_ranks(opt.last_stats["ns_matrices"])))
        norms.append(opt.last_grad_norm)
    return full_weights(net), opt, held, ns_counts, norms


def matrices_in(opt):
    return sum(muon_matrices(torch.empty(l.global_shape, device="meta")).shape[0]
               for l, g in zip(opt._layouts, opt._groups) if g["use_muon"])


def check_variant(label, variant, results):
    held_w, opt, held, ns_counts, norms = train(variant, hold=True)
    check(opt.engine.name == variant.get("engine", "dmuon"), f"{label}: engine {opt.engine.name}")
    a2a_w = train(variant, hold=False)[0]
    ref_w, ref_norms = reference_run(variant, hyper_of(opt))
    norm_error = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
    check(norm_error <= TOLERANCE, f"{label}: gradient norms {norms}, the reference's {ref_norms}")
    check(sum(n > CLIP for n in ref_norms) not in (0, STEPS), f"{label}: clipping at {CLIP} never or always "
          f"active (norms {ref_norms})")
    worst = 0.0
    for name, w in held_w.items():
        to_ref, to_a2a = relative(w, ref_w[name]), relative(w, a2a_w[name])
        worst = max(worst, to_ref, to_a2a)
        check(to_ref <= TOLERANCE, f"{label}: {name} relative error {to_ref:.2e} to the float64 reference")
        check(to_a2a <= TOLERANCE, f"{label}: {name} relative difference {to_a2a:.2e} to the all-to-all mode")
    expected = matrices_in(opt)
    check(all(c == expected for c in ns_counts),
          f"{label}: Newton–Schulz ran on {ns_counts} matrices per step in the job, not {expected} each step")
    check(max(held.owned_bytes) <= held.owned_bytes_bound,
          f"{label}: owned bytes {held.owned_bytes} over the bound {held.owned_bytes_bound}")
    check(len(held.names) > 0 and sum(held.owned_bytes) == sum(
        p.numel() * p.element_size() for p in held.params), f"{label}: owned bytes {held.owned_bytes}")
    if label == "uneven owners" and WORLD >= 3:
        check(held.owned_bytes.count(0) >= WORLD - 2, f"{label}: owned bytes {held.owned_bytes}")
    if "engine" in variant:
        _, libdmuon_c_w = results["fsdp2"]
        for name, w in held_w.items():
            gap = relative(w, libdmuon_c_w[name])
            worst = max(worst, gap)
            check(gap <= 2 * TOLERANCE, f"{label}: {name} relative difference {gap:.2e} to libdmuon_c's")
    return worst, held_w


# ---- errors: the same on every rank ----

def expect_error_everywhere(label, action, exception, *needles):
    """Every rank raises, each naming what it found (the ranks may find different parameters); returns
    this rank's message."""
    message = None
    try:
        action()
    except exception as e:
        message = str(e)
    check(message is not None and all(n in message for n in needles), f"{label}: {message!r} lacks {needles}")
    return message


def expect_same_error(label, action, exception, *needles):
    message = expect_error_everywhere(label, action, exception, *needles)
    messages = [None] * WORLD
    dist.all_gather_object(messages, message) if WORLD > 1 else messages.__setitem__(0, message)
    check(message is not None and all(m == messages[0] for m in messages), f"{label}: messages {messages}")


def check_errors():
    mesh = mesh_of("fsdp2")

    def after_fully_shard():
        net = make_net()
        fully_shard(net, mesh=mesh)
        hold_on_owners(net, mesh)
    expect_same_error("hold after fully_shard", after_fully_shard, ValueError, "blocks.0.experts",
                      "before fully_shard")
    expect_same_error("a split that does not fit", lambda: hold_on_owners(
        make_net(), mesh, split=lambda n, p: dict(split_heads=3) if n == "blocks.1.up.weight" else None), ValueError,
        "'blocks.1.up.weight' (20×12) has 20 rows, not a multiple of split_heads=3")
    expect_same_error("not a split", lambda: hold_on_owners(make_net(), mesh, split=lambda n, p: dict(lr=0.1)),
                      ValueError, "split of 'blocks.0.", "must give None or a dict of split_heads, split_sizes, "
                      "split_dim, got {'lr': 0.1}")

    def forgotten_ignored_params():
        net = make_net()
        hold_on_owners(net, mesh)
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        loss_of(net, rank_slice(global_batches(1, BATCH)[0], RANK, WORLD))
    # One rank: found at the first forward. More: fully_shard fails reading a matrix another rank owns.
    expect_error_everywhere("fully_shard without ignored_params", forgotten_ignored_params, RuntimeError,
                            "blocks.", "ignored_params=held.params")

    def held_in_adamw():
        net = make_net()
        hold_on_owners(net, mesh)
        DMuon([{"params": list(net.named_parameters()), "use_muon": False}])
    expect_same_error("held in an AdamW group", held_in_adamw, ValueError, "blocks.0.experts", "AdamW")

    def step_without_sync():
        net = make_net()
        held = hold_on_owners(net, mesh)
        wrap(net, mesh, held)
        opt = DMuon(net)
        set_sync(net, held, False)
        loss_of(net, rank_slice(global_batches(1, BATCH)[0], RANK, WORLD)).backward()
        opt.step()
    expect_same_error("step after a backward without sync", step_without_sync, RuntimeError,
                      "set_requires_gradient_sync(False)")

    def predicates_differ():
        hold_on_owners(make_net(), mesh, predicate=lambda n, p: p.dim() >= 2 and (RANK == 0 or "up" not in n))
    if WORLD > 1:
        expect_same_error("predicates differ", predicates_differ, ValueError, "differ across ranks")


def main():
    results = {}
    for label, variant in VARIANTS.items():
        if variant.get("mesh") == "hsdp" and WORLD % 2 or WORLD not in variant.get("worlds", (WORLD,)):
            continue
        results[label] = check_variant(label, variant, results)
    check_errors()
    worst = ", ".join(f"{k} {v:.1e}" for k, (v, _) in results.items())
    return finish(f"torch_owner_held_test np {WORLD}: worst relative difference (to float64, to all-to-all) {worst}")


if __name__ == "__main__":
    RANK, WORLD = init_process_group("gloo")
    torch.manual_seed(0)
    exit_rank(main())
