"""Optimizer state in bfloat16 (DMuon's state_dtype per param group, issue 59) at N ranks (gloo), in both modes
(all-to-all under fully_shard; owner-held: hold_on_owners, then fully_shard of the rest) and on both engines
(libdmuon_c, torch ops). The model of torch_owner_held_test.py (3 blocks) trains STEPS steps of Muon + AdamW with
clipping, its param groups:
  blocks.0   NorMuon, state_dtype "bfloat16" (a string)   its momentum and per-row v in bfloat16
  blocks.1   Muon, the constructor's state_dtype=torch.bfloat16
  blocks.2   Muon, state_dtype=torch.float32 (a group of float32 state beside them)
  the rest   AdamW, the constructor's bfloat16: exp_avg, exp_avg_sq in bfloat16
Each step is checked against the float64 reference (muon_reference.Reference) with its rounding rule (each state
value rounded to bfloat16, nearest even, where it is stored; the math in float64 otherwise), started from DMuon's
own weights and state before that step (exactly theirs) on the global batch: the step's weights within TOLERANCE
(relative Frobenius) of the reference's; every state tensor in its group's dtype; the float32 group's state within
TOLERANCE; every bfloat16 state element the reference's stored one, except where the float32 and the float64 values
round apart (they lie within float32's rounding of a bfloat16 tie): each such element within one bfloat16 step of
the reference's, and at most FLIPPED of all the bfloat16 elements stored over the run. Step by step, since a
rounding apart is never undone afterwards (the run follows the bfloat16 recurrence, not float64's: whole runs part
by more than TOLERANCE after one).
A torch.distributed.checkpoint save at step SAVED_AT resumes the run bit for bit (weights and bfloat16 states) in
both modes (the libdmuon_c runs). Changing a group's state_dtype after the state exists converts its state (rounded):
by a loaded state dict's groups as it loads, by hand before the next step's first write; a bad state_dtype is
refused naming the group.

Run: PYTHONPATH=build/python:tests/python python tests/python/run_ranks.py --nproc N -- \
    tests/python/torch_bf16_states_test.py   (N = 1..4), one BLAS thread per rank.
"""

import copy
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import owner_held_runs as runs
from dcp_io import load, save  # get_state_dict + dcp.save; dcp.load + set_state_dict
from dmuon.torch import DMuon, hold_on_owners
from dmuon.torch.mpirun import init_process_group
from muon_reference import Reference, muon_matrices
from owner_held_model import global_batches, loss_of, make_net, rank_slice
from rank_checks import check, finish
from rank_exit import exit_rank

STEPS, SAVED_AT = 6, 3
TOLERANCE = runs.TOLERANCE  # 1e-5, the owner-held tests' float32 one
# The share of the bfloat16 state elements a step may store rounded the other way than the float64 reference: a
# float32 step's value lies within about 1e-7 to 1e-6 (relative) of the float64 one, a bfloat16 step is 2^-8, so
# about 3e-5 to 3e-4 of them lie that close to a rounding tie (measured: 1.6e-4 at 1 rank). Stored unrounded (float32
# values) nearly all of them would differ.
FLIPPED = 1e-3
GROUPS = [("blocks.0.", dict(variant="normuon", state_dtype="bfloat16")),
          ("blocks.1.", dict()),
          ("blocks.2.", dict(state_dtype=torch.float32))]
HYPER = dict(runs.HYPER, state_dtype=torch.bfloat16)


def build(hold, engine):
    mesh = runs.mesh_of("fsdp2")
    net = make_net()
    held = hold_on_owners(net, mesh) if hold else None
    model = runs.wrap(net, mesh, held)
    return model, net, DMuon(runs.groups_of(net, GROUPS), engine=engine, **HYPER)


def steps(model, opt, which):
    batches = global_batches(STEPS, runs.BATCH)
    for step in which:
        loss_of(model, rank_slice(batches[step], dist.get_rank(), dist.get_world_size())).backward()
        opt.step()
        opt.zero_grad()


