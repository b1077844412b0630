"""Owner-held matrices and their state through torch.distributed.checkpoint (DCP), at world sizes that
change. Each held matrix and its momentum live on its owner only: model.state_dict() and
DMuon.state_dict() list them there, so DCP writes each once, and a load at another world size
(owners planned anew) reads each matrix and its momentum onto its new owner.

One script, two roles, each a separate torchrun (or mpirun) launch on gloo:

  torch_owner_held_dcp_test.py save DIR [hsdp]   (at N ranks; hsdp: a (2, N/2) mesh)
      trains owner_held_model.Net under hold_on_owners + fully_shard 5 steps, saves model and
      optimizer into DIR/step5 (get_state_dict + dcp.save), trains on to step 10 (the uninterrupted
      run; its full weights go to DIR/final.pt), then loads DIR/step5 into a fresh model and
      optimizer at the same N: the resumed steps 6..10 must be bit-identical to the uninterrupted ones.
  torch_owner_held_dcp_test.py load DIR   (at M ranks, after a save at another N)
      loads DIR/step5 at M ranks twice, into the owner-held mode and into the all-to-all mode
      (FSDP2 shards everything: DCP reshards the owners' whole tensors into row shards), trains steps
      6..10 and checks every weight is within 1e-5 (relative Frobenius, the tolerance of the other
      tests: only the order of float32 sums differs) of DIR/final.pt.
Every rank sees the same batch, so the gradient does not depend on the world size.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dmuon.torch import DMuon, hold_on_owners
from dmuon.torch.mpirun import init_process_group
from owner_held_model import global_batches, loss_of, make_net
from rank_checks import check, finish
from dcp_io import load, save  # get_state_dict + dcp.save; dcp.load + set_state_dict
from rank_exit import exit_rank

SAVED_AT, STEPS = 5, 10
TOLERANCE = 1e-5


def build(hold, seed, hsdp=False):
    """(model, optimizer): Net under fully_shard (HSDP on a (2, W/2) mesh), its Muon matrices held on
    owners when `hold`."""
    net = make_net()
    if seed is not None:  # other initial values: a load must overwrite every one
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in net.parameters():
                p.normal_()
    mesh = (init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard")) if hsdp
            else init_device_mesh("cpu", (WORLD,)))
    held = hold_on_owners(net, mesh) if hold else None
    ignored = held.params if held is not None else None
    for block in net.blocks:
        fully_shard(block, mesh=mesh, ignored_params=ignored)
    fully_shard(net, mesh=mesh, ignored_params=ignored)
    return net, DMuon(net, lr=0.02, adamw_lr=3e-3, weight_decay=0.01, clip_grad_norm=5.0)


def train(model, opt, steps):
    batches = global_batches(STEPS, 4)
    for step in steps:
        loss_of(model, batches[step]).backward()
        opt.step()
        opt.zero_grad()


def local_values(model, opt):
    """{name: this rank's values} and {(index, key): this rank's state}; a held matrix is its
    owner's alone, elsewhere absent."""
    params = {}
    for n, p in model.named_parameters():
        if isinstance(p, DTensor):
            params[n] = p.detach().to_local().clone()
        elif p._dmuon_held.owner == dist.get_rank():
            params[n] = p.detach().clone()
    state = {(i, k): (v.to_local() if hasattr(v, "to_local") else v).clone()
             for i, entry in opt.state_dict()["state"].items() for k, v in entry.items()}
    return params, state


def full_weights(model):
    out = {}
    for n, p in model.named_parameters():
        if isinstance(p, DTensor):
            out[n] = p.detach().full_tensor()
        else:
            info = p._dmuon_held
            value = p.detach().clone() if info.owner == dist.get_rank() else torch.empty(p.shape, dtype=p.dtype)
            if WORLD > 1:
                dist.broadcast(value, src=info.global_ranks[info.owner])
            out[n] = value
    return out


def role_save(folder, hsdp=False):
    model, opt = build(hold=True, seed=None, hsdp=hsdp)
    train(model, opt, range(SAVED_AT))
    save(model, opt, os.path.join(folder, "step5"))
    train(model, opt, range(SAVED_AT, STEPS))
    straight_params, straight_state = local_values(model, opt)
    final = full_weights(model)
    if RANK == 0:
        torch.save(final, os.path.join(folder, "final.pt"))

    resumed, opt2 = build(hold=True, seed=1, hsdp=hsdp)
    load(resumed, opt2, os.path.join(folder, "step5"))
    check(opt2.updates == SAVED_AT, f"same size: {opt2.updates} updates after loading, expected {SAVED_AT}")
    train(resumed, opt2, range(SAVED_AT, STEPS))
    params, state = local_values(resumed, opt2)
    check(params.keys() == straight_params.keys() and state.keys() == straight_state.keys(),
          f"same size: the resumed run holds other parameters or state here ({sorted(params)} vs "
          f"{sorted(straight_params)})")
    for n, v in straight_params.items():
        check(n in params and torch.equal(params[n], v), f"same size: {n} not bit-identical after the resumed steps")
    for k, v in straight_state.items():
        check(k in state and torch.equal(state[k], v), f"same size: optimizer state {k} not bit-identical")
    return f"saved at {WORLD} ranks{' (HSDP)' if hsdp else ''}, same-size resume bit-identical"


def role_load(folder):
    expected = torch.load(os.path.join(folder, "final.pt"))
    worst = {}
    for hold in (True, False):
        mode = "owner-held" if hold else "all-to-all"
        model, opt = build(hold=hold, seed=1)
        load(model, opt, os.path.join(folder, "step5"))
        check(opt.updates == SAVED_AT, f"{mode}: {opt.updates} updates after loading, expected {SAVED_AT}")
        train(model, opt, range(SAVED_AT, STEPS))
        worst[mode] = 0.0
        for n, w in full_weights(model).items():
            err = float((w.double() - expected[n].double()).norm() / expected[n].double().norm())
            worst[mode] = max(worst[mode], err)
            check(err <= TOLERANCE, f"{mode}: {n}: relative difference {err:.2e} to the uninterrupted run")
    figures = ", ".join(f"{mode} {e:.1e}" for mode, e in worst.items())
    return f"loaded at {WORLD} ranks, worst relative difference to the uninterrupted run: {figures}"


if __name__ == "__main__":
    RANK, WORLD = init_process_group("gloo")
    role, folder, options = sys.argv[1], sys.argv[2], sys.argv[3:]
    summary = role_save(folder, hsdp="hsdp" in options) if role == "save" else role_load(folder)
    exit_rank(finish(f"torch_owner_held_dcp_test {role} np {WORLD}: {summary}"))
