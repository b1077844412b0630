"""What training frameworks need from dmuon.torch beyond DMuon itself, for owner-held matrices
(dmuon.torch.hold_on_owners) under Hugging Face Trainer and accelerate, and torchtitan
(docs/integrations.md). Nothing here imports a framework.

- accelerate's FSDP2 preparation calls fully_shard itself, with no ignored_params argument; it takes
  FullyShardedDataParallelPlugin.ignored_modules and leaves out every parameter of those modules. The
  held matrices' own modules hold biases too, which FSDP2 must still shard: held_as_module gives
  accelerate one module of the held matrices alone.
- torchtitan's parallelize functions call fully_shard themselves, with no ignored_params either:
  held_out_of_fully_shard unregisters the held matrices from their modules while such a function runs.
- Trainer measures (and clips) the gradient norm with torch.nn.utils.clip_grad_norm_, which cannot read
  a held gradient away from its owner (HeldElsewhereError), and save_model reads the state dict on the
  main process alone, where the matrices other ranks own are placeholders: HeldTrainerMixin makes Trainer
  use dmuon.torch.clip_grad_norm_ (the single-process norm on every rank) and export the full state dict
  (collective: Trainer calls save_model on every rank).
- accelerate's FSDP2 preparation (Accelerator.prepare(model, optimizer), as Trainer calls it with the optimizer
  built before the model is sharded) puts each parameter's sharded DTensor in the optimizer's param_groups in
  its place (fsdp2_switch_optimizer_parameters): replaced_parameters tells DMuon what to follow.
"""

import contextlib

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from dmuon.torch.clip import clip_grad_norm_
from dmuon.torch.params import MUON_ONLY, without_compile_prefix


def held_as_module(held):
    """A module outside the model whose parameters are exactly held.params (hold_on_owners' result): set
    `fsdp_plugin.ignored_modules = [held_as_module(held)]` before Trainer.train() or
    Accelerator.prepare(), so accelerate's fully_shard leaves the held matrices to their owners."""
    return torch.nn.ParameterList(sorted(held.params, key=id))


@contextlib.contextmanager
def held_out_of_fully_shard(model, held):
    """Inside the block, the held matrices of `model` (held: hold_on_owners' result) are not registered
    on their modules, so a fully_shard that framework code calls without ignored_params (torchtitan's
    parallelize functions) leaves them to their owners, as ignored_params=held.params would. On exit
    each is registered again in its place, beside what fully_shard made of its module's other
    parameters."""
    ids = {id(p) for p in held.params}
    saved = []  # (module, its _parameters before the block)
    for module in model.modules():
        names = [k for k, p in module._parameters.items() if p is not None and id(p) in ids]
        if names:
            saved.append((module, dict(module._parameters)))
            for k in names:
                del module._parameters[k]
    try:
        yield
    finally:
        for module, before in saved:
            now = dict(module._parameters)
            module._parameters.clear()
            module._parameters.update({k: now.get(k, p) for k, p in before.items()})
            module._parameters.update({k: p for k, p in now.items() if k not in before})


class HeldTrainerMixin:
    """Mixed in before transformers.Trainer (`class MyTrainer(HeldTrainerMixin, Trainer)`): the gradient
    norm Trainer logs and clips to args.max_grad_norm is dmuon.torch.clip_grad_norm_'s, and save_model
    writes the full state dict (torch.distributed.checkpoint's get_model_state_dict, whole on the main
    process). Overrides Trainer's save_model and its private _clip_grad_norm and _get_grad_norm, and calls
    its _save (transformers 5.24, the pinned version)."""

    def save_model(self, output_dir=None, _internal_call=False):
        weights = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.args.should_save:
            self._save(output_dir or self.args.output_dir, state_dict=weights)

    def _clip_grad_norm(self, model):
        return clip_grad_norm_(model.parameters(), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return clip_grad_norm_(model.parameters(), float("inf")) if grad_norm is None else grad_norm


def replaced_parameters(param_groups, names, tracked, model, updated):
    """What DMuon follows of a framework that replaced the tensors in its param_groups after construction
    (accelerate's FSDP2 preparation): None while they hold the tensors it tracks (`tracked`, its parameter order;
    `names` theirs); else its groups as DMuon's `params` takes them, with the new tensors under the old names, which
    DMuon then describes and plans as if it had been built over them. Built from the model (`model`: DMuon(model)'s,
    else None), the tensors the model registers under those names: accelerate matches parameters by data pointer,
    which owner-held placeholders (no storage) do not have, so its switch puts another parameter in their place.
    After an update (`updated`) the state held for the old tensors would be lost: ValueError naming the fix."""
    current = [p for g in param_groups for p in g["params"]]
    unique = list({id(p): p for p in current}.values())  # a parameter repeated in more groups once
    if len(unique) == len(tracked) and all(p is t for p, t in zip(unique, tracked)):
        return None  # the tracked parameters, some perhaps repeated in more groups (as torch.optim allows)
    if model is not None and len(current) == len(tracked):
        registered = {without_compile_prefix(n): p for n, p in model.named_parameters()}
        if all(n in registered for n in names):
            current = [registered[n] for n in names]
    if len(current) != len(tracked):
        raise ValueError(f"DMuon: param_groups hold {len(current)} parameters, DMuon was built over "
                         f"{len(tracked)}; add parameters with add_param_group()")
    if updated:
        raise ValueError("DMuon: the tensors in param_groups were replaced after its first update (by a "
                         "framework wrapping the model, such as accelerate's FSDP2 preparation); build DMuon "
                         "before the model is wrapped and prepare both at once (Accelerator.prepare(model, "
                         "optimizer)), or build it over the wrapped model")
    groups, first = [], 0
    for g in param_groups:
        keys = ("lr", "weight_decay") + (MUON_ONLY if g["use_muon"] else ("betas", "eps"))
        mine = names[first:first + len(g["params"])]
        groups.append({"params": list(zip(mine, current[first:first + len(mine)])), "use_muon": g["use_muon"],
                       **{k: g[k] for k in keys}})
        first += len(g["params"])
    return groups
