"""dmuon.torch.hold_on_owners: the owner-centric mode (DESIGN 7). One call before fully_shard (or
DDP) keeps each Muon matrix whole on one owner rank, out of FSDP2's hands:

    held = dmuon.torch.hold_on_owners(model, mesh)            # before fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=held.params)
    fully_shard(model, mesh=mesh, ignored_params=held.params)
    optimizer = dmuon.torch.DMuon(model)                      # updates both kinds

Here: which parameters are held (DMuon's routing, or a predicate), their owners (dmuon's planner on
rank 0, broadcast; each rank's owned bytes within the planner's bound), the placeholders that stand
for them elsewhere (placeholder.py), the hook units (modules) and buckets (buffer.py), and the model
state_dict's view of them (state_dict.py). hooks.py moves them; DMuon's step updates each master on
its owner without communication. Matrices that tensor parallelism made DTensors are held as their TP
slices (tensor_parallel.py): then DMuon's step gathers each matrix's slices of U on its owner and sends
the slices of O back, within the owner's TP group.
"""

import contextlib
import math
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dmuon.torch.agreement import agree_on_parameters, plan_on_rank0
from dmuon.torch.collectives import Group
from dmuon.torch.dtensors import is_dtensor, like_param
from dmuon.torch.held.buffer import HeldBuffer
from dmuon.torch.held.groups import HeldGroups, grid_of
from dmuon.torch.held.hooks import HeldSchedule, HeldUnit
from dmuon.torch.held.placeholder import HeldElsewhere
from dmuon.torch.held.state_dict import install_state_dict_hooks
from dmuon.torch.held.tensor_parallel import data_parallel_mesh, tensor_parallel
from dmuon.torch.matrices import held_cost, is_stack
from dmuon.torch.muon_options import DEFAULTS, MuonOptions, check_options
from dmuon.torch.params import is_expert_stack_by_default, module_groups
from dmuon.torch.placements import owner_holdings
from dmuon.torch.torch_private import fsdp_state_of

MEMORY_SLACK = 0.25  # the planner's bound: a rank owns at most (1 + slack) · total / W bytes (plan.hpp)
_SCHEDULES = weakref.WeakKeyDictionary()  # model → its HeldSchedules, in the order of its hold_on_owners calls


def adopt_replaced(model):
    """Gives the parameters that .to_empty() or .to() made after hold_on_owners(model) their held marks (each
    schedule's adopt()): DMuon(model) and torchtitan's optimizer container call it."""
    for schedule in _SCHEDULES.get(model, ()):
        schedule.adopt()


@dataclass(frozen=True)
class HeldParam:
    """What a held parameter carries (as p._dmuon_held) for DMuon and clip_grad_norm_: its owner (group
    rank: it runs the matrix's Newton–Schulz), the group's global ranks and process group (None: the
    default one), the schedule whose hooks move it, and every group rank's placements.Holding of it
    between uses (the owner all of it; under TP each rank of the owner's TP group its slice), and whether
    hold_on_owners took it as a stack of experts (its `experts` predicate; matrices.py)."""

    owner: int
    global_ranks: tuple
    process_group: object
    schedule: object
    holdings: tuple
    stack: bool


class HeldMatrices:
    """What hold_on_owners returns. params: the held parameters (fully_shard's ignored_params);
    owners: name → owner (group rank); owned_bytes: the weight bytes each rank owns, in group rank
    order, each at most owned_bytes_bound; units: the hook modules' names, in order."""

    def __init__(self, names, owners, owned_bytes, bound, units, schedule):
        self.names, self.owners = names, owners
        self.owned_bytes, self.owned_bytes_bound, self.units = owned_bytes, bound, units
        self._schedule = schedule

    @property
    def params(self):
        """The held parameters as the modules register them now (a set, for ignored_params)."""
        self._schedule.adopt()
        return {p for p, _ in self._schedule.registry.values()}

    def set_requires_gradient_sync(self, requires_gradient_sync):
        """As FSDPModule.set_requires_gradient_sync: False keeps the next backwards' gradients local
        (accumulated on every rank); the next backward with True sends their sum to the owners."""
        self._schedule.requires_gradient_sync = bool(requires_gradient_sync)

    @contextlib.contextmanager
    def unshard(self):
        """Every held matrix present on every rank inside the block, as FSDPModule.unshard(): the
        modules' parameters are then the working copies (values on every rank: norm logging, EMA
        copies, deepcopy), and forwards move nothing (an eval or generation loop sends each weight
        once). Collective on entry; the working copies are freed on exit. Writes inside reach the
        owner's master on the owner only: change weights outside it."""
        self._schedule.unshard()
        try:
            yield self
        finally:
            self._schedule.reshard()

    def remove(self):
        """Removes the hooks."""
        self._schedule.remove()


