"""dmuon.torch.hold_on_owners: the owner-centric mode (DESIGN 7). One call before fully_shard (or
DDP) keeps each Muon matrix whole on one owner rank, out of FSDP2's hands:

    held = dmuon.torch.hold_on_owners(model, mesh)            # before fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=held.params)
    fully_shard(model, mesh=mesh, ignored_params=held.params)
    optimizer = dmuon.torch.DMuon(model)                      # updates both kinds

Here: which parameters are held (DMuon's routing, or a predicate), their owners (dmuon's planner on
rank 0, broadcast; each rank's owned bytes within the planner's bound), the hook units (modules)
and buckets, and the model state_dict's view of them (each held matrix appears on its owner only).
held_hooks.py moves them; DMuon's step updates each on its owner without communication.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dmuon.torch.collectives import Group
from dmuon.torch.held_buffer import HeldBuffer
from dmuon.torch.held_groups import HeldGroups, grid_of
from dmuon.torch.held_hooks import HeldSchedule, HeldUnit, _wait
from dmuon.torch.layout import is_dtensor
from dmuon.torch.optimizer import _agree_on_parameters, _plan_on_rank0
from dmuon.torch.params import module_groups

MEMORY_SLACK = 0.25  # the planner's bound: a rank owns at most (1 + slack) · total / W bytes (plan.hpp)


@dataclass(frozen=True)
class HeldParam:
    """What a held parameter carries (as p._dmuon_held) for DMuon: its owner (group rank), the group's
    global ranks, and the schedule whose hooks move it."""

    owner: int
    global_ranks: tuple
    schedule: object


class HeldMatrices:
    """What hold_on_owners returns. params: the held parameters (fully_shard's ignored_params);
    owners: name → owner (group rank); owned_bytes: the weight bytes each rank owns, in group rank
    order, each at most owned_bytes_bound; units: the hook modules' names, in order."""

    def __init__(self, names, params, owners, owned_bytes, bound, units, schedule):
        self.names, self.params, self.owners = names, params, owners
        self.owned_bytes, self.owned_bytes_bound, self.units = owned_bytes, bound, units
        self._schedule = schedule

    def set_requires_gradient_sync(self, requires_gradient_sync):
        """As FSDPModule.set_requires_gradient_sync: False keeps the next backwards' gradients local
        (accumulated on every rank); the next backward with True sends their sum to the owners."""
        self._schedule.requires_gradient_sync = bool(requires_gradient_sync)

    def remove(self):
        """Removes the hooks (the parameters stay views of their buckets)."""
        self._schedule.remove()


def _plan_shape(shape):
    """(rows, cols) the planner costs a held parameter as: its matrix, a conv weight as (out, in·kh·kw),
    an (E, m, n) stack as (min(m, n), E·max(m, n)): the same Newton–Schulz flops and bytes as its E
    matrices, held together on one owner."""
    if len(shape) == 3:
        e, m, n = shape
        return min(m, n), e * max(m, n)
    return shape[0], math.prod(shape[1:])


def _default_unit(name):
    """The hook unit of a parameter: its shortest enclosing module path ending in an index
    ("blocks.3" for "blocks.3.attn.q.weight"), else the module holding it."""
    parts = name.split(".")[:-1]
    for k, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:k + 1])
    return ".".join(parts)


def _unit_of(name, unit_names):
    """The nearest enclosing module of `name` among unit_names (module paths)."""
    parts = name.split(".")[:-1]
    for k in range(len(parts), -1, -1):
        path = ".".join(parts[:k])
        if path in unit_names:
            return path
    raise ValueError(f"dmuon.torch.hold_on_owners: parameter '{name}' lies in none of the given units")


def _select(model, predicate):
    """[(name, parameter)] to hold: DMuon(model)'s Muon parameters, or those predicate(name, p) picks."""
    if predicate is None:
        chosen = [(n, p) for g in module_groups(model) if g["use_muon"] for n, p in g["params"]]
    else:
        chosen = [(n, p) for n, p in model.named_parameters() if predicate(n, p)]
    for n, p in chosen:
        if is_dtensor(p):
            raise ValueError(f"dmuon.torch.hold_on_owners: parameter '{n}' is a DTensor already; call "
                             "hold_on_owners before fully_shard")
        if p.dim() < 2:
            raise ValueError(f"dmuon.torch.hold_on_owners: parameter '{n}' has shape {tuple(p.shape)}; "
                             "only matrices (≥ 2-D) can be held for Muon")
    return [(n, p) for n, p in chosen if p.requires_grad]


def _group_ranks(mesh, process_group):
    if not (dist.is_available() and dist.is_initialized()):
        return [0]
    if mesh is not None:
        return [int(r) for r in mesh.mesh.flatten().tolist()]
    return list(dist.get_process_group_ranks(process_group or dist.group.WORLD))


