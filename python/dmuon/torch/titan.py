"""dmuon.torch inside torchtitan (docs/integrations.md; tested with torchtitan 0.3.0). Importing this module imports
torchtitan; the rest of dmuon.torch does not.

- DMuonOptimizers: torchtitan's OptimizersContainer with "DMuon" in its name → class table. torchtitan 0.3.0
  resolves optimizer names in OptimizersContainer._resolve_optimizer_factory (Adam, AdamW, DistMuon) and takes a
  subclass of the container wherever it takes its Config (Trainer.Config.optimizer): give it
  DMuonOptimizers.Config(param_groups=[ParamGroupConfig(pattern=..., optimizer_name="DMuon",
  optimizer_kwargs=dict(lr=..., adamw_lr=..., ...))], optimizer_factory_kwargs_by_name={"DMuon": {...}}).
  Each param group's kwargs are DMuon's group keys (lr, adamw_lr, weight_decay, Muon's options); DMuon's
  whole-optimizer options (clip_grad_norm, ns_dtype, state_dtype, process_group, ...) go in
  optimizer_factory_kwargs_by_name["DMuon"]. The keys torchtitan adds to every group ("param_names", "fused",
  "foreach") are taken: the names name the tensors, the kernel choices are ignored (params.py).
- owner_held(parallelize_fn): a ModelSpec.parallelize_fn that makes the Muon matrices owner-held
  (hold_on_owners over the data-parallel mesh torchtitan shards on) and then runs parallelize_fn, whose
  fully_shard calls leave them to their owners (frameworks.held_out_of_fully_shard).
"""

import dataclasses

from torchtitan.components.optimizer import OptimizersContainer

from dmuon.torch.frameworks import held_out_of_fully_shard
from dmuon.torch.held.hold import hold_on_owners
from dmuon.torch.optimizer import DMuon


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
        if dmuon and config.implementation == "fused_opt_states_bf16":
            raise ValueError("dmuon.torch.titan: optimizer.implementation='fused_opt_states_bf16' makes bfloat16 "
                             "states for torch's Adam and AdamW only; for DMuon's, give "
                             "optimizer_factory_kwargs_by_name={'DMuon': {'state_dtype': torch.bfloat16}} and "
                             "another implementation")
        if dmuon and len(model_parts) > 1:
            raise ValueError(f"dmuon.torch.titan: {len(model_parts)} model parts on this rank (pipeline "
                             "parallelism, parallelism.pipeline_parallel_degree > 1): DMuon over pipeline stages "
                             "is not supported")
        for model in model_parts:  # as DMuon(model): parameters that .to_empty() made after owner_held get their marks
            for schedule in model.__dict__.get("_dmuon_held_schedules", ()):
                schedule.adopt()
        super().__init__(config, model_parts=model_parts)


def owner_held(parallelize_fn):
    """parallelize_fn (a torchtitan ModelSpec.parallelize_fn, e.g. parallelize_llama) with the Muon matrices
    held on their owners first: spec = dataclasses.replace(spec, parallelize_fn=owner_held(spec.parallelize_fn)).
    Data parallelism only (FSDP2, or HSDP with data_parallel_replicate_degree > 1) on
    parallelism.spmd_backend="partial_dtensor"; other settings are refused by name."""

    def parallelize(model, *, parallel_dims, parallelism, **kwargs):
        refused = [f"parallelism.{name}={value!r}" for name, value, ok in (
            ("spmd_backend", parallelism.spmd_backend, parallelism.spmd_backend == "partial_dtensor"),
            ("tensor_parallel_degree", parallel_dims.tp, parallel_dims.tp == 1),
            ("context_parallel_degree", parallel_dims.cp, parallel_dims.cp == 1),
            ("pipeline_parallel_degree", parallel_dims.pp, parallel_dims.pp == 1),
            ("expert_parallel_degree", parallel_dims.ep, parallel_dims.ep == 1)) if not ok]
        if refused:
            raise ValueError(f"dmuon.torch.titan.owner_held: {', '.join(refused)} is not supported (owner-held "
                             "matrices are tested under data parallelism alone, spmd_backend='partial_dtensor')")
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        held = hold_on_owners(model, parallel_dims.get_mesh(names))
        with held_out_of_fully_shard(model, held):
            return parallelize_fn(model, parallel_dims=parallel_dims, parallelism=parallelism, **kwargs)

    return parallelize

