"""DMuon's plan of its parameters, per parameter and per rank (optimizer.py's construction and add_param_group, which
agree on the result across the ranks, agreement.py): the parameter described and checked (its layout, layout.py; its
Muon matrices, matrices.py), its state before its first update, laid out as the parameter, and a saved state checked
against it (load_state_dict)."""

import torch

from dmuon.torch.dense import check_writable
from dmuon.torch.dtensors import is_dtensor
from dmuon.torch.layout import describe
from dmuon.torch.matrices import check_filter_layout, matrices_of, stack_of
from dmuon.torch.muon_options import MuonOptions
from dmuon.torch.variants import variant_of


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


def state_dtype(group, param):
    """The dtype parameter `param` of param group `group` keeps its state in: the group's state_dtype, or the
    parameter's own dtype where that is None."""
    return param.dtype if group["state_dtype"] is None else group["state_dtype"]


def work_dtype(group, param):
    """The dtype a step computes in from the parameter's state (AdamW's operands, Muon's U): the wider of the state's
    and the parameter's, so a float32 parameter's bfloat16 state is widened to float32 (each store rounds to nearest
    even, torch's .to) and a bfloat16 parameter with bfloat16 state is stepped as torch steps it."""
    return torch.promote_types(state_dtype(group, param), param.dtype)


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


def check_saved_state(name, entry, mine):
    """ValueError naming parameter `name` when a saved state entry does not fit its state here (mine): other keys,
    or a tensor of another kind, shape, mesh or placements."""
    if set(entry) != set(mine):
        raise ValueError(f"DMuon.load_state_dict: '{name}' has state {sorted(entry)} in the saved state, "
                         f"{sorted(mine)} here")

    def kind(t):
        return f"DTensor {tuple(t.placements)}" if is_dtensor(t) else "tensor"
    for key, value in entry.items():
        target = mine[key]
        if key == "step":
            continue
        if is_dtensor(target) != is_dtensor(value) or tuple(value.shape) != tuple(target.shape) or (
                is_dtensor(target) and (value.placements != target.placements
                                        or value.device_mesh != target.device_mesh)):
            raise ValueError(f"DMuon.load_state_dict: '{name}' {key} is a {kind(value)} of shape "
                             f"{tuple(value.shape)}, here a {kind(target)} of shape {tuple(target.shape)} "
                             "(load another world size or layout with torch.distributed.checkpoint)")
