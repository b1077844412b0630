"""What the owner-centric mode moves, and when, at N ranks (gloo), from a ledger of torch.distributed's
collectives (collective_ledger.py: wire bytes as nccl-tests' bus bytes, summed over the ranks).

Run: torchrun --standalone --nproc_per_node N tests/python/torch_owner_held_ledger_test.py (N = 1..4),
with PYTHONPATH=build/python:tests/python and one BLAS thread per rank.
  bytes     the same model (owner_held_model.Net, 3 blocks, every block and the root under fully_shard)
            trained 3 steps three ways: AdamW + FSDP2, DMuon's all-to-all mode, DMuon with
            hold_on_owners. The third step's wire bytes (forward, backward, step, the whole job): the
            owner-held run's at most 1.05× AdamW + FSDP2's (the figures are printed); and again with
            MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) on every fully_shard (bf16
            all-gathers and held broadcasts, float32 reduces), AdamW + FSDP2-MP against owner-held.
  step()    with hold_on_owners, step() issues exactly one collective: an all_reduce of
            (1 + N + 2·parameters) float64 (gradient norm, non-finite flags, gradient present, taking part).
  NS once   every Muon matrix is orthogonalized once per step in the whole job (counted across ranks).
  overlap   (N ≥ 2) in forward, the broadcast of block i+1's held matrices is posted before block i's
            forward ends; in backward, block i's gradient reduce is posted (asynchronously) before the
            backward of block i−1 ends (its last held gradient accumulated); with activation
            checkpointing too, where each block's recompute finds its weights broadcast again.
"""


import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from collective_ledger import Ledger, recording
from dmuon.torch import DMuon, hold_on_owners
from dmuon.torch.held.buffer import HeldBuffer
from dmuon.torch.mpirun import init_process_group
from owner_held_model import global_batches, loss_of, make_net, rank_slice
from rank_checks import check, finish, total_over_ranks
from rank_exit import exit_rank

STEPS = 3
BATCH = 12
RATIO_LIMIT = 1.05
HYPER = dict(lr=0.02, momentum=0.9, adamw_lr=3e-3)

def build(mode, mp_policy=None, **net_kwargs):
    net = make_net(**net_kwargs)
    mesh = init_device_mesh("cpu", (WORLD,))
    held = hold_on_owners(net, mesh) if mode == "owner-held" else None
    ignored = held.params if held is not None else None
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    for block in net.blocks:
        fully_shard(block, mesh=mesh, ignored_params=ignored, **policy)
    fully_shard(net, mesh=mesh, ignored_params=ignored, **policy)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3) if mode == "adamw" else DMuon(net, **HYPER)
    return net, opt, held


def train_recorded(mode, mp_policy):
    """(ledger, Newton–Schulz matrices per step in the job, Muon matrices, parameters) of STEPS steps."""
    net, opt, held = build(mode, mp_policy)
    ledger = Ledger()
    ns = []
    with recording(ledger):
        for step, tokens in enumerate(global_batches(STEPS, BATCH)):
            ledger.label = ("forward", step)
            loss = loss_of(net, rank_slice(tokens, RANK, WORLD))
            ledger.label = ("backward", step)
            loss.backward()
            ledger.label = ("step", step)
            opt.step()
            ledger.label = ("zero_grad", step)
            opt.zero_grad()
            ledger.label = None
            ns.append(opt.last_stats["ns_matrices"] if mode != "adamw" else 0)
    matrices = 0
    if mode != "adamw":
        matrices = sum(l.global_shape[0] if len(l.global_shape) == 3 else 1
                       for l, g in zip(opt._layouts, opt._groups) if g["use_muon"])
    return ledger, [int(total_over_ranks(n)) for n in ns], matrices, sum(1 for _ in net.parameters())


def check_bytes(mp_policy=None, modes=("adamw", "all-to-all", "owner-held")):
    """Bytes per step of each mode, all under fully_shard(mp_policy=mp_policy) (bf16: FSDP2's all-gathers
    and the held broadcasts carry bfloat16, the reduces float32)."""
    last = STEPS - 1
    figures, ledgers = {}, {}
    for mode in modes:
        ledger, ns, matrices, params = train_recorded(mode, mp_policy)
        ledgers[mode] = ledger
        figures[mode] = {phase: total_over_ranks(ledger.wire((phase, last))) for phase in ("forward", "backward", "step")}
        if mode != "adamw":
            check(all(n == matrices for n in ns), f"{mode}: Newton–Schulz ran on {ns} matrices per step, not {matrices}")
    whole = {mode: sum(f.values()) for mode, f in figures.items()}
    ratio = whole["owner-held"] / whole["adamw"] if whole["adamw"] else 1.0
    kind = "" if mp_policy is None else " (bf16 policy)"
    if WORLD > 1:
        check(ratio <= RATIO_LIMIT, f"owner-held{kind} moves {ratio:.3f}× AdamW + FSDP2's bytes per step "
              f"(limit {RATIO_LIMIT})")
    in_step = [r for r in ledgers["owner-held"].records if r["label"] == ("step", last)]
    if WORLD > 1:
        expected = (1 + WORLD + 2 * params) * 8
        check(len(in_step) == 1 and in_step[0]["op"] == "all_reduce" and in_step[0]["payload"] == expected,
              f"owner-held step() issued {[(r['op'], r['payload']) for r in in_step]}, not one all_reduce of "
              f"{expected} bytes")
        check(all(r["async_op"] for r in ledgers["owner-held"].records
                  if r["op"] in ("broadcast", "reduce") and r["label"][0] in ("forward", "backward")),
              "owner-held: a broadcast or reduce was not asynchronous")
    else:
        check(not in_step, f"owner-held step() at 1 rank issued {in_step}")
    return figures, whole, ratio


