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

Which 3-D parameters are stacks of experts (is_expert_stack_by_default, or DMuon's `experts`
predicate): those whose name has a component containing "expert" (experts, experts_in,
mlp.experts.w1). Every other ≥ 3-D parameter is one (out, in·k…) matrix, a convolution's filter.

Input checks follow torch.optim.Optimizer's (TypeError for a bare tensor or a non-tensor, a
FutureWarning for a set, ValueError for a non-leaf tensor or a mix of named and unnamed
parameters, a warning for a parameter repeated within a group, ValueError for one in two groups).
"""

import re
import warnings

import torch

from dmuon.torch import muon_options
from dmuon.torch.layout import Sharded

_EMBEDDING_COMPONENT = re.compile(r"^emb|_emb")
_EMBEDDING_NAMES = {"wte", "wpe", "shared"}
_HEAD_NAMES = {"head", "lm_head", "classifier", "score", "cls"}
_HEAD_MODULE_NAMES = {"output", "decoder"}
_TOKEN_NAME = re.compile(r"tokens?$")

# The hyper-parameters a group may set, and the kind of parameter each is used by. "lr" and
# "weight_decay" are every parameter's; the adamw_ keys (and torch.optim.AdamW's betas, eps) only
# AdamW's, and an AdamW parameter's adamw_lr / adamw_weight_decay take precedence over lr / weight_decay.
# Muon's options (muon_options.py) are frozen per matrix when the optimizer tracks it. "state_dtype" is every
# parameter's too: the dtype its state is stored in (arguments.state_dtype_value).
MUON_ONLY = ("momentum", "nesterov") + muon_options.KEYS
ADAMW_ONLY = ("adamw_lr", "adamw_betas", "adamw_eps", "adamw_weight_decay", "betas", "eps")
GROUP_KEYS = ("lr", "weight_decay", "state_dtype") + MUON_ONLY + ADAMW_ONLY
# Accepted in a param group and ignored: torch.optim's kernel choices, which torchtitan's OptimizersContainer puts
# in every group it builds. DMuon's AdamW is always torch's fused step and its Muon runs in dmuon's engine.
IGNORED_KEYS = ("fused", "foreach")
# DMuon's options of the whole optimizer: one owner planner, one process group, one global gradient norm.
OPTIMIZER_OPTIONS = ("balancer", "process_group", "clip_grad_norm", "nonfinite", "experts")

_SET_WARNING = ("optimizer parameters need to be organized in ordered collections, but the ordering of tensors "
                "in sets will change between runs. Please use a list instead.")
_DUPLICATE_WARNING = ("optimizer contains a parameter group with duplicate parameters; in future, this will cause "
                      "an error; see github.com/pytorch/pytorch/issues/40967 for more information")


def is_muon_by_default(name, global_shape):
    """The routing rule of this module's docstring, by name and shape."""
    if len(global_shape) < 2:
        return False
    parts = name.split(".")
    embedding = any(_EMBEDDING_COMPONENT.search(p) or p in _EMBEDDING_NAMES for p in parts)
    table = any("bias" in p for p in parts) or _TOKEN_NAME.search(parts[-1])
    head = any(p in _HEAD_NAMES for p in parts) or (len(parts) > 1 and parts[-2] in _HEAD_MODULE_NAMES)
    return not (embedding or table or head)


def is_expert_stack_by_default(name, global_shape):
    """Whether a parameter is a stack of experts (E, m, n), E matrices of m×n: a 3-D parameter with a
    name component containing "expert" (this module's docstring)."""
    return len(global_shape) == 3 and any("expert" in p.lower() for p in name.split("."))


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
        name = without_compile_prefix(name)
        to_muon = id(p) not in adamw and is_muon_by_default(name, tuple(p.shape))
        (muon if to_muon else other).append((name, p))
    return [{"params": members, "use_muon": kind} for kind, members in ((True, muon), (False, other)) if members]