SPLIT_KEYS = ("split_heads", "split_sizes", "split_dim")


def _split_options(name, p, split):
    """None (the planner costs the held parameter whole), or the MuonOptions of split(name, p)'s split options, as
    DMuon will split it. ValueError naming the parameter for options that are not split options or bad ones."""
    options = split(name, p) if split is not None else None
    if options is None:
        return None
    where = f"dmuon.torch.hold_on_owners: split of '{name}'"
    if not isinstance(options, dict) or set(options) - set(SPLIT_KEYS):
        raise ValueError(f"{where}: split(name, parameter) must give None or a dict of {', '.join(SPLIT_KEYS)}, "
                         f"got {options!r}")
    check_options(options, where)
    return MuonOptions.of_group({**DEFAULTS, **options})


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
    from torch.distributed.fsdp import FSDPModule

    sharded = next((n for n, m in model.named_modules() if isinstance(m, FSDPModule)), None)
    if sharded is not None:
        n, p = next(((n, p) for n, p in chosen if is_dtensor(p)), (None, None))
        what = f"parameter '{n}' is a DTensor already (placements {tuple(p.placements)})" if n is not None else ""
        raise ValueError(f"dmuon.torch.hold_on_owners: {what or 'the model is sharded'}: fully_shard has sharded "
                         f"'{sharded or 'the model'}' already: call hold_on_owners before fully_shard (and give "
                         "fully_shard ignored_params=held.params)")
    for n, p in chosen:
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
                   reshard_after_forward=True, mp_policy=None, tune_cache="", gradient_divide_factor=None, split=None,
                   experts=is_expert_stack_by_default):
    """Makes the Muon matrices of `model` owner-held; returns a HeldMatrices.

    Call it on every rank before fully_shard or DDP, with the model materialised or on the meta device
    (then to_empty() and init as FSDP2's recipe, before or after fully_shard). mesh: the DeviceMesh
    fully_shard gets (1-D: FSDP2; 2-D: HSDP (replicate, shard)); without one, the parameters are
    replicated over process_group (DDP; DDP is told to ignore the held ones). Its ranks must be
    DMuon's process group's, in order. Under tensor parallelism (parallelize_module before this call,
    the matrices DTensors on a 1-D TP mesh): mesh is the data-parallel slice fully_shard gets
    (mesh["dp"] of a ("dp", "tp") mesh; HSDP: mesh["replicate", "dp"]), or the whole mesh the TP mesh
    is a named slice of (its other dims are then that slice: data_parallel_mesh in tensor_parallel.py),
    None for TP alone; each TP
    slice is held on the owner's TP group (tensor_parallel.py, which lists what is refused). Under expert
    parallelism (each (E, m, n) expert stack Shard(0) on a 1-D EP mesh, as transformers' grouped_gemm and
    torchtitan lay routed experts out): mesh is the expert-FSDP mesh (the EP mesh's sibling dims; HSDP:
    replicate and efsdp), each EP slice of a stack held on the owner's EP group as a TP slice is, every expert
    whole on one rank there (the whole (dp, ep) mesh: its dims other than EP's); hold the stacks with predicate= in a
    call of their own, the other matrices in
    another over their data-parallel mesh. gradient_divide_factor: what the owner divides a summed gradient
    by, as FSDPModule.set_gradient_divide_factor (default: the factor set on the unit's fully_shard, as
    torchtitan sets 1.0, else the group's size; experts under EP get tokens from
    more batches than their expert-FSDP group has ranks: the number of data-parallel batches).
    predicate(name, parameter) → bool picks the parameters instead of DMuon's routing. units: the
    modules whose hooks move their parameters (default: each block "….N" of the model, else the module
    holding the parameter). balancer: dmuon.plan_owners's
    ("milp" over measured Newton–Schulz costs, "lpt", "rr"); tune_cache: the tuning cache it plans
    with, as DMuon's ("" the default path, None none, else a path). split(name, parameter) → None or a dict of
    split options (split_heads, split_sizes, split_dim: those of the DMuon param group the parameter will be in): the
    planner costs a split matrix as its blocks, as DMuon does (without split, or where it gives None: the whole
    matrix; DMuon splits by its groups' options whatever was given here). experts(name, global_shape) → bool: which
    3-D parameters are stacks of experts, as DMuon's (DMuon updates a held parameter as the matrices this call took
    it as): the planner costs a stack as its E matrices, any other ≥ 3-D parameter as one (out, in·k…) filter
    (matrices.py). reshard_after_forward: as
    fully_shard's; False keeps the weights from forward to backward. mp_policy: a MixedPrecisionPolicy
    for the held matrices (default: the one fully_shard gave the unit's module or its nearest sharded
    ancestor at the first forward, else none): the masters and DMuon's state stay in their dtype on the owner,
    the working copies and broadcasts are in param_dtype, the gradient reduces in reduce_dtype.

    On a rank other than its owner a held parameter is a placeholder without storage outside its
    module's forward and backward (placeholder.py): reads raise an error naming it, writes are skipped.
    """
    comm = Group(process_group)
    error, chosen, tp, global_ranks, costs, stacks = None, [], None, comm.ranks, [], {}
    try:
        chosen = _select(model, predicate)
        mesh = data_parallel_mesh(chosen, mesh)  # the whole (dp, tp) mesh: its dp slice
        stacks = {n: is_stack(n, tuple(p.shape), experts, "dmuon.torch.hold_on_owners") for n, p in chosen}
        costs = [held_cost(n, tuple(p.shape), stacks[n], _split_options(n, p, split)) for n, p in chosen]
        tp = tensor_parallel(chosen, mesh, comm.ranks, comm.rank, stacks)
        global_ranks = comm.ranks if tp is not None else _group_ranks(mesh, process_group)
        if global_ranks != comm.ranks:
            raise ValueError(f"dmuon.torch.hold_on_owners: the mesh's ranks {global_ranks} are not the process "
                             f"group's {comm.ranks}")
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
    agree_on_parameters(comm, error, signature)

    world = comm.world
    owners_list = plan_on_rank0(comm, [shape for shape, _ in costs], balancer, torch.get_num_threads(), tune_cache,
                                [blocks for _, blocks in costs] if split is not None else None)
    owners = {n: o for (n, _), o in zip(chosen, owners_list)}
    if tp is None:
        holdings = {n: owner_holdings(tuple(p.shape), world, owners[n]) for n, p in chosen}
        groups = HeldGroups([comm.ranks], 0, grid_of(mesh, world), comm.rank, gradient_divide_factor)
        keeper = owners  # the group rank of the held groups that keeps each matrix between uses
    else:  # each TP rank's data-parallel group holds its slices: owned by the rank at the owner's dp coordinate
        holdings = {n: tp.holdings(tuple(p.shape), tuple(p.placements), owners[n]) for n, p in chosen}
        grids = [[comm.ranks[g] for g in ranks] for ranks in tp.dp_groups()]
        groups = HeldGroups(grids, tp.cells[comm.rank][1], grid_of(mesh, tp.dp), tp.dp_of(comm.rank),
                            gradient_divide_factor)
        keeper = {n: tp.dp_of(o) for n, o in owners.items()}
    registered = {n: _register_placeholder(model, n, p, groups.owner_global(keeper[n]))
                  if keeper[n] != groups.rank else p for n, p in chosen}

    order = {n: k for k, (n, _) in enumerate(model.named_modules())}
    by_unit = {}
    for n, _ in chosen:
        by_unit.setdefault(unit_names[n], []).append((n, registered[n]))
    unit_list = []
    for k, unit_name in enumerate(sorted(by_unit, key=order.__getitem__)):
        module = model.get_submodule(unit_name)
        keys = {}
        for n, p in by_unit[unit_name]:
            keys.setdefault((keeper[n], str(p.dtype), str(p.device)), []).append((n, p))
        buckets = [HeldBuffer(keys[key], key[0], groups) for key in sorted(keys)]
        slots = [(*_module_and_attr(model, n), n) for b in buckets for n in b.names]
        unit_list.append(HeldUnit(k, unit_name, module, buckets, slots))
        _set_policy(unit_list[-1], mp_policy, model, unit_name)
        unit_list[-1].stale = groups.grid.replicas > 1  # the columns have no copy yet

    schedule = HeldSchedule(unit_list, groups, reshard_after_forward)
    schedule.install()
    for n, _ in chosen:
        schedule.mark(n, registered[n], HeldParam(owners[n], tuple(comm.ranks), process_group, schedule, holdings[n],
                                                  stacks[n]))
    install_state_dict_hooks(model, None if tp is not None else _entry_mesh(mesh, global_ranks, comm), schedule, tp)
    _SCHEDULES.setdefault(model, []).append(schedule)  # DMuon(model) adopts through it (adopt_replaced)
    if chosen:
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [n for n, _ in chosen])

    owned = [0] * world
    for n, p in chosen:
        for g, holding in enumerate(holdings[n]):
            owned[g] += math.prod(holding.shape) * p.element_size()
    total = sum(owned)
    largest = max((p.numel() * p.element_size() for _, p in chosen), default=0)
    bound = max(largest, math.ceil((1 + MEMORY_SLACK) * total / world))
    return HeldMatrices([n for n, _ in chosen], owners, owned, bound,
                        [u.name for u in unit_list], schedule)