def hold_on_owners(model, mesh=None, *, process_group=None, predicate=None, units=None, balancer="milp",
                   reshard_after_forward=True):
    """Makes the Muon matrices of `model` owner-held; returns a HeldMatrices.

    Call it on every rank, after the model is on its device and before fully_shard or DDP. mesh: the
    DeviceMesh fully_shard gets (1-D: FSDP2; 2-D: HSDP (replicate, shard)); without one, the
    parameters are replicated over process_group (DDP; DDP is told to ignore the held ones). Its
    ranks must be DMuon's process group's, in order. predicate(name, parameter) → bool picks the
    parameters instead of DMuon's routing. units: the modules whose hooks move their parameters
    (default: each block "….N" of the model, else the module holding the parameter). balancer:
    dmuon.plan_owners's ("milp" over measured Newton–Schulz costs, "lpt", "rr").
    reshard_after_forward: as fully_shard's; False keeps the weights from forward to backward.
    """
    comm = Group(process_group)
    global_ranks = _group_ranks(mesh, process_group)
    error, chosen = None, []
    try:
        if global_ranks != comm.ranks:
            raise ValueError(f"dmuon.torch.hold_on_owners: the mesh's ranks {global_ranks} are not the process "
                             f"group's {comm.ranks}")
        chosen = _select(model, predicate)
        if units is None:
            unit_names = {n: _default_unit(n) for n, _ in chosen}
        else:
            paths = {id(m): n for n, m in model.named_modules()}
            unknown = [m for m in units if id(m) not in paths]
            if unknown:
                raise ValueError(f"dmuon.torch.hold_on_owners: {len(unknown)} of the units are not modules of the model")
            wanted = {paths[id(m)] for m in units}
            unit_names = {n: _unit_of(n, wanted) for n, _ in chosen}
    except ValueError as e:
        error = str(e)
    signature = [(n, tuple(p.shape), str(p.dtype), unit_names[n]) for n, p in chosen] if error is None else []
    _agree_on_parameters(comm, error, signature)

    world = comm.world
    owners_list = _plan_on_rank0(comm, [_plan_shape(tuple(p.shape)) for _, p in chosen], balancer,
                                 torch.get_num_threads())
    owners = {n: o for (n, _), o in zip(chosen, owners_list)}
    groups = HeldGroups(global_ranks, grid_of(mesh, world), comm.rank)

    order = {n: k for k, (n, _) in enumerate(model.named_modules())}
    by_unit = {}
    for n, p in chosen:
        by_unit.setdefault(unit_names[n], []).append((n, p))
    unit_list, names_in_unit = [], []
    for k, unit_name in enumerate(sorted(by_unit, key=order.__getitem__)):
        module = model.get_submodule(unit_name)
        members = by_unit[unit_name]
        keys = {}
        for n, p in members:
            keys.setdefault((owners[n], str(p.dtype), str(p.device)), []).append((n, p))
        buckets = [HeldBuffer(keys[key], key[0], groups) for key in sorted(keys)]
        unit_list.append(HeldUnit(k, unit_name, module, buckets))
        prefix = unit_name + "." if unit_name else ""
        names_in_unit.append([((n[len(prefix):], p), n) for n, p in members])
    _sync_columns(unit_list)

    schedule = HeldSchedule(unit_list, groups, reshard_after_forward)
    schedule.install(names_in_unit)
    for n, p in chosen:
        p._dmuon_held = HeldParam(owners[n], tuple(global_ranks), schedule)
    _hide_others_from_state_dict(model, chosen, owners, comm.rank, schedule)
    if chosen:
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [n for n, _ in chosen])

    owned = [0] * world
    for n, p in chosen:
        owned[owners[n]] += p.numel() * p.element_size()
    total = sum(owned)
    largest = max((p.numel() * p.element_size() for _, p in chosen), default=0)
    bound = max(largest, math.ceil((1 + MEMORY_SLACK) * total / world))
    return HeldMatrices([n for n, _ in chosen], {p for _, p in chosen}, owners, owned, bound,
                        [u.name for u in unit_list], schedule)


def _sync_columns(units):
    """The owner's initial values to the rest of its column (HSDP). The other ranks' copies are
    overwritten by the first forward's broadcast and freed after it (not here: a fully_shard that
    was not told to ignore them reads them, and the first forward then names the mistake)."""
    for unit in units:
        _wait([b.broadcast_across_column() for b in unit.buckets])


def _hide_others_from_state_dict(model, chosen, owners, rank, schedule):
    """model.state_dict() lists a held matrix on its owner only (elsewhere its storage is freed or
    stale), so DCP saves the owner's; load_state_dict does not miss it elsewhere, and after a load
    every copy is refreshed from the owners before its next use."""
    others = {n for n, _ in chosen if owners[n] != rank}
    by_module = {}
    for n in others:
        module, _, attr = n.rpartition(".")
        by_module.setdefault(module, []).append(attr)
    for module_name, attrs in by_module.items():
        def drop(module, state_dict, prefix, local_metadata, attrs=attrs):
            for attr in attrs:
                state_dict.pop(prefix + attr, None)
        model.get_submodule(module_name).register_state_dict_post_hook(drop)

    def not_missing(module, incompatible_keys):
        incompatible_keys.missing_keys[:] = [
            k for k in incompatible_keys.missing_keys
            if not any(k == n or k.endswith("." + n) for n in others)]
        schedule.after_step()
    model.register_load_state_dict_post_hook(not_missing)
