"""DMuon's plan of its parameters, per parameter and per rank (optimizer.py's construction and add_param_group, which
agree on the result across the ranks, agreement.py): the parameters described and checked (their groups' values;
each one's layout, layout.py; its Muon matrices, matrices.py), torch.optim's param groups of them, their Muon
matrices and owners, and each one's state before its first update, laid out as the parameter."""

import torch

from dmuon.torch.agreement import plan_on_rank0
from dmuon.torch.arguments import STATE_DTYPES, check_group
from dmuon.torch.dense import check_writable
from dmuon.torch.layout import describe
from dmuon.torch.matrices import assign_owners, check_filter_layout, matrices_of, parameter_matrices, stack_of
from dmuon.torch.muon_options import MuonOptions
from dmuon.torch.variants import variant_of


def describe_groups(comm, groups, seen, experts):
    """[(name, layout.Layout, group)] of every parameter of split_groups' groups (params.py), in order: each group's
    values checked (arguments.check_group), each parameter described and checked by describe_parameter (seen: as
    its)."""
    layouts = []
    for g in groups:
        check_group(g, g["named"][0][0])
        for name, p in g["named"]:
            layouts.append((name, describe_parameter(comm, name, p, g, seen, experts), g))
    return layouts


def torch_groups_of(groups, layouts):
    """(torch.optim's param groups, [(name, Layout, its torch group)]) of split_groups' groups and describe_groups'
    parameters: each group's values with its tensors as "params" (and "param_names" where it was given names)."""
    torch_groups, torch_group_of = [], {}
    for g in groups:
        hyper = {k: v for k, v in g.items() if k not in ("named", "param_names")}
        hyper["params"] = [l.tensor for n, l, gg in layouts if gg is g]
        if g["param_names"]:
            hyper["param_names"] = [n for n, _ in g["named"]]
        torch_groups.append(hyper)
        torch_group_of[id(g)] = hyper
    return torch_groups, [(n, l, torch_group_of[id(g)]) for n, l, g in layouts]


def describe_parameter(comm, name, p, group, seen, experts):
    """The layout.Layout of parameter `name` (p) of param group `group` for the optimizer's group `comm`; seen: id of
    every tensor described so far → its name (this one added). ValueError naming the parameter for a layout dmuon
    cannot take, a parameter in two groups, Muon matrices its layout or its group's split cannot take, or an
    owner-held parameter in an AdamW group."""
    layout = describe(name, p, comm.pg, comm.ranks, comm.rank)
    if not layout.held_elsewhere:
        check_writable(name, layout.local(layout.tensor))
    if id(layout.tensor) in seen:
        raise ValueError(f"DMuon: some parameters appear in more than one parameter group: "
                         f"'{name}' (also '{seen[id(layout.tensor)]}')")
    seen[id(layout.tensor)] = name
    if group["use_muon"]:
        stack = stack_of(name, layout, experts)
        check_filter_layout(name, layout.global_shape, stack, layout)
        for _, rows, cols in matrices_of(layout.global_shape, stack):
            MuonOptions.of_group(group).blocks(rows, cols, name)
    elif layout.held is not None:
        raise ValueError(f"DMuon: parameter '{name}' is held on its owner (dmuon.torch.hold_on_owners) for Muon, but "
                         "its param group is AdamW's")
    return layout


def plan_matrices(comm, indexed, experts, balancer, threads, tune_cache):
    """The Muon matrices (matrices.MuonMatrix) of the parameters [(index, name, Layout, group)], in order, their owners
    planned among themselves (collective: on rank 0, agreement.plan_on_rank0, with DMuon's balancer, threads and
    tune_cache); an empty matrix has none: nothing to orthogonalize or update."""
    matrices = []
    for i, name, layout, group in indexed:
        if group["use_muon"]:
            matrices.extend(parameter_matrices(i, name, layout, group, MuonOptions.of_group(group),
                                               stack_of(name, layout, experts)))
    assign_owners(matrices, comm.world,
                  lambda shapes, world, blocks: plan_on_rank0(comm, shapes, balancer, threads, tune_cache, blocks))
    return matrices


def state_dtype(group, param):
    """The dtype parameter `param` of param group `group` keeps its state in: the group's state_dtype, or the
    parameter's own dtype where that is None (a group keeps its name: arguments.state_dtype_value)."""
    return param.dtype if group["state_dtype"] is None else STATE_DTYPES[group["state_dtype"]]


def work_dtype(group, param):
    """The dtype a step computes in from the parameter's state (AdamW's operands, Muon's U): the wider of the state's
    and the parameter's, so a float32 parameter's bfloat16 state is widened to float32 (each store rounds to nearest
    even, torch's .to) and a bfloat16 parameter with bfloat16 state is stepped as torch steps it."""
    return torch.promote_types(state_dtype(group, param), param.dtype)


def matrix_dtypes(k):
    """Muon matrix k's state dtype and U's (its bucket's key; exchange.Exchange's dtypes_of)."""
    return state_dtype(k.group, k.layout.tensor), work_dtype(k.group, k.layout.tensor)


def convert_state(entry, dtype):
    """A parameter's state entry's tensors (its AdamW step count aside) in `dtype`, in place (each value rounded to
    nearest even: torch's .to)."""
    for key, value in entry.items():
        if key != "step" and value.dtype != dtype:
            entry[key] = value.to(dtype)


def zero_state(name, layout, group, experts, dtype):
    """A parameter's state before its first update (dtype: the state's), laid out as the parameter (a DTensor
    parameter gets DTensors of the same mesh and placements): Muon's momentum and its variant's state (variants/),
    or AdamW's step count and moments; empty where the parameter is held elsewhere (its state lives on its owner;
    an empty entry lets DCP's set_state_dict find one for every parameter)."""
    p = layout.tensor
    if layout.held_elsewhere:
        return {}

    def zeros():
        return torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format, requires_grad=False)

    if group["use_muon"]:
        options = MuonOptions.of_group(group)
        stack = stack_of(name, layout, experts)
        _, rows, cols = matrices_of(layout.global_shape, stack)[0]
        variant = variant_of(options)
        return {"momentum_buffer": zeros(),
                **variant.zero_state(layout, stack, variant.width(options, rows, cols, name), dtype)}
    # "step" on the parameter's device, as torch.optim.AdamW's fused step keeps it
    return {"step": torch.zeros((), dtype=torch.float32, device=p.device), "exp_avg": zeros(), "exp_avg_sq": zeros()}

