"""From what a user passes to DMuon (named_parameters(), tensors, param groups, Sharded
descriptions) to param groups that are each all-Muon or all-AdamW, with a name for every parameter.

Which parameters go to Muon (DESIGN 1): the hidden matrices. By default a parameter with ≥ 2
dimensions goes to Muon unless its name says it is an embedding or the output head; everything else
(1-D, scalars, embeddings, head) goes to AdamW. A group with use_muon=True/False overrides that.
"""

import re

import torch

from dmuon.torch.layout import Sharded

# Names of embeddings and output heads (any dotted component), as named_parameters() spells them in
# common models: GPT-2 (wte, wpe), Hugging Face (embed_tokens, lm_head), llama (tok_embeddings, output).
_ADAMW_NAME = re.compile(r"(^|\.)(wte|wpe|embed\w*|\w*_embeddings?|tok_embeddings|lm_head|head|output)(\.|$)")

# Hyper-parameters a group may set, per kind, with the DMuon keyword each defaults to.
MUON_KEYS = {"lr": "lr", "momentum": "momentum", "nesterov": "nesterov", "weight_decay": "weight_decay"}
ADAMW_KEYS = {"lr": "adamw_lr", "betas": "adamw_betas", "eps": "adamw_eps", "weight_decay": "adamw_weight_decay"}


def is_muon_by_default(name, global_shape):
    return len(global_shape) >= 2 and not _ADAMW_NAME.search(name)


def _named(items, group_index):
    """[(name, tensor or Sharded)] from a list of tensors, Sharded or (name, ...) pairs."""
    if isinstance(items, (torch.Tensor, Sharded)):
        items = [items]
    out = []
    for i, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            out.append(item)
        else:
            out.append((f"group{group_index}.param{i}", item))
    return out


def _global_shape(param):
    return tuple(param.global_shape) if isinstance(param, Sharded) else tuple(param.shape)


def split_groups(params, defaults):
    """[{"use_muon": bool, "named": [(name, param)], hyper-parameters...}] from DMuon's `params`.

    A user group's "lr"/"momentum"/"nesterov"/"weight_decay" apply to its Muon parameters, its
    "adamw_lr"/"adamw_betas"/"adamw_eps"/"adamw_weight_decay" to its AdamW ones; a group with
    use_muon=False may also spell those "lr", "betas", "eps", "weight_decay". A group without
    use_muon is split by is_muon_by_default (empty halves are dropped).
    """
    entries = list(params)
    if not entries:
        raise ValueError("DMuon got an empty parameter list")
    user_groups = entries if all(isinstance(e, dict) for e in entries) else [{"params": entries}]
    out = []
    for g, group in enumerate(user_groups):
        if "params" not in group:
            raise ValueError(f"DMuon: param group {g} has no 'params'")
        unknown = set(group) - {"params", "use_muon"} - set(MUON_KEYS) - set(ADAMW_KEYS.values()) - {"betas", "eps"}
        if unknown:
            raise ValueError(f"DMuon: param group {g} has unknown keys {sorted(unknown)}")
        named = _named(group["params"], g)
        use_muon = group.get("use_muon")
        if use_muon is None:
            halves = [(True, [(n, p) for n, p in named if is_muon_by_default(n, _global_shape(p))]),
                      (False, [(n, p) for n, p in named if not is_muon_by_default(n, _global_shape(p))])]
        else:
            halves = [(bool(use_muon), named)]
        for muon, members in halves:
            if not members:
                continue
            hyper = {"use_muon": muon, "named": members}
            if muon:
                for key, default in MUON_KEYS.items():
                    hyper[key] = group.get(key, defaults[default])
                for name, p in members:
                    if len(_global_shape(p)) < 2:
                        raise ValueError(f"DMuon: parameter '{name}' has shape {_global_shape(p)}; Muon needs a "
                                         "matrix (put it in a group with use_muon=False)")
            else:
                for key, default in ADAMW_KEYS.items():
                    plain = use_muon is False and key in group
                    hyper[key] = group[key] if plain else group.get(default, defaults[default])
            out.append(hyper)
    return out