def full_state(net, opt):
    """{(parameter name, state key): the full state tensor} on every rank (collective: a DTensor's full_tensor(), an
    owner-held matrix's state broadcast from its owner)."""
    out = {}
    for name, p in net.named_parameters():
        held = getattr(p, "_dmuon_held", None)
        if held is not None:
            entry = [opt.state[p] if held.owner == dist.get_rank() else None]
            dist.broadcast_object_list(entry, src=held.global_ranks[held.owner])
            entry = entry[0]
        else:
            entry = opt.state[p]
        for key, value in entry.items():
            if key != "step":
                out[name, key] = (value.full_tensor() if isinstance(value, DTensor) else value).clone()
    return out


def train(hold, engine, folder, reference):
    """Trains STEPS steps, each checked against the reference (`reference(step, weights, state, weights after,
    state after)`, full tensors); with a folder, saved at SAVED_AT and resumed from it by a new model and optimizer,
    which must end bit for bit as the unbroken run. Returns the optimizer."""
    label = f"{('all-to-all', 'owner-held')[hold]} {engine}"
    model, net, opt = build(hold, engine)
    before = runs.full_weights(net), full_state(net, opt)
    for step in range(STEPS):
        if step == SAVED_AT and folder is not None:
            save(model, opt, folder)
        steps(model, opt, [step])
        after = runs.full_weights(net), full_state(net, opt)
        reference(f"{label} step {step}", step, *before, *after)
        before = after
    if folder is not None:
        straight = runs.local_values(net, opt)
        resumed_model, resumed_net, resumed = build(hold, engine)
        load(resumed_model, resumed, folder)
        steps(resumed_model, resumed, range(SAVED_AT, STEPS))
        again = runs.local_values(resumed_net, resumed)
        differ = [k for k, v in straight.items() if not torch.equal(v, again.get(k, v.new_empty(0)))]
        check(again.keys() == straight.keys() and not differ,
              f"{label}: not bit for bit after resuming from the checkpoint at step {SAVED_AT}: {differ[:6]}")
    return opt


REF_KEYS = {"momentum_buffer": "m", "exp_avg": "m", "exp_avg_sq": "v"}


def reference_state(ref, name, key):
    """The reference's stored value of DMuon's state `key` of parameter `name`, shaped as DMuon's."""
    st = ref.state[name]
    if key == "variance_neuron":  # per matrix j of the parameter, its one block's v (rows,)
        w = ref.w[name]
        v = torch.stack([st["normuon_v"][j][0] for j in range(muon_matrices(w).shape[0])])
        return v.reshape(*w.shape[:-1], 1)
    return st[REF_KEYS[key]]


def reference_at(step, weights, state, hyper):
    """A Reference holding DMuon's weights and state before `step` (float64, exactly theirs)."""
    ref = Reference(weights, hyper, clip=runs.CLIP)
    for (name, key), value in state.items():
        st = ref.state[name]
        if key == "variance_neuron":
            rows = value.double().reshape(muon_matrices(ref.w[name]).shape[:2])  # (matrices, rows)
            st["normuon_v"] = {j: {0: v} for j, v in enumerate(rows)}
        else:
            st[REF_KEYS[key]] = value.double()
            st["t"] = step  # AdamW's step count before this step
    return ref


def checker(hyper, totals):
    """reference(label, step, weights, state, weights after, state after): one step of the float64 reference from
    DMuon's weights and state before it, on the global batch, and the step's weights and state against it (this
    module's text); totals["elements"], totals["flipped"] count the bfloat16 state elements compared and those that
    rounded the other way."""
    batches = global_batches(STEPS, runs.BATCH)

    def reference(label, step, weights, state, weights_after, state_after):
        ref = reference_at(step, weights, state, hyper)
        net = make_net(torch.float64)
        with torch.no_grad():
            for n, p in net.named_parameters():
                p.copy_(ref.w[n])
        loss_of(net, batches[step]).backward()
        ref.step({n: p.grad for n, p in net.named_parameters()})
        for name, w in weights_after.items():
            error = runs.relative(w, ref.w[name])
            totals["weights"] = max(totals["weights"], error)
            check(error <= TOLERANCE, f"{label}: {name} relative error {error:.2e} to the float64 reference")
        for (name, key), value in state_after.items():
            dtype = getattr(torch, hyper[name]["state_dtype"] or "float32")  # a group keeps its name (None: W's)
            check(value.dtype == dtype, f"{label}: {name} {key} is {value.dtype}, its group's state_dtype {dtype}")
            want, got = reference_state(ref, name, key), value.double()
            if dtype != torch.bfloat16:
                error = runs.relative(got, want)
                check(error <= TOLERANCE, f"{label}: {name} {key} relative error {error:.2e} to the reference")
                continue
            one_step = torch.ldexp(torch.ones_like(want), torch.frexp(want.abs().maximum(got.abs()))[1] - 8)
            totals["elements"] += want.numel()
            totals["flipped"] += int((got != want).sum())
            check(bool(((got - want).abs() <= one_step).all()),
                  f"{label}: {name} {key}: an element more than one bfloat16 step from the reference's stored one")
    return reference


