"""Muon's options per param group at N ranks (gloo), in both modes: all-to-all after the fact (every
block under fully_shard) and owner-centric (hold_on_owners, then fully_shard of the rest). The model of
torch_owner_held_test.py trains 10 steps with param groups of Muon options:
  blocks.0   scale="spectral", ns_steps=4, cautious_wd=True
  blocks.1   scale="unit_rms", extra_scale_factor=0.1, algo="gram"
  blocks.2   split Newton–Schulz: mix (12×12) and the experts (3 of 12×12) in 4 heads of 3 rows, up (20×12)
             in row blocks of 8 and 12, down (12×20) in 2 heads of 10 columns (no divisibility by the
             world size: 4, 3 and 2 blocks at 3 ranks); the experts, up and down with NorMuon (per block)
  blocks.3   the constructor's options (match_rms_adamw, 5 steps, no cautious weight decay)
  blocks.4   NorMuon with normuon_beta2=0.9 (its v's rows sharded unevenly at 3-4 ranks)
and AdamW for the rest. Owners by the lpt balancer: DMuon's (all-to-all) and hold_on_owners's (given the split by
split_of) are dmuon.plan_owners's with blocks.2's matrices costed as their blocks (SPLIT_BLOCKS, by hand), which
differ from those of the matrices costed whole. Every tensor must be within 1e-5 (relative Frobenius) of the float64 reference
(torch_dmuon_mpi_test.Reference, which applies each group's options by their definitions) and of the
other mode; a bucket holds matrices of one options value only. NorMuon's v is sharded as the parameter's rows
under fully_shard (on the owner under hold_on_owners), and a torch.distributed.checkpoint save at step 5 resumes
the run bit for bit (weights and state, v included) in both modes.
QK-clip from step 1 on, three attentions: blocks.1.mix as 4 query heads (3 rows each: under fully_shard at 3-4 ranks
a shard cuts heads), blocks.3.mix as their 2 key heads, blocks.1.up.bias as the queries' bias (5 rows a head,
AdamW's); blocks.0.up (and its bias) as a fused qkv of 2 query heads and 1 key-value head of 5 rows; blocks.4.mix
and blocks.4.up as a latent attention's q (2 heads of 4 + 2 rows) and kv (2 heads of 4 + 6 rows). Every rank reports
its own maxima (the largest are the last rank's): the float64 reference rescales by Kimi K2's rules
(muon_reference's qk_clip_ref, fused_qk_clip_ref, latent_qk_clip_ref) after its step, and the step with QK-clip calls
the collectives of the step without it (collective_ledger.py: the same calls, the all-reduce longer by the maxima's
slots).
A step that raises changes nothing (issue 58): before the checkpoint, one failure at a time is injected into a step
of its own (FAILURES: a non-finite gradient of an AdamW parameter, a Muon matrix, a NorMuon one, a split one, an
expert stack; a maximum QK-clip cannot take in each attention kind; a NaN lr), and every rank's step() must raise it
with every weight and state tensor here as before, bit for bit.

Run: torchrun --standalone --nproc_per_node N tests/python/torch_muon_options_ranks_test.py (N = 1..4),
with PYTHONPATH=build/python:tests/python and one BLAS thread per rank.
"""

import os
import shutil
import tempfile

import torch
import torch.distributed as dist

import dmuon
from torch.distributed.tensor import DTensor

import owner_held_runs as runs
from collective_ledger import Ledger, recording
from dmuon.torch import Attention, DMuon, FusedAttention, LatentAttention, QKClip, hold_on_owners
from dmuon.torch.mpirun import init_process_group
from dmuon.torch.params import module_groups
from owner_held_model import DIM, EXPERTS, global_batches, loss_of, make_net, rank_slice
from rank_checks import check, finish, total_over_ranks
from muon_reference import fused_qk_clip_ref, latent_qk_clip_ref, qk_clip_ref
from rank_exit import exit_rank
from dcp_io import load, save  # get_state_dict + dcp.save; dcp.load + set_state_dict

NET = dict(layers=5)
SAVED_AT = 5
QK = Attention(q="blocks.1.mix.weight", k="blocks.3.mix.weight", heads=4, kv_heads=2, q_bias="blocks.1.up.bias")
FUSED = FusedAttention(qkv="blocks.0.up.weight", heads=2, kv_heads=1, bias="blocks.0.up.bias")
LATENT = LatentAttention(q="blocks.4.mix.weight", kv="blocks.4.up.weight", heads=2, qk_nope_head_dim=4,
                         qk_rope_head_dim=2, v_head_dim=6)
