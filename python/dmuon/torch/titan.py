"""dmuon.torch inside torchtitan (docs/integrations.md; tested with torchtitan 0.3.0). Importing this module imports
torchtitan, as qk_clip_titan.py does (QK-clip for its models); the rest of dmuon.torch does not.

- DMuonOptimizers: torchtitan's OptimizersContainer with "DMuon" in its name → class table. torchtitan 0.3.0
  resolves optimizer names in OptimizersContainer._resolve_optimizer_factory (Adam, AdamW, DistMuon) and takes a
  subclass of the container wherever it takes its Config (Trainer.Config.optimizer): give it
  DMuonOptimizers.Config(param_groups=[ParamGroupConfig(pattern=..., optimizer_name="DMuon",
  optimizer_kwargs=dict(lr=..., adamw_lr=..., ...))], optimizer_factory_kwargs_by_name={"DMuon": {...}}).
  Each param group's kwargs are DMuon's group keys (lr, adamw_lr, weight_decay, Muon's options); DMuon's
  whole-optimizer options (clip_grad_norm, ns_dtype, state_dtype, process_group, ...) go in
  optimizer_factory_kwargs_by_name["DMuon"]. implementation="fused_opt_states_bf16" (torch's Adam and AdamW
  states in bfloat16) gives DMuon state_dtype=torch.bfloat16 (Muon's momentum, NorMuon's v, AdamW's moments; a
  group's own state_dtype still wins); the other implementations change nothing. The keys torchtitan adds to every
  group ("param_names", "fused", "foreach") are taken: the names name the tensors, the kernel choices are ignored
  (params.py). Under pipeline parallelism (one model part per stage; several on a rank with a looped schedule such as
  Interleaved1F1B) each part's DMuon runs over its stage's ranks (stage_group), unless the kwargs name a
  process_group.
- owner_held(parallelize_fn): a ModelSpec.parallelize_fn that makes the Muon matrices owner-held
  (hold_on_owners over the data-parallel mesh torchtitan shards on; under tensor or expert parallelism once the
  model's own plans have laid it out) and runs parallelize_fn, whose fully_shard calls leave them to their owners
  (frameworks.held_out_of_fully_shard). Under torchtitan's Trainer it needs dmuon.torch.titan_trainer.DMuonTrainer,
  whose train_step clips the held gradients; the Trainer itself is refused at build time.
"""

import contextlib
import dataclasses
import inspect
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from torchtitan.components.optimizer import OptimizersContainer

from dmuon.torch.arguments import state_dtype_value
from dmuon.torch.frameworks import held_out_of_fully_shard
from dmuon.torch.held.hold import adopt_replaced, hold_on_owners
from dmuon.torch.dtensors import is_dtensor
from dmuon.torch.optimizer import DMuon
from dmuon.torch.params import module_groups
from dmuon.torch.torch_private import concatenated_mesh


class DMuonOptimizers(OptimizersContainer):
    """OptimizersContainer that builds "DMuon" too (the module's text)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """OptimizersContainer.Config, built as DMuonOptimizers (torchtitan wires build() to the declaring class)."""

    @staticmethod
    def _resolve_optimizer_factory(name):
        return DMuon if name == "DMuon" else OptimizersContainer._resolve_optimizer_factory(name)

    def __init__(self, config, *, model_parts):
        dmuon = any(g.optimizer_name == "DMuon" for g in config.param_groups)
        for model in model_parts:  # as DMuon(model): parameters that .to_empty() made after owner_held get their marks
            adopt_replaced(model)
        kwargs = config.optimizer_factory_kwargs_by_name.get("DMuon", {})
        if dmuon and config.implementation == "fused_opt_states_bf16":  # as torch's AdamW: its states in bfloat16
            if state_dtype_value(kwargs.get("state_dtype", torch.bfloat16), "dmuon.torch.titan") != "bfloat16":
                raise ValueError(f"dmuon.torch.titan: optimizer.implementation='fused_opt_states_bf16' keeps DMuon's "
                                 f"states in bfloat16, but its kwargs ask for state_dtype={kwargs['state_dtype']!r}")
            kwargs = {**kwargs, "state_dtype": torch.bfloat16}
        group = stage_group(model_parts) if dmuon and "process_group" not in kwargs else None
        if group is not None:  # pipeline stages: each stage's DMuon over its own ranks
            if kwargs.get("clip_grad_norm"):
                raise ValueError("dmuon.torch.titan: DMuon's clip_grad_norm under pipeline parallelism would clip "
                                 "each stage by its own stage's norm; torchtitan's training.max_norm clips by the "
                                 "norm over every stage")
            kwargs = {**kwargs, "process_group": group}
        if dmuon:
            config = dataclasses.replace(config, optimizer_factory_kwargs_by_name={
                **config.optimizer_factory_kwargs_by_name, "DMuon": kwargs})
        super().__init__(config, model_parts=model_parts)
        self.stage_group = group  # the pipeline stage's process group its DMuons run over, None without PP


def stage_group(model_parts):
    """The process group of the ranks holding this rank's pipeline stages (the ranks of their parameters' meshes and
    owner-held groups: a stage's data-parallel and tensor-parallel ranks; this rank alone where they are plain
    tensors), or None where that is every rank (no pipeline parallelism). Collective over every rank
    (group_of_ranks). ValueError where this rank's model parts are held by different ranks."""
    if not dist.is_initialized():
        return None
    held_by = []
    for model in model_parts:
        ranks = {dist.get_rank()}
        for p in model.parameters():
            if is_dtensor(p):
                ranks.update(int(r) for r in p.device_mesh.mesh.flatten().tolist())
            held = getattr(p, "_dmuon_held", None)
            if held is not None:  # an owner-held matrix: the ranks of its group
                ranks.update(dist.get_process_group_ranks(held.process_group))
        held_by.append(tuple(sorted(ranks)))
    if len(set(held_by)) > 1:
        raise ValueError(f"dmuon.torch.titan: rank {dist.get_rank()}'s model parts are held by different ranks "
                         f"{sorted(set(held_by))}; DMuon takes the stages of one rank set")
    return group_of_ranks(held_by[0] if held_by else (dist.get_rank(),))


