"""dmuon.torch.DMuon's collective conventions at N ranks (gloo; torch_conventions_test.py has the rest):
  add_param_group   replicated and sharded parameters added after 3 of 10 steps are updated from
                    the next step (each tensor within 1e-5 of the float64 reference), their owners
                    planned and the same on every rank
  mismatch          an add_param_group whose parameters differ across ranks, or that is bad on one
                    rank only, raises the same ValueError on every rank and leaves the optimizer as it was
  no gradients      step() with no gradient on any rank changes nothing and counts nothing
  requires_grad     a Muon matrix that requires grad on some ranks only: step() raises the same
                    ValueError naming it on every rank (its all-to-alls would not match), nothing changes
  state dict        under FSDP2, the state_dict() of DMuon over named parameters, loaded into one over
                    the same parameters unnamed (and back), resumes bit for bit (torch.optim loads by position)
  deepcopy          copy.deepcopy((model, optimizer)) over replicated and Sharded parameters: the copy
                    steps collectively, bit for bit as the original

Run: torchrun --standalone --nproc_per_node N tests/python/torch_conventions_ranks_test.py (N = 1..4),
with PYTHONPATH=build/python and one BLAS thread per rank.
"""

import copy
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon.torch import DMuon
from muon_reference import Reference, hyper_of
from hand_sharded_model import SPECS, STEPS, TOLERANCE, Holder, Model, gradients, initial_values
from rank_exit import exit_rank
from rank_checks import check, finish

FIRST = ["layers.0.attn.weight", "odd.weight", "norm.weight", "embed.weight"]
LATE = [n for n, _ in SPECS if n not in FIRST]          # added by add_param_group after ADD_AT steps
SHARDED = ["odd.weight", "layers.1.attn.weight", "tiny.weight", "conv.weight", "layers.0.mlp.up.bias"]
# Names that route as their shapes do (no embedding, head or expert stack), so that the parameters
# unnamed give DMuon the same groups and matrices.
PLAIN = ["layers.0.attn.weight", "odd.weight", "tiny.weight", "conv.weight", "norm.weight", "layers.0.mlp.up.bias"]
ADD_AT = 3

def gathered(value):
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def check_add_param_group():
    model = Model(initial_values(), SHARDED)
    opt = DMuon(model.named(FIRST), balancer="lpt", ns_dtype="float32")
    ref = Reference({n: v.clone() for n, v in initial_values().items()}, {})
    for step in range(STEPS):
        if step == ADD_AT:
            opt.add_param_group({"params": model.named(LATE), "lr": 0.01, "adamw_lr": 1e-3})
            late_muon = [n for g in opt.param_groups[2:] if g["use_muon"] for n in g["param_names"]]
            owned = {name.split("[")[0] for name in opt.owners}  # an expert stack's matrices are name[e]
            check(sorted(late_muon + ["layers.0.attn.weight", "odd.weight"]) == sorted(owned),
                  f"add_param_group: owners {opt.owners}")
            check(all(0 <= r < dist.get_world_size() for r in opt.owners.values()), f"owners {opt.owners}")
            owners = gathered(opt.owners)
            check(all(o == owners[0] for o in owners), f"add_param_group: owners differ across ranks: {owners}")
        live = FIRST + (LATE if step >= ADD_AT else [])
        grads = gradients(step)
        ref.hyper = hyper_of(opt)
        ref.step({n: grads[n] for n in live})
        model.set_grads(grads)
        opt.step()
    worst = 0.0
    for name, _ in SPECS:
        err = float((model.full(name).double() - ref.w[name]).norm() / ref.w[name].norm())
        worst = max(worst, err)
        check(err <= TOLERANCE, f"add_param_group: {name} relative error {err:.2e} > {TOLERANCE:.0e}")
    return worst


def expect_same_error(label, opt, group, *needles):
    """add_param_group(group) raises a ValueError with the same message on every rank, naming
    needles, and the optimizer keeps its parameters and still steps collectively."""
    names = list(opt.param_groups_names)
    message = None
    try:
        opt.add_param_group(group)
    except ValueError as e:
        message = str(e)
    messages = gathered(message)
    check(message is not None and all(m == messages[0] for m in messages), f"{label}: messages {messages}")
    check(message is not None and all(n in message for n in needles), f"{label}: {message!r} lacks {needles}")
    check(opt.param_groups_names == names, f"{label}: the optimizer changed: {opt.param_groups_names}")