ATTENTIONS = [QK, FUSED, LATENT]
HEADS = sum(a.heads for a in ATTENTIONS)
TAU = 1.0
# (name prefix, options): a Muon matrix takes the first whose prefix its name starts with.
OPTIONS = [("blocks.0.", dict(scale="spectral", ns_steps=4, cautious_wd=True)),
           ("blocks.1.", dict(scale="unit_rms", extra_scale_factor=0.1, algo="gram")),
           ("blocks.2.mix", dict(split_heads=4)),
           ("blocks.2.experts", dict(split_heads=4, variant="normuon")),
           ("blocks.2.up", dict(split_sizes=[8, 12], variant="normuon")),
           ("blocks.2.down", dict(split_heads=2, split_dim=1, variant="normuon")),
           ("blocks.3.", dict()),
           ("blocks.4.", dict(variant="normuon", normuon_beta2=0.9))]
# The (rows, cols) of the blocks OPTIONS splits blocks.2's matrices in: what the owner planner costs them as.
SPLIT_BLOCKS = {"blocks.2.mix.weight": [(3, 12)] * 4, "blocks.2.up.weight": [(8, 12), (12, 12)],
                "blocks.2.down.weight": [(12, 10)] * 2, "blocks.2.experts": [(3, 12)] * 4 * EXPERTS}


def split_of(name, p):
    """hold_on_owners's split: the split options OPTIONS gives a Muon parameter (None: none)."""
    options = {k: v for k, v in next(o for q, o in OPTIONS if name.startswith(q)).items() if k.startswith("split")}
    return options or None


def check_planned_owners(mode, owners, planned):
    """owners (name → owner) are lpt's with the split matrices costed as their blocks (planned: [(name, (rows,
    cols))], in the order DMuon or hold_on_owners plans them), and other than lpt's with every matrix costed whole."""
    if dist.get_world_size() == 1:
        return  # one rank owns everything, unplanned
    shapes = [shape for _, shape in planned]
    want = dmuon.plan_owners(shapes, dist.get_world_size(), balancer="lpt",
                             blocks=[SPLIT_BLOCKS.get(n) for n, _ in planned])[0]
    got = [owners[n] for n, _ in planned]
    check(got == want, f"{mode}: owners {got}, the block-costed plan's {want}")
    check(want != dmuon.plan_owners(shapes, dist.get_world_size(), balancer="lpt")[0],
          f"{mode}: the plan of the matrices costed whole is the block-costed one")


def build(hold):
    """(model, its parameters' module, optimizer), owners planned by lpt (checked)."""
    mesh = runs.mesh_of("fsdp2")
    net = make_net(**NET)
    if hold:  # the stacks (E, D, D) costed as (D, E·D)
        planned = [(n, (DIM, EXPERTS * DIM) if p.dim() == 3 else tuple(p.shape))
                   for g in module_groups(net) if g["use_muon"] for n, p in g["params"]]
        held = hold_on_owners(net, mesh, balancer="lpt", split=split_of)
        check_planned_owners("owner-centric", held.owners, planned)
    else:
        held = None
    model = runs.wrap(net, mesh, held)
    opt = DMuon(runs.groups_of(net, OPTIONS), balancer="lpt", **runs.HYPER)
    if not hold:  # the experts are pinned to the ranks holding them whole
        check_planned_owners("all-to-all", opt.owners,
                             [(k.name, (k.rows, k.cols)) for k in opt._matrices if k.expert is None])
    return model, net, opt


def maxima(step, rank):
    """The maximum logits rank `rank` reports at `step`, one tensor per attention of ATTENTIONS: some above TAU, the
    last rank's the largest."""
    gen = torch.Generator().manual_seed(300 + step)
    return (TAU * (0.4 + 1.2 * torch.rand(HEADS, generator=gen)) + 0.05 * rank).split([a.heads for a in ATTENTIONS])


def steps(model, opt, which, clip, ledger=None):
    """Trains `which` steps; with a QKClip, this rank's maxima reported before each step; a ledger labels the
    collectives of opt.step() "step"."""
    batches = global_batches(runs.STEPS, runs.BATCH)
    for step in which:
        loss_of(model, rank_slice(batches[step], dist.get_rank(), dist.get_world_size())).backward()
        if clip is not None:
            for i, m in enumerate(maxima(step, dist.get_rank())):
                clip.report(i, m)
        if ledger is not None:
            ledger.label = "step"
        opt.step()
        if ledger is not None:
            ledger.label = None
        opt.zero_grad()


