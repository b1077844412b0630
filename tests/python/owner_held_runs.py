"""The owner-held tests' training frame (torch_owner_held_test.py, torch_muon_options_ranks_test.py,
torch_bf16_states_test.py): their steps, batch, tolerance and hyper-parameters; the mesh of a variant;
owner_held_model's net wrapped by fully_shard (or DDP); its full weights on every rank; its param groups by name
prefix and each rank's local values of weights and state; the float64 reference run of the global batch in one
process. Collective where it says so, over the default process group."""

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from dmuon.torch.params import module_groups
from muon_reference import Reference
from owner_held_model import global_batches, loss_of, make_net

STEPS = 10
BATCH = 36  # divides by N·micro-batches for N = 1..4 and 3 micro-batches
TOLERANCE = 1e-5
CLIP = 0.32  # some steps' global gradient norms are above it, some below
HYPER = dict(lr=0.02, momentum=0.9, weight_decay=0.01, adamw_lr=3e-3, adamw_weight_decay=0.01, clip_grad_norm=CLIP,
             ns_dtype="float32")  # the tolerances are float32's, whatever the machine's default


def mesh_of(kind):
    """The device mesh of a variant's kind over every rank: "fsdp2" 1-D, "hsdp" (2, N/2); None for "ddp"."""
    world = dist.get_world_size()
    if kind == "fsdp2":
        return init_device_mesh("cpu", (world,))
    if kind == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return None


def wrap(net, mesh, held):
    """fully_shard every block and the root (DDP without a mesh); returns what runs forward."""
    ignored = held.params if held is not None else None
    if mesh is None:
        return DistributedDataParallel(net) if dist.get_world_size() > 1 else net
    for block in net.blocks:
        fully_shard(block, mesh=mesh, ignored_params=ignored)
    fully_shard(net, mesh=mesh, ignored_params=ignored)
    return net


def full_weights(net):
    """{name: full tensor} of the net's parameters on every rank (collective: DTensors gathered, held matrices
    broadcast from their owners)."""
    out = {}
    for name, p in net.named_parameters():
        if isinstance(p, DTensor):
            out[name] = p.full_tensor().detach().clone()
        elif hasattr(p, "_dmuon_held"):
            info = p._dmuon_held
            value = p.detach().clone() if info.owner == dist.get_rank() else torch.empty(p.shape, dtype=p.dtype)
            if dist.get_world_size() > 1:
                dist.broadcast(value, src=info.global_ranks[info.owner])
            out[name] = value
        else:
            out[name] = p.detach().clone()
    return out


def groups_of(net, table):
    """module_groups(net) with its Muon group split into one group per entry of table, [(name prefix, the group's
    options)] (each Muon parameter's name starts with one of its prefixes)."""
    out = []
    for group in module_groups(net):
        if not group["use_muon"]:
            out.append(group)
            continue
        for prefix, options in table:
            members = [(n, p) for n, p in group["params"]
                       if next(q for q, _ in table if n.startswith(q)) == prefix]
            out.append({"params": members, "use_muon": True, **options})
    return out


def local_values(net, opt):
    """{name or (index, key): this rank's parameter or optimizer state tensor} (a held matrix: its owner's alone)."""
    out = {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone() for n, p in net.named_parameters()
           if not hasattr(p, "_dmuon_held") or p._dmuon_held.owner == dist.get_rank()}
    out.update(((i, k), (v.to_local() if isinstance(v, DTensor) else v).clone())
               for i, entry in opt.state_dict()["state"].items() for k, v in entry.items())
    return out


def hyper_of(opt):
    return {n: dict(g) for g in opt.param_groups for n in g["param_names"]}


def reference_run(variant, hyper, after_step=None):
    """The float64 reference: the whole global batch in one process, Muon + AdamW of DESIGN 1; after_step(step,
    weights) may change the weights after each step."""
    kwargs = dict(variant.get("net", {}))
    kwargs.pop("checkpointing", None)
    net = make_net(torch.float64, **kwargs)
    ref = Reference({n: p.detach() for n, p in net.named_parameters()}, hyper, clip=CLIP)
    norms = []
    for step, tokens in enumerate(global_batches(STEPS, BATCH)):
        net.zero_grad()
        loss_of(net, tokens).backward()
        norms.append(math.sqrt(sum(float(p.grad.square().sum()) for p in net.parameters())))
        ref.step({n: p.grad for n, p in net.named_parameters()})
        if after_step is not None:
            after_step(step, ref.w)
        with torch.no_grad():
            for n, p in net.named_parameters():
                p.copy_(ref.w[n])
    return ref.w, norms


def relative(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