def check_mismatch():
    rank, world = dist.get_rank(), dist.get_world_size()
    p = torch.nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(3)))
    opt = DMuon([("a.weight", p)], ns_dtype="float32")
    last = world - 1
    if world > 1:
        shape = (5, 4) if rank == last else (4, 4)
        expect_same_error("shapes differ", opt, {"params": [("b.weight", torch.nn.Parameter(torch.zeros(shape)))]},
                          "differ across ranks", f"rank {last}")
    lr = -1.0 if rank == last else 0.01
    expect_same_error("bad lr on one rank", opt, {"params": [("b.weight", torch.nn.Parameter(torch.zeros(4, 4)))],
                                                  "lr": lr}, "Invalid learning rate: -1.0", f"rank {last}")
    p.grad = torch.ones_like(p)
    opt.step()
    check(opt.updates == 1, f"after the failed add_param_group: {opt.updates} updates")


def check_no_gradients():
    model = Model(initial_values(), SHARDED)
    opt = DMuon(model.named(), ns_dtype="float32")
    model.set_grads(gradients(0))
    opt.step()
    opt.zero_grad()
    before = {n: p.detach().clone() for n, p in model.params.items()}
    state = {n: {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
             for n, p in model.params.items()}
    opt.step()
    check(opt.updates == 1, f"no gradients: {opt.updates} updates after one step with gradients")
    for n, p in model.params.items():
        check(torch.equal(p, before[n]), f"no gradients: {n} changed")
        check(all(torch.equal(v, opt.state[p][k]) for k, v in state[n].items()), f"no gradients: {n}'s state changed")


def check_requires_grad_differs():
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return
    model = Model(initial_values(), SHARDED)
    opt = DMuon(model.named(), ns_dtype="float32")
    model.set_grads(gradients(0))
    model.params["layers.0.attn.weight"].requires_grad_(rank != world - 1)
    before = {n: p.detach().clone() for n, p in model.params.items()}
    message = None
    try:
        opt.step()
    except ValueError as e:
        message = str(e)
    messages = gathered(message)
    check(message is not None and all(m == messages[0] for m in messages), f"requires_grad: messages {messages}")
    check(message is not None and "'layers.0.attn.weight' requires grad on" in message, f"requires_grad: {message!r}")
    check(all(torch.equal(p, before[n]) for n, p in model.params.items()), "requires_grad: a parameter changed")


def check_state_dict_named_and_unnamed():
    """Under FSDP2: 3 steps, state_dict(), load into an optimizer over the same parameters with the
    other naming, 3 more steps on both: every local shard bit-identical."""
    def holder():
        model = Holder(initial_values(), PLAIN)
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        return model

    def build(model, named):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="DMuon: parameters without names")
            return DMuon(model.named() if named else [p for _, p in model.named()], balancer="lpt", ns_dtype="float32")

    for saved_named in (True, False):
        label = f"state dict {'named → unnamed' if saved_named else 'unnamed → named'}"
        model, twin = holder(), holder()
        opt = build(model, saved_named)
        for step in range(3):
            model.train_step(opt, step)
        loaded = build(twin, not saved_named)
        twin.load_state_dict(model.state_dict())
        loaded.load_state_dict(opt.state_dict())
        for step in range(3, 6):
            model.train_step(opt, step)
            twin.train_step(loaded, step)
        for (name, p), (_, q) in zip(model.named(), twin.named()):
            check(torch.equal(p.to_local(), q.to_local()), f"{label}: {name} differs")
        check("param_names" in loaded.param_groups[0], f"{label}: param_names {loaded.param_groups[0].keys()}")


def check_deepcopy():
    """copy.deepcopy((model, optimizer)) after 3 steps; 3 more steps on both, bit-identical."""
    model = Model(initial_values(), SHARDED)
    opt = DMuon(model.named(), balancer="lpt", ns_dtype="float32")
    for step in range(3):
        model.set_grads(gradients(step))
        opt.step()
    model_copy, opt_copy = copy.deepcopy((model, opt))
    check(opt_copy.owners == opt.owners and opt_copy.comm is opt.comm, "deepcopy: owners or group differ")
    for step in range(3, 6):
        for m, o in ((model, opt), (model_copy, opt_copy)):
            m.set_grads(gradients(step))
            o.step()
    for name in model.params:
        check(torch.equal(model.params[name], model_copy.params[name]), f"deepcopy: {name} differs")
    check(opt_copy.updates == opt.updates == 6, f"deepcopy: {opt_copy.updates} and {opt.updates} updates")


def main():
    torch.manual_seed(0)
    worst = check_add_param_group()
    check_mismatch()
    check_no_gradients()
    check_requires_grad_differs()
    check_state_dict_named_and_unnamed()
    check_deepcopy()
    return finish(f"torch_conventions_ranks_test np {dist.get_world_size()}: add_param_group worst relative error "
                  f"{worst:.1e}")


if __name__ == "__main__":
    dist.init_process_group("gloo")
    exit_rank(main())