def qk_clip_reference(step, w):
    """After the reference's step: QK-clip with the job's maxima (the largest of every rank's)."""
    if step == 0:
        return
    qk, fused, latent = (m.double() for m in maxima(step, dist.get_world_size() - 1))
    w[QK.q], w[QK.k] = qk_clip_ref(w[QK.q], w[QK.k], qk, TAU, QK.kv_heads)
    w[QK.q_bias] = qk_clip_ref(w[QK.q_bias][:, None], torch.zeros(QK.kv_heads, 1), qk, TAU, QK.kv_heads)[0][:, 0]
    w[FUSED.qkv] = fused_qk_clip_ref(w[FUSED.qkv], fused, TAU, FUSED.kv_heads, FUSED.layout)
    w[FUSED.bias] = fused_qk_clip_ref(w[FUSED.bias][:, None], fused, TAU, FUSED.kv_heads, FUSED.layout)[:, 0]
    w[LATENT.q], w[LATENT.kv] = latent_qk_clip_ref(w[LATENT.q], w[LATENT.kv], latent, TAU, LATENT.qk_nope_head_dim,
                                                   LATENT.qk_rope_head_dim, LATENT.v_head_dim)


# Failures injected into one step each, after its backward, every rank's step() then raising with every tensor as it
# was (issue 58): (what, where it strikes, the injection (model, opt, clip) on this rank, the exception, a needle of
# its message). Each strikes another phase of the step: AdamW; a travelling bucket's momentum, Newton–Schulz and
# apply (all-to-all) or an owner-held one's; NorMuon's v; split blocks; an expert stack; QK-clip's rescale of each
# attention kind (maxima it cannot take: inf, NaN, 1e300 whose γ underflows float32); the host's check of a group's
# hyper-parameters.
def poison_grad(name):
    def inject(net, opt, clip):
        if opt._layouts[opt.param_groups_names.index(name)].held_elsewhere:
            return  # its gradient is on its owner
        grad = dict(net.named_parameters())[name].grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if local is not None and local.numel():
            local.view(-1)[local.numel() // 2] = float("nan")
    return inject


def poison_maximum(attention, head, value):
    def inject(net, opt, clip):
        if dist.get_rank() == dist.get_world_size() - 1:
            clip.report(attention, torch.tensor([value], dtype=torch.float64), heads=[head])
    return inject


def poison_group(key, value):
    def inject(net, opt, clip):
        next(g for g in opt.param_groups if g["use_muon"])[key] = value
    return inject


FAILURES = [
    ("non-finite gradient", "AdamW", poison_grad("blocks.1.up.bias"), FloatingPointError, "'blocks.1.up.bias' on rank"),
    ("non-finite gradient", "Muon", poison_grad("blocks.3.mix.weight"), FloatingPointError, "'blocks.3.mix.weight'"),
    ("non-finite gradient", "NorMuon", poison_grad("blocks.4.up.weight"), FloatingPointError, "'blocks.4.up.weight'"),
    ("non-finite gradient", "split", poison_grad("blocks.2.down.weight"), FloatingPointError, "'blocks.2.down.weight'"),
    ("non-finite gradient", "experts", poison_grad("blocks.2.experts"), FloatingPointError, "'blocks.2.experts'"),
    ("maximum inf", "QK-clip", poison_maximum(0, 3, float("inf")), FloatingPointError,
     "attention 'blocks.1.mix.weight' (layer 1) query head 3: inf"),
    ("maximum NaN", "QK-clip fused", poison_maximum(1, 0, float("nan")), FloatingPointError,
     "attention 'blocks.0.up.weight' (layer 0) query head 0: nan"),
    ("maximum 1e300", "QK-clip latent", poison_maximum(2, 1, 1e300), FloatingPointError,
     "attention 'blocks.4.mix.weight' (layer 4) query head 1: 1e+300"),
    ("lr NaN", "checks", poison_group("lr", float("nan")), ValueError, "Invalid learning rate: nan"),
]


def check_failures_change_nothing(mode, model, net, opt, clip, step):
    """Each of FAILURES in a step of its own (this rank's batch of `step`, maxima that clip some heads): every rank
    raises its exception, and every tensor here is as before the call, bit for bit."""
    batches = global_batches(runs.STEPS, runs.BATCH)
    for what, phase, inject, exception, needle in FAILURES:
        groups = [dict(g) for g in opt.param_groups]
        loss_of(model, rank_slice(batches[step], dist.get_rank(), dist.get_world_size())).backward()
        for i, m in enumerate(maxima(step, dist.get_rank())):
            clip.report(i, m)
        inject(net, opt, clip)
        before = runs.local_values(net, opt)
        try:
            opt.step()
            raised = None
        except Exception as e:  # noqa: BLE001 — which one is checked
            raised = e
        check(isinstance(raised, exception) and needle in str(raised),
              f"{mode}: {what} in {phase}: step() gave {raised!r}, not {exception.__name__} with {needle!r}")
        after = runs.local_values(net, opt)
        changed = [k for k, v in before.items() if not torch.equal(v, after[k])]
        check(not changed, f"{mode}: {what} in {phase}: the step that raised changed {len(changed)} tensors: "
              f"{changed[:4]}...")
        for g, saved in zip(opt.param_groups, groups):
            g.update(saved)
        opt.zero_grad()


def calls(ledger):
    return [(r["op"], r["group_size"]) for r in ledger.records if r["label"] == "step"]


def train(hold, folder):
    """(full weights after the steps, the optimizer): saved at step SAVED_AT into folder, then resumed from it."""
    mode = ("all-to-all", "owner-centric")[hold]
    model, net, opt = build(hold)
    without, with_clip = Ledger(), Ledger()
    with recording(without):
        steps(model, opt, [0], None, without)
    clip = QKClip(opt, TAU, ATTENTIONS)
    with recording(with_clip):
        steps(model, opt, [1], clip, with_clip)
    check(calls(with_clip) == calls(without), f"{mode}: the step with QK-clip calls {calls(with_clip)}, without it "
          f"{calls(without)}")
    longer = sum(r["payload"] for r in with_clip.records if r["label"] == "step" and r["op"] == "all_reduce") - sum(
        r["payload"] for r in without.records if r["label"] == "step" and r["op"] == "all_reduce")
    check(dist.get_world_size() == 1 or longer == 8 * HEADS * dist.get_world_size(),
          f"{mode}: QK-clip lengthens the step's all-reduces by {longer} bytes")
    steps(model, opt, range(2, SAVED_AT), clip)
    check_failures_change_nothing(mode, model, net, opt, clip, SAVED_AT)
    save(model, opt, folder)
    steps(model, opt, range(SAVED_AT, runs.STEPS), clip)
    straight = runs.local_values(net, opt)
    laid_out = total_over_ranks(check_variance_layout(mode, net, opt))
    normuon = sum(len(g["params"]) for g in runs.groups_of(net, OPTIONS) if g.get("variant") == "normuon")  # 7
    expected = normuon if hold else normuon * dist.get_world_size()
    check(laid_out == expected, f"{mode}: {laid_out} NorMuon v's over the ranks, expected {expected}")
    resumed_model, resumed_net, resumed = build(hold)
    with torch.no_grad():
        for p in resumed_net.parameters():
            p.zero_()  # the load must write every value
    load(resumed_model, resumed, folder)
    steps(resumed_model, resumed, range(SAVED_AT, runs.STEPS), QKClip(resumed, TAU, ATTENTIONS))
    again = runs.local_values(resumed_net, resumed)
    check(again.keys() == straight.keys(), f"{mode}: the resumed run holds other tensors here")
    differ = [k for k, v in straight.items() if not torch.equal(v, again.get(k, v.new_empty(0)))]
    check(not differ, f"{mode}: not bit-identical after resuming from the checkpoint at step {SAVED_AT}: {differ}")
    return runs.full_weights(net), opt


def check_variance_layout(mode, net, opt):
    """NorMuon's v has the parameter's rows here: a DTensor sharded as the parameter's rows under fully_shard, a
    tensor on the owner alone under hold_on_owners. Returns how many this rank holds."""
    count = 0
    for name, p in net.named_parameters():
        v = opt.state[p].get("variance_neuron")
        if v is None:
            continue
        count += 1
        rows = 2 if p.dim() == 3 else 1
        if isinstance(p, DTensor):
            check(isinstance(v, DTensor) and v.placements == p.placements and
                  v.to_local().shape[:rows] == p.to_local().shape[:rows], f"{mode}: {name}'s v is not laid out as its rows")
        else:
            check(p._dmuon_held.owner == dist.get_rank() and v.shape[:rows] == p.shape[:rows],
                  f"{mode}: {name}'s v is not on its owner")
    return count


def main():
    folder = [tempfile.mkdtemp(prefix="dmuon_options_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    results = {mode: train(mode == "owner-centric", os.path.join(folder[0], mode))
               for mode in ("all-to-all", "owner-centric")}
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0])
    ref_w, _ = runs.reference_run({"net": NET}, runs.hyper_of(results["all-to-all"][1]), qk_clip_reference)
    worst = 0.0
    for mode, (weights, opt) in results.items():
        for bucket in opt._buckets:
            check(len({k.options for k in bucket}) == 1, f"{mode}: a bucket mixes options: {[k.name for k in bucket]}")
        for name, w in weights.items():
            to_ref = runs.relative(w, ref_w[name])
            to_other = runs.relative(w, results["all-to-all"][0][name])
            worst = max(worst, to_ref, to_other)
            check(to_ref <= runs.TOLERANCE, f"{mode}: {name} relative error {to_ref:.2e} to the float64 reference")
            check(to_other <= runs.TOLERANCE, f"{mode}: {name} relative difference {to_other:.2e} to all-to-all")
    return finish(f"torch_muon_options_ranks_test np {dist.get_world_size()}: worst relative difference {worst:.1e}")


if __name__ == "__main__":
    init_process_group("gloo")
    torch.manual_seed(0)
    exit_rank(main())