def check_state_dtype_changes():
    """A group's state_dtype changed after its state exists: by a loaded state dict's groups, the state converted
    (rounded to nearest even) as it loads, and the saved values loaded in the new dtype (float32 ones unrounded); by
    hand, before the next step's first write. A bad value refused naming
    the group, at construction and at step()."""
    model, net, opt = build(False, "auto")
    steps(model, opt, range(1))
    index = next(i for i, g in enumerate(opt.param_groups) if g["use_muon"] and g["state_dtype"] == "float32")
    group = opt.param_groups[index]
    p = group["params"][0]
    before = opt.state[p]["momentum_buffer"].full_tensor()
    saved = opt.state_dict()
    as_saved = copy.deepcopy(saved)  # float32 state, its group's state_dtype float32 (saved's entries are the state's)
    saved["param_groups"][index] = {**saved["param_groups"][index], "state_dtype": "bfloat16"}
    opt.load_state_dict(saved)
    after = opt.state[p]["momentum_buffer"]
    check(group["state_dtype"] == "bfloat16" and after.dtype == torch.bfloat16
          and torch.equal(after.full_tensor(), before.bfloat16()),
          f"a loaded group's state_dtype bfloat16: the momentum is {after.dtype}, not rounded from float32")
    opt.load_state_dict(as_saved)  # float32 values and group into the bfloat16 state: loaded as float32, unrounded
    after = opt.state[p]["momentum_buffer"]
    check(group["state_dtype"] == "float32" and after.dtype == torch.float32
          and torch.equal(after.full_tensor(), before),
          f"a loaded group's state_dtype float32 over bfloat16 state: the momentum is {after.dtype}, not the saved one")
    group["state_dtype"] = torch.bfloat16
    steps(model, opt, range(1, 2))
    check(opt.state[p]["momentum_buffer"].dtype == torch.bfloat16, "state_dtype set by hand: not converted by step()")
    group["state_dtype"] = torch.float16
    try:
        steps(model, opt, range(2, 3))
        check(False, "state_dtype=torch.float16 in a group taken by step()")
    except ValueError as e:
        check("param group of 'blocks.2." in str(e) and "state_dtype" in str(e), f"the refusal names no group: {e}")
    try:
        DMuon([{"params": [("w", torch.nn.Parameter(torch.zeros(4, 4)))], "state_dtype": "float16"}])
        check(False, "state_dtype='float16' in a group taken at construction")
    except ValueError as e:
        check("param group of 'w'" in str(e) and "state_dtype" in str(e), f"the refusal names no group: {e}")


def main():
    folder = [tempfile.mkdtemp(prefix="dmuon_bf16_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    hyper = runs.hyper_of(build(False, "auto")[2])
    totals = dict(weights=0.0, elements=0, flipped=0)
    reference = checker(hyper, totals)
    for hold in (False, True):
        for engine in ("dmuon", "torch"):
            train(hold, engine, os.path.join(folder[0], f"{hold}") if engine == "dmuon" else None, reference)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder[0])
    share = totals["flipped"] / max(totals["elements"], 1)
    check(share <= FLIPPED, f"{share:.3%} of the bfloat16 state elements rounded otherwise than the float64 "
          f"reference's ({totals['flipped']} of {totals['elements']}; at most {FLIPPED:.1%})")
    check_state_dtype_changes()
    return finish(f"torch_bf16_states_test np {dist.get_world_size()}: each step's weights within "
                  f"{totals['weights']:.1e} of the float64 reference's step from the same weights and bfloat16 "
                  f"state; {totals['flipped']} of {totals['elements']} bfloat16 state elements rounded the other way")


if __name__ == "__main__":
    init_process_group("gloo")
    torch.manual_seed(0)
    exit_rank(main())