def _module_and_attr(model, name):
    module_name, _, attr = name.rpartition(".")
    return model.get_submodule(module_name), attr


def _register_placeholder(model, name, p, owner_global):
    """Replaces parameter `name` (not owned here) on its module by a placeholder without storage, which
    keeps the parameter's attributes; the values are dropped here (the owner has them). A TP slice's
    placeholder is a DTensor like the slice's, over a placeholder of the local slice."""
    module, attr = _module_and_attr(model, name)
    local = p.to_local() if is_dtensor(p) else p
    placeholder = torch.nn.Parameter(like_param(p, HeldElsewhere(local.shape, p.dtype, p.device, name, owner_global)),
                                     requires_grad=p.requires_grad)
    for key, value in vars(p).items():
        setattr(placeholder, key, value)
    module._parameters[attr] = placeholder
    return placeholder


def _set_policy(unit, mp_policy, model, unit_name):
    """At the unit's first use (fully_shard comes after hold_on_owners), from the fully_shard state of
    the unit's module or its nearest sharded ancestor: the buckets' compute and reduce dtypes
    (mp_policy's when given, else that state's MixedPrecisionPolicy), its param group (whose gradient
    divide factor the held gradients follow: buffer.py), and a refusal of its CPUOffloadPolicy, which
    cannot reach the held matrices (FSDP2 ignores them)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    parts = unit_name.split(".") if unit_name else []
    chain = [(".".join(parts[:k]), model.get_submodule(".".join(parts[:k]))) for k in range(len(parts), -1, -1)]

    def resolve():
        states = ((name, fsdp_state_of(m)) for name, m in chain)
        name, (group, policy) = next(((name, state) for name, state in states if state is not None), (None, (None, None)))
        if isinstance(getattr(group, "offload_policy", None), CPUOffloadPolicy):
            raise RuntimeError(f"dmuon.torch.hold_on_owners: fully_shard of '{name or 'the model'}' has a "
                               "CPUOffloadPolicy, which cannot offload the held matrices (FSDP2 ignores them): "
                               "fully_shard without offload_policy, or DMuon without hold_on_owners")
        policy = mp_policy if mp_policy is not None else policy
        for b in unit.buckets:
            b.fsdp_group = group
            b.param_dtype = policy.param_dtype if policy is not None else None
            b._reduce_dtype = policy.reduce_dtype if policy is not None else None
    unit.resolve_policy = resolve


def _entry_mesh(mesh, global_ranks, comm):
    """The 1-D DeviceMesh over the held group's ranks of the state dict's entries (state_dict.py);
    None in a single process without torch.distributed. Collective (it makes a process group)."""
    from torch.distributed.device_mesh import DeviceMesh

    if mesh is not None and mesh.ndim == 1:
        return mesh
    if not comm.distributed:
        return None
    device_type = mesh.device_type if mesh is not None else comm.tensor_device().type
    return DeviceMesh(device_type, global_ranks)