# ---- overlap: when the hooks post their collectives ----

def label_buffers(ledger, schedule):
    """Labels each HeldBuffer collective with its unit while `ledger` records (patches HeldBuffer)."""
    unit_of = {id(b): u.index for u in schedule.units for b in u.buckets}
    originals = {name: getattr(HeldBuffer, name) for name in ("broadcast_in_replica", "reduce_in_replica")}

    def labelled(name, original):
        def call(self, *args):
            saved = ledger.label
            ledger.label = (name, unit_of[id(self)])
            try:
                return original(self, *args)
            finally:
                ledger.label = saved
        return call
    for name, original in originals.items():
        setattr(HeldBuffer, name, labelled(name, original))
    return originals


def noted(hook, ledger, event):
    def run(working):
        hook(working)
        ledger.note(event)
    return run


def check_overlap(checkpointing):
    label = f"overlap{' with checkpointing' if checkpointing else ''}"
    net, opt, held = build("owner-held", checkpointing=checkpointing)
    schedule = held._schedule
    ledger = Ledger()
    blocks = list(net.blocks)
    for i, block in enumerate(blocks):
        block.register_forward_hook(lambda m, a, o, i=i: ledger.note(("forward end", i)))
        unit = next(u for u in schedule.units if u.module is block)
        for bucket in unit.buckets:  # each working gradient accumulated: after the schedule's own hook
            bucket.on_gradient = noted(bucket.on_gradient, ledger, ("gradient", i))
    originals = label_buffers(ledger, schedule)
    try:
        with recording(ledger):
            for tokens in global_batches(2, BATCH):
                ledger.records.clear()
                loss_of(net, rank_slice(tokens, RANK, WORLD)).backward()
                opt.step()
                opt.zero_grad()
                events = [(r["op"], r["label"]) for r in ledger.records if r["label"] is not None]
                check_order(label, events, len(blocks))
    finally:
        for name, original in originals.items():
            setattr(HeldBuffer, name, original)


def check_order(label, events, blocks):
    def first(pred):
        return next((k for k, e in enumerate(events) if pred(e)), None)

    def last(pred):
        return max((k for k, e in enumerate(events) if pred(e)), default=None)

    for i in range(blocks - 1):
        prefetch = first(lambda e: e == ("broadcast", ("broadcast_in_replica", i + 1)))
        end = first(lambda e: e == ("event", ("forward end", i)))
        check(prefetch is not None and end is not None and prefetch < end,
              f"{label}: block {i + 1}'s broadcast (event {prefetch}) is not posted before block {i}'s forward "
              f"ends (event {end}): {events}")
    for i in range(1, blocks):
        reduce = first(lambda e: e == ("reduce", ("reduce_in_replica", i)))
        below_done = last(lambda e: e == ("event", ("gradient", i - 1)))
        check(reduce is not None and below_done is not None and reduce < below_done,
              f"{label}: block {i}'s gradient reduce (event {reduce}) is not posted before block {i - 1}'s backward "
              f"ends (event {below_done}): {events}")


def report(kind, figures, whole):
    if RANK == 0:
        for mode, f in figures.items():
            parts = ", ".join(f"{phase} {int(b)}" for phase, b in f.items())
            print(f"torch_owner_held_ledger_test np {WORLD}{kind}: {mode}: wire bytes per step {int(whole[mode])} "
                  f"({parts}); {whole[mode] / whole['adamw'] if whole['adamw'] else 1.0:.3f}× AdamW + FSDP2", flush=True)


def main():
    figures, whole, ratio = check_bytes()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    figures_bf16, whole_bf16, ratio_bf16 = check_bytes(bf16, ("adamw", "owner-held"))
    if WORLD > 1:
        check_overlap(None)
        check_overlap("non-reentrant")
    report("", figures, whole)
    report(" bf16", figures_bf16, whole_bf16)
    return finish(f"torch_owner_held_ledger_test np {WORLD}: owner-held / AdamW + FSDP2 = {ratio:.3f}, with a "
                  f"bf16 policy {ratio_bf16:.3f}")


if __name__ == "__main__":
    RANK, WORLD = init_process_group("gloo")
    torch.manual_seed(0)
    exit_rank(main())