def without_compile_prefix(name):
    """A parameter's name as the model's own: torch.compile's wrapper adds "_orig_mod." (DCP drops it too),
    so a compiled and an uncompiled model name (and checkpoint) their parameters alike."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _global_shape(param):
    return tuple(param.global_shape) if isinstance(param, Sharded) else tuple(param.shape)


def _check_tensor(item):
    """torch.optim's checks of one parameter: a tensor (or a dmuon.torch.Sharded) and a leaf."""
    tensor = item.local if isinstance(item, Sharded) else item
    if not isinstance(tensor, torch.Tensor):
        raise TypeError("optimizer can only optimize Tensors, but one of the params is " + torch.typename(item))
    if not (tensor.is_leaf or tensor.retains_grad):
        raise ValueError("can't optimize a non-leaf Tensor")


def _named(items, group_index, warn):
    """([(name, tensor or Sharded)], whether the user named them) from a group's "params": tensors,
    Sharded or (name, ...) pairs, all named or none (torch.optim's rule); unnamed ones get made-up
    names ("group3.param0"). A parameter repeated within the group is kept once, with torch.optim's
    warning."""
    if isinstance(items, (torch.Tensor, Sharded)):
        items = [items]
    elif isinstance(items, set):
        raise TypeError(_SET_WARNING)
    items = list(items)
    named = [isinstance(item, tuple) for item in items]
    if any(named) and not all(named):
        raise ValueError("all optimizer params should be with/without names. Some param names are missing")
    out, seen = [], set()
    for i, item in enumerate(items):
        name, param = (without_compile_prefix(item[0]), item[1]) if named[i] else (f"group{group_index}.param{i}", item)
        _check_tensor(param)
        key = id(param.local if isinstance(param, Sharded) else param)
        if key in seen:
            if warn:
                warnings.warn(_DUPLICATE_WARNING, stacklevel=5)
            continue
        seen.add(key)
        out.append((name, param))
    return out, bool(items) and all(named)


def _with_names(group, index):
    """A group's "params", named by its "param_names" where it has them (torchtitan's groups: tensors and their
    names side by side, as torch.optim keeps them in param_groups)."""
    if "param_names" not in group:
        return group["params"]
    params, names = list(group["params"]), list(group["param_names"])
    if len(names) != len(params) or any(isinstance(p, tuple) for p in params):
        raise ValueError(f"DMuon: param group {index} has 'param_names' ({len(names)}) that do not name its "
                         f"{len(params)} tensors one for one")
    return list(zip(names, params))


def _hyper(group, defaults, muon):
    """A half's hyper-parameters: the group's own value, else the optimizer's (defaults); for AdamW
    the adamw_ spelling first at each level (None in defaults: the same as lr / weight_decay)."""
    if muon:
        return {key: group.get(key, defaults[key]) for key in ("lr", "weight_decay", "state_dtype") + MUON_ONLY}

    def pick(*keys):  # the first of keys set (not None) in the group, else in defaults
        return next((v for v in (source.get(k) for source in (group, defaults) for k in keys) if v is not None), None)

    return {"lr": pick("adamw_lr", "lr"), "betas": tuple(pick("betas", "adamw_betas")),
            "eps": pick("eps", "adamw_eps"), "weight_decay": pick("adamw_weight_decay", "weight_decay"),
            "state_dtype": group.get("state_dtype", defaults["state_dtype"])}


