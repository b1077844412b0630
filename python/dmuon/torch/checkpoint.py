"""DMuon.load_state_dict's business (optimizer.py): a saved state_dict() checked against the optimizer before anything
is written (so a refused one loses nothing), then its tensors and group values written in. Local: each rank loads
its own; DCP reshards before it (torch.distributed.checkpoint's set_state_dict)."""

import copy

import torch

from dmuon.torch.arguments import state_dtype_value
from dmuon.torch.dtensors import is_dtensor
from dmuon.torch.muon_options import MuonOptions, check_options
from dmuon.torch.plan import state_dtype


def checked_entries(param_groups, state_dict, layouts, names, matrices, state):
    """[(parameter index, its saved entry or None, the dtype of its state under the saved group's state_dtype)] of a
    state_dict() over the optimizer's param_groups (its parameters' layout.Layouts, names, Muon matrices and state,
    in the optimizer's order), matched by position as torch.optim.Optimizer matches them; ValueError for other
    groups, kinds, options, splits, state dtypes, keys or tensors."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"loaded state dict has a different number of parameter groups ({len(saved_groups)}, "
                         f"DMuon has {len(param_groups)})")
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in param_groups]:
        raise ValueError(f"loaded state dict contains a parameter group that doesn't match the size of "
                         f"optimizer's group: {[len(g['params']) for g in saved_groups]} parameters, DMuon's "
                         f"{[len(g['params']) for g in param_groups]}")
    saved_state = state_dict["state"]
    index_of = {id(l.tensor): i for i, l in enumerate(layouts)}  # a repeated parameter: its one index
    entries = []
    for g, saved in zip(param_groups, saved_groups):
        indices = [index_of[id(p)] for p in g["params"]]
        where = f"DMuon.load_state_dict: the group of '{names[indices[0]]}'" if indices else ""
        if saved.get("use_muon", g["use_muon"]) != g["use_muon"]:
            raise ValueError(f"{where} is Muon in one state, AdamW in the other")
        if g["use_muon"]:
            check_options(saved, where)
            options = MuonOptions.of_group({**g, **saved})
            for k in matrices:
                if k.group is g:
                    options.blocks(k.rows, k.cols, k.name)  # a split that does not fit the matrix raises
        if "state_dtype" in saved:
            saved = {**saved, "state_dtype": state_dtype_value(saved["state_dtype"], where)}
        for i, key in zip(indices, saved["params"]):
            entry = saved_state.get(key)
            if entry is not None:
                check_saved_state(names[i], entry, state[layouts[i].tensor])
            entries.append((i, entry, state_dtype({**g, **saved}, layouts[i].tensor)))
    return entries


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


def load_entry(layout, mine, entry):
    """Copies a checked saved state entry (checked_entries) into a parameter's state `mine` (layout: its
    layout.Layout)."""
    for key, value in entry.items():
        target = mine[key]
        if key == "step":
            target.copy_(torch.as_tensor(value, dtype=target.dtype))
        elif value is not target:
            layout.local(target).copy_(layout.local(value))


def load_group_values(param_groups, saved_groups):
    """The saved groups' values over the groups' own ("param_names" too, as torch's; a state_dtype string made torch's
    dtype), in place: the Muon matrices and the optimizer's per-parameter groups hold these dicts."""
    for g, saved in zip(param_groups, saved_groups):
        for k, v in saved.items():
            if k != "params":
                g[k] = copy.deepcopy(v)
        g["state_dtype"] = state_dtype_value(g["state_dtype"], "")
