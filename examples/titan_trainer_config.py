"""torchtitan's own Trainer with dmuon.torch.DMuon (docs/integrations.md, "torchtitan's Trainer"): config_registry
functions for `python -m torchtitan.train`, each torchtitan's Llama3 debug config (llama3_debugmodel) with DMuon as
its optimizer. Put this folder on PYTHONPATH and name this module:

    PYTHONPATH=examples torchrun --standalone --nproc_per_node 2 -m torchtitan.train \\
        --module titan_trainer_config --config llama3_dmuon \\
        --hf_assets_path ASSETS/tokenizer --dataloader.dataset_path ASSETS/data

(ASSETS: what examples/titan_assets.py makes, a tokenizer and a dataset of our own; torchtitan's repository has
its own in tests/assets.) Any Trainer option can follow as torchtitan's (--training.steps 20,
--parallelism.tensor_parallel_degree 2, --checkpoint.enable, --metrics.enable_tensorboard, ...).

  llama3_dmuon                  all-to-all mode: DMuon over FSDP2's DTensors (torchtitan's Trainer as it is)
  llama3_dmuon_owner_held       owner-centric mode: the Muon matrices held on their owners
                                (dmuon.torch.titan.owner_held) under dmuon.torch.titan_trainer.DMuonTrainer, whose
                                train_step clips their gradients (torchtitan's clipping cannot read them)
  llama3_dmuon_cpu, llama3_dmuon_owner_held_cpu    the same on the CPU with gloo (dmuon.torch.titan_cpu.on_cpu)
"""

import dataclasses

from torchtitan.components.optimizer import ParamGroupConfig
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from dmuon.torch.titan import DMuonOptimizers, owner_held
from dmuon.torch.titan_cpu import on_cpu
from dmuon.torch.titan_trainer import DMuonTrainer


def with_dmuon(config):
    """torchtitan's Trainer.Config with DMuon as its optimizer: one pattern for every parameter (DMuon routes
    them: tok_embeddings, lm_head and the norms to AdamW, the matrices to Muon), no activation checkpointing (not
    run with DMuon) and the spmd backend owner_held takes."""
    config.optimizer = DMuonOptimizers.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="DMuon",
                                       optimizer_kwargs=dict(lr=0.02, adamw_lr=8e-4, weight_decay=0.1))],
        optimizer_factory_kwargs_by_name={"DMuon": dict(ns_dtype="float32")})
    config.activation_checkpoint = None
    config.parallelism = dataclasses.replace(config.parallelism, spmd_backend="partial_dtensor")
    return config


def held(config):
    """The config as DMuonTrainer's, the Muon matrices held on their owners."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    config = DMuonTrainer.Config(**fields)
    config.model_spec = dataclasses.replace(config.model_spec,
                                            parallelize_fn=owner_held(config.model_spec.parallelize_fn))
    return config


def llama3_dmuon():
    return with_dmuon(llama3_debugmodel())


def llama3_dmuon_owner_held():
    return held(llama3_dmuon())


def llama3_dmuon_cpu():
    return on_cpu(llama3_dmuon())


def llama3_dmuon_owner_held_cpu():
    return on_cpu(llama3_dmuon_owner_held())
