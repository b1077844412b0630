"""From what a user passes to DMuon (a model, named_parameters(), tensors, param groups, Sharded
descriptions) to param groups that are each all-Muon or all-AdamW, with a name for every parameter.

Which parameters go to Muon (DESIGN 1): the hidden matrices. A parameter with ≥ 2 dimensions (conv
filters and 3-D expert stacks included) goes to Muon unless its name marks it as an embedding, a
learned table or an output head; those, and every parameter with fewer than 2 dimensions, go to
AdamW. The name is split at its dots. An embedding: a component begins with "emb" or contains
"_emb" (embed_tokens, word_embeddings, pos_embed, patch_embed, tok_emb), or is wte, wpe or shared
(GPT-2's and T5's tables). A learned table: a component contains "bias" (T5's
relative_attention_bias) or the parameter's own name ends in "token"/"tokens" (cls_token,
register_tokens). An output head: a component is head, lm_head, classifier, score or cls (BERT's
pre-training heads), or the module holding the parameter is named output or decoder (only the
holding module: those names also label containers of hidden layers, as in BERT's
attention.output.dense and T5's decoder stack). DMuon(model) adds two rules by module type: the
weights of nn.Embedding and nn.EmbeddingBag go to AdamW, and so does the output head, the last
nn.Linear whose out_features equals the largest embedding's num_embeddings (a head tied to the
embedding is the embedding's weight already). A group with use_muon=True/False overrides all this.
"""

import re
import warnings

import torch

from dmuon.torch.layout import Sharded

_EMBEDDING_COMPONENT = re.compile(r"^emb|_emb")
_EMBEDDING_NAMES = {"wte", "wpe", "shared"}
_HEAD_NAMES = {"head", "lm_head", "classifier", "score", "cls"}
_HEAD_MODULE_NAMES = {"output", "decoder"}
_TOKEN_NAME = re.compile(r"tokens?$")

# Hyper-parameters a group may set, per kind, with the DMuon keyword each defaults to.
MUON_KEYS = {"lr": "lr", "momentum": "momentum", "nesterov": "nesterov", "weight_decay": "weight_decay"}
ADAMW_KEYS = {"lr": "adamw_lr", "betas": "adamw_betas", "eps": "adamw_eps", "weight_decay": "adamw_weight_decay"}


def is_muon_by_default(name, global_shape):
    """The routing rule of this module's docstring, by name and shape."""
    if len(global_shape) < 2:
        return False
    parts = name.split(".")
    embedding = any(_EMBEDDING_COMPONENT.search(p) or p in _EMBEDDING_NAMES for p in parts)
    table = any("bias" in p for p in parts) or _TOKEN_NAME.search(parts[-1])
    head = any(p in _HEAD_NAMES for p in parts) or (len(parts) > 1 and parts[-2] in _HEAD_MODULE_NAMES)
    return not (embedding or table or head)


def module_groups(model):
    """DMuon(model)'s param groups: model.named_parameters() routed by name (is_muon_by_default) and
    by module type (embeddings and the output head to AdamW): [{"params": [(name, p)], "use_muon": bool}]."""
    modules = list(model.modules())
    embeddings = [m for m in modules if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))]
    adamw = {id(m.weight) for m in embeddings}
    if embeddings:
        vocab = max(m.num_embeddings for m in embeddings)
        heads = [m for m in modules if isinstance(m, torch.nn.Linear) and m.out_features == vocab]
        if heads and not any(id(m.weight) in adamw for m in heads):
            adamw.add(id(heads[-1].weight))
    muon, other = [], []
    for name, p in model.named_parameters():
        name = _without_compile_prefix(name)
        to_muon = id(p) not in adamw and is_muon_by_default(name, tuple(p.shape))
        (muon if to_muon else other).append((name, p))
    return [{"params": members, "use_muon": kind} for kind, members in ((True, muon), (False, other)) if members]


def _without_compile_prefix(name):
    """A parameter's name as the model's own: torch.compile's wrapper adds "_orig_mod." (DCP drops it too),
    so a compiled and an uncompiled model name (and checkpoint) their parameters alike."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _named(items, group_index):
    """([(name, tensor or Sharded)], the names made up here) from a list of tensors, Sharded or
    (name, ...) pairs."""
    if isinstance(items, (torch.Tensor, Sharded)):
        items = [items]
    out, made_up = [], set()
    for i, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            out.append((_without_compile_prefix(item[0]), item[1]))
        else:
            out.append((f"group{group_index}.param{i}", item))
            made_up.add(out[-1][0])
    return out, made_up


def _global_shape(param):
    return tuple(param.global_shape) if isinstance(param, Sharded) else tuple(param.shape)


def split_groups(params, defaults, first_group=0, warn_unnamed=False):
    """[{"use_muon": bool, "named": [(name, param)], hyper-parameters...}] from DMuon's `params`.

    A user group's "lr"/"momentum"/"nesterov"/"weight_decay" apply to its Muon parameters, its
    "adamw_lr"/"adamw_betas"/"adamw_eps"/"adamw_weight_decay" to its AdamW ones; a group with
    use_muon=False may also spell those "lr", "betas", "eps", "weight_decay". A group without
    use_muon is split by is_muon_by_default (empty halves are dropped). Groups are numbered from
    first_group in made-up names ("group3.param0") and messages. warn_unnamed: warn when a matrix
    without a name is routed by shape alone.
    """
    entries = list(params)
    if not entries:
        raise ValueError("DMuon got an empty parameter list")
    user_groups = entries if all(isinstance(e, dict) for e in entries) else [{"params": entries}]
    out = []
    for g, group in enumerate(user_groups, start=first_group):
        if "params" not in group:
            raise ValueError(f"DMuon: param group {g} has no 'params'")
        unknown = set(group) - {"params", "use_muon"} - set(MUON_KEYS) - set(ADAMW_KEYS.values()) - {"betas", "eps"}
        if unknown:
            raise ValueError(f"DMuon: param group {g} has unknown keys {sorted(unknown)}")
        named, made_up = _named(group["params"], g)
        use_muon = group.get("use_muon")
        if use_muon is None:
            if warn_unnamed and any(n in made_up and len(_global_shape(p)) >= 2 for n, p in named):
                warnings.warn("DMuon: parameters without names are routed by shape alone, so embeddings and the "
                              "output head go to Muon with the hidden matrices; pass model.named_parameters() or "
                              "the model itself (DMuon(model)) to send them to AdamW", stacklevel=4)
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