def group_of_ranks(ranks):
    """The process group of `ranks` (this rank's pipeline stage's, sorted), None where they are every rank.
    Collective over every rank: each names its own set (ValueError on every rank where two stages' sets overlap);
    each stage's group is then made by its members alone (torch's local synchronization), so that the stages'
    own groups (the held hooks', groups.py) never pair up across stages."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tuple(ranks))
    stages = sorted(set(everyone))
    if stages == [tuple(range(dist.get_world_size()))]:
        return None
    if len({r for s in stages for r in s}) != sum(len(s) for s in stages):
        raise ValueError(f"dmuon.torch.titan: the pipeline stages' rank sets {stages} overlap")
    return dist.new_group(list(ranks), use_local_synchronization=True)


def is_tp_slice(p):
    """Whether p is a matrix tensor parallelism sharded (a Shard placement on its 1-D mesh; not an expert stack,
    which TP splits within its experts)."""
    return is_dtensor(p) and p.dim() == 2 and p.device_mesh.ndim == 1 and p.placements[0].is_shard()


def is_ep_slice(p):
    """Whether p is an (E, m, n) expert stack expert parallelism sharded by whole experts (Shard(0), 1-D mesh)."""
    return is_dtensor(p) and p.dim() == 3 and p.device_mesh.ndim == 1 and p.placements[0] == Shard(0)


def owner_held(parallelize_fn):
    """parallelize_fn (a torchtitan ModelSpec.parallelize_fn, e.g. parallelize_llama) with the Muon matrices
    held on their owners: spec = dataclasses.replace(spec, parallelize_fn=owner_held(spec.parallelize_fn)).
    Data parallelism (FSDP2, or HSDP with data_parallel_replicate_degree > 1) on
    parallelism.spmd_backend="partial_dtensor", in pipeline stages (each stage's matrices held on its own
    data-parallel ranks), under tensor parallelism (each TP slice held on the owner's TP group; a matrix TP
    leaves replicated, DeepSeek-V3's latent down-projection wkv_a, and an expert stack TP splits within its
    experts stay with FSDP2 and DMuon's all-to-all mode) or expert parallelism (each expert stack's EP slice held
    on the owner's EP group over the expert-FSDP mesh, the other matrices over the data-parallel mesh; both
    together: a hold_on_owners call each). Under TP or EP the matrices are held between the model's
    Module.parallelize, which applies those plans, and the parallelize function's fully_shard calls. Other settings
    are refused by name."""

    def parallelize(model, *, parallel_dims, parallelism, **kwargs):
        _refuse_unclipping_trainer(kwargs.get("training"))
        refused = [f"parallelism.{name}={value!r}" for name, value, ok in (
            ("spmd_backend", parallelism.spmd_backend, parallelism.spmd_backend == "partial_dtensor"),
            ("context_parallel_degree", parallel_dims.cp, parallel_dims.cp == 1)) if not ok]
        if refused:
            raise ValueError(f"dmuon.torch.titan.owner_held: {', '.join(refused)} is not supported (owner-held "
                             "matrices are tested under data, tensor, expert and pipeline parallelism, "
                             "spmd_backend='partial_dtensor')")
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        mesh = parallel_dims.get_mesh(names)  # under pipeline parallelism: the stage's, over its own ranks
        tp_mesh = parallel_dims.get_mesh("tp") if parallel_dims.tp > 1 else None
        stage = mesh if tp_mesh is None else concatenated_mesh([mesh, tp_mesh])  # the stage's (dp, tp) grid
        if stage is None:
            raise ValueError("dmuon.torch.titan.owner_held: this torch cannot join the data-parallel and TP meshes "
                             "(DeviceMesh._concatenate) that the held TP slices live on")
        group = group_of_ranks(sorted(int(r) for r in stage.mesh.flatten().tolist()))
        if parallel_dims.tp == 1 and parallel_dims.ep == 1:
            with held_out_of_fully_shard(model, hold_on_owners(model, mesh, process_group=group)):
                return parallelize_fn(model, parallel_dims=parallel_dims, parallelism=parallelism, **kwargs)
        with contextlib.ExitStack() as held_out:
            apply_plans, planned = model.parallelize, []

            def parallelize_then_hold(dims):
                apply_plans(dims)
                planned.append(True)
                for held in _hold_after_plans(model, parallel_dims, mesh, group):
                    held_out.enter_context(held_out_of_fully_shard(model, held))

            model.parallelize = parallelize_then_hold
            try:
                result = parallelize_fn(model, parallel_dims=parallel_dims, parallelism=parallelism, **kwargs)
            finally:
                del model.parallelize
            if not planned:
                raise ValueError("dmuon.torch.titan.owner_held: the parallelize function never called the model's "
                                 "parallelize() (torchtitan's tensor and expert parallelism) under "
                                 f"tensor_parallel_degree={parallel_dims.tp}, expert_parallel_degree="
                                 f"{parallel_dims.ep}: nothing was held")
            return result

    return parallelize


def held_parameters(model):
    """The owner-held parameters of `model` (those hold_on_owners marked: the owner's master, a placeholder
    elsewhere)."""
    return [p for p in model.parameters() if getattr(p, "_dmuon_held", None) is not None]


def _refuse_unclipping_trainer(training):
    """ValueError where torchtitan's Trainer.__init__ is on this call's stack for a Trainer that does not clip
    held gradients (not dmuon.torch.titan_trainer.DMuonTrainer): its train_step would stop at step 1 in torch's
    norm. `training`: the TrainingConfig the parallelize function was given (its max_norm)."""
    trainer_module = sys.modules.get("torchtitan.trainer")
    if trainer_module is None:  # not imported: no Trainer is running
        return
    init = inspect.unwrap(trainer_module.Trainer.__init__).__code__
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not init:
        frame = frame.f_back
    trainer = None if frame is None else frame.f_locals.get("self")
    if trainer is None or getattr(trainer, "clips_held_matrices", False):
        return
    max_norm = getattr(training, "max_norm", None)
    raise ValueError(f"dmuon.torch.titan.owner_held: torchtitan's {type(trainer).__qualname__}.train_step clips the "
                     f"gradients to training.max_norm={max_norm} with torch's total norm, which cannot read the "
                     "owner-held matrices' gradients (it would stop at step 1: aten._foreach_norm got mixed "
                     "torch.Tensor and DTensor); return dmuon.torch.titan_trainer.DMuonTrainer.Config(...) instead "
                     "of Trainer.Config(...) from the config function: its train_step clips them with "
                     "dmuon.torch.clip_grad_norm_, the single-process norm")


def _hold_after_plans(model, parallel_dims, mesh, group):
    """hold_on_owners' calls on a model its TP or EP plan has laid out (mesh: the data-parallel mesh; group: the
    stage's process group): [HeldMatrices]."""
    muon = {n for g in module_groups(model) if g["use_muon"] for n, _ in g["params"]}
    if parallel_dims.ep == 1:
        return [hold_on_owners(model, mesh, process_group=group, predicate=lambda n, p: n in muon and is_tp_slice(p))]
    experts = {n for n, p in model.named_parameters() if n in muon and is_ep_slice(p)}
    dense = {n for n, p in model.named_parameters() if n in muon and n not in experts and
             (is_tp_slice(p) if parallel_dims.tp > 1 else True)}
    # a stage's model part may have no experts (its layers dense): the same on every rank of the stage's group
    return [hold_on_owners(model, held_mesh, process_group=group, predicate=lambda n, p, names=names: n in names)
            for held_mesh, names in ((parallel_dims.get_mesh("efsdp"), experts), (mesh, dense)) if names]