def split_groups(params, defaults, first_group=0, warn=False, named_groups=None):
    """[{"use_muon": bool, "named": [(name, param)], "param_names": bool, hyper-parameters...}] from
    DMuon's `params` (docs/pytorch.md, "Param groups"): one group per user group, in order, except
    that a group without use_muon whose parameters are of both kinds becomes two consecutive
    groups, its Muon parameters' then its AdamW parameters' (a plain list is one user group).

    A group's "lr", "weight_decay" and "state_dtype" are every parameter's; momentum, nesterov and Muon's options
    (muon_options.KEYS: ns_steps, coeffs, algo, scale, extra_scale_factor, cautious_wd, split_heads,
    split_sizes, split_dim, variant, normuon_beta2) Muon's; adamw_lr,
    adamw_weight_decay, adamw_betas (or betas) and adamw_eps (or eps) AdamW's; "param_names" names the
    group's tensors; "fused" and "foreach" are ignored (IGNORED_KEYS). A key that none of
    the group's parameters uses, an option of the whole optimizer, or an unknown key raises
    ValueError. Groups are numbered from first_group in made-up names and messages. warn: issue the
    warnings (one rank does). named_groups: whether the optimizer's existing groups are named, for
    torch.optim's rule that all groups are named or none; None at construction, else `params` is
    add_param_group's one group, a dict as torch.optim's.
    """
    if named_groups is not None:
        if not isinstance(params, dict):
            raise TypeError(f"param_group must be a dict, but got {type(params)}")
        params = [params]
    if isinstance(params, (torch.Tensor, Sharded)):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                        "but got " + torch.typename(params))
    if isinstance(params, set) and warn:
        warnings.warn(_SET_WARNING + " This will be an error in a future release.", FutureWarning, stacklevel=4)
    entries = list(params)
    if not entries:
        raise ValueError("optimizer got an empty parameter list")
    user_groups = entries if isinstance(entries[0], dict) else [{"params": entries}]
    out = []
    for g, group in enumerate(user_groups, start=first_group):
        if not isinstance(group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(group)}")
        if "params" not in group:
            raise ValueError(f"DMuon: param group {g} has no 'params'")
        options = sorted(set(group) & set(OPTIMIZER_OPTIONS))
        if options:
            raise ValueError(f"DMuon: param group {g} sets {options}, options of the whole optimizer (one owner "
                             "planner, one process group, one global gradient norm): pass them to DMuon()")
        unknown = sorted(set(group) - {"params", "use_muon", "param_names"} - set(GROUP_KEYS) - set(IGNORED_KEYS))
        if unknown:
            raise ValueError(f"DMuon: param group {g} has unknown keys {unknown}")
        for a, b in (("betas", "adamw_betas"), ("eps", "adamw_eps")):
            if a in group and b in group:
                raise ValueError(f"DMuon: param group {g} sets both '{a}' and '{b}' (two spellings of one value)")
        named, has_names = _named(_with_names(group, g), g, warn)
        if named_groups is not None and named and has_names != named_groups:
            raise ValueError("all optimizer param groups should be with/without names. cannot add param group "
                             f"{'with' if has_names else 'without'} names to the optimizer")
        named_groups = has_names if named else named_groups
        use_muon = group.get("use_muon")
        if use_muon is None:
            if warn and not has_names and any(len(_global_shape(p)) >= 2 for _, p in named):
                warnings.warn("DMuon: parameters without names are routed by shape alone, so embeddings and the "
                              "output head go to Muon with the hidden matrices; pass model.named_parameters() or "
                              "the model itself (DMuon(model)) to send them to AdamW", stacklevel=4)
            halves = [(True, [(n, p) for n, p in named if is_muon_by_default(n, _global_shape(p))]),
                      (False, [(n, p) for n, p in named if not is_muon_by_default(n, _global_shape(p))])]
        else:
            halves = [(bool(use_muon), named)]
        halves = [(muon, members) for muon, members in halves if members]
        kinds = {muon for muon, _ in halves}
        for keys, kind, absent in ((MUON_ONLY, True, "AdamW's"), (ADAMW_ONLY, False, "Muon's")):
            unused = [k for k in keys if k in group and kind not in kinds]
            if unused and named:
                raise ValueError(f"DMuon: param group {g} sets {unused}, which none of its parameters uses "
                                 f"(they are all {absent})")
        for muon, members in halves:
            if muon:
                for name, p in members:
                    if len(_global_shape(p)) < 2:
                        raise ValueError(f"DMuon: parameter '{name}' has shape {_global_shape(p)}; Muon needs a "
                                         "matrix (put it in a group with use_muon=False)")
            out.append({"use_muon": muon, "named": members, "param_names": has_names,
                        **_hyper(group, defaults, muon)})
    return out
