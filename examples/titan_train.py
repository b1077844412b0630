"""torchtitan with dmuon.torch.DMuon (docs/integrations.md): torchtitan's debug Llama3 ("debugmodel") built on the meta
device, sharded by its parallelize_llama (FSDP2 over every rank), DMuon built by torchtitan's optimizer container
(dmuon.torch.titan.DMuonOptimizers, from a ParamGroupConfig naming "DMuon"), torchtitan's warmup-stable-decay LR
scheduler and its DCP checkpointer (a checkpoint every --interval steps in --folder; a later run resumes from the
latest, the data where it stopped: the data's position is checkpointed with the rest), trained on random tokens;
--export FILE: the full weights at the end, in torchtitan's checkpoint layout (the fused wqkv as wq, wk, wv). --owner-held: the Muon matrices held on their owners
(dmuon.torch.titan.owner_held around parallelize_llama). --tp N: tensor parallelism over N ranks by the model's own
TP plan (the sharding configs torchtitan's Trainer sets through the model config's update_from_config), FSDP2 over
the others, the loss under loss_parallel. The loop is torchtitan Trainer.train_step's, with the loss normalised by
the global token count as torchtitan's (it disables FSDP's gradient division).

    torchrun --standalone --nproc_per_node 2 examples/titan_train.py [--owner-held] [--cpu] [--tp 2] [--export FILE]
    PYTHONPATH=build/python when running from the build tree.

On the CPU (--cpu, gloo), three things torchtitan 0.3.0 does not do there, done here: its device meshes are made on
the CPU (it takes "cuda" when no accelerator is present), attention is SDPA (FlexAttention has no backward on the
CPU), and FSDP2 reduces with SUM (torchtitan's gradient divide factor 1.0 is sent as PREMUL_SUM, which gloo lacks).
"""

import argparse
import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchtitan.distributed.parallel_dims
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, ParamGroupConfig
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.sharding import set_llama3_sharding_config

from dmuon.torch.titan import DMuonOptimizers, owner_held


class RandomTokens:
    """The data: rows of random tokens from a generator of this data-parallel rank (a TP group's ranks read the same
    rows). Its position (the generator's state) is checkpointed, in torchtitan's dataloader slot (a Stateful keyed by
    the data-parallel rank, as torchtitan's own dataloader keys its state), so a resumed run reads the rows that
    follow, never the ones it trained on."""

    def __init__(self, vocab, rows, seq_len, batch_rank):
        self.shape, self.vocab, self.key = (rows, seq_len + 1), vocab, f"dp_rank_{batch_rank}"
        self.generator = torch.Generator().manual_seed(1000 + batch_rank)

    def next(self):  # (rows, seq_len + 1) token ids
        return torch.randint(0, self.vocab, self.shape, generator=self.generator)

    def state_dict(self):
        return {self.key: self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state[self.key])


class Step:
    """The step count the checkpointer saves and restores (torchtitan's Trainer passes itself)."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--owner-held", action="store_true", help="DMuon's owner-centric mode")
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallelism degree (divides the world size)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--interval", type=int, default=10, help="checkpoint every this many steps")
    parser.add_argument("--folder", default="runs/titan", help="the checkpoints' folder")
    parser.add_argument("--export", help="write the full weights here at the end (torch.save, on rank 0)")
    opts = parser.parse_args()

    dist.init_process_group("gloo" if opts.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu" if opts.cpu else f"cuda:{rank % torch.cuda.device_count()}")
    if not opts.cpu:
        torch.cuda.set_device(device)
    spec = model_registry("debugmodel")
    if opts.cpu:
        torchtitan.distributed.parallel_dims.device_type = "cpu"
        for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
            setattr(parent, attr, ScaledDotProductAttention.Config())
    if opts.owner_held:  # the one line of the owner-centric mode
        spec = dataclasses.replace(spec, parallelize_fn=owner_held(spec.parallelize_fn))
    # owner_held's spmd backend; the all-to-all mode takes any
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", tensor_parallel_degree=opts.tp)
    dist_utils.set_spmd_backend(parallelism.spmd_backend)  # as the Trainer does first
    if opts.tp > 1:  # the model's TP plan, which the Trainer sets through spec.model.update_from_config
        set_llama3_sharding_config(spec.model, enable_sp=parallelism.enable_sequence_parallel)
    training = TrainingConfig(local_batch_size=4, seq_len=128, steps=opts.steps, max_norm=1.0)
    dims = ParallelDims(dp_replicate=1, dp_shard=world // opts.tp, cp=1, tp=opts.tp, pp=1, ep=1, world_size=world,
                        spmd_backend=parallelism.spmd_backend)
    dims.build_mesh()
    batch = dims.get_optional_mesh("batch")  # the data-parallel ranks, each its own rows (None: one of them)
    batch_rank = batch.get_local_rank() if batch is not None else 0

    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(model, parallel_dims=dims, training=training, parallelism=parallelism,
                                compile_config=CompileConfig(), ac_config=None, dump_folder=".")
    if opts.cpu:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)

    # DMuon routes the parameters itself (tok_embeddings, lm_head and the norms to AdamW): one pattern for all
    optimizers = DMuonOptimizers.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="DMuon",
                                       optimizer_kwargs=dict(lr=0.02, adamw_lr=8e-4, weight_decay=0.1))],
        # owner-held: torchtitan's clip_grad_norm_ cannot read the held gradients; DMuon clips them
        optimizer_factory_kwargs_by_name={"DMuon": dict(clip_grad_norm=training.max_norm if opts.owner_held else None)},
    ).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8).build(
        optimizers=optimizers, training_steps=opts.steps)
    step = Step()
    data = RandomTokens(spec.model.vocab_size, training.local_batch_size, training.seq_len, batch_rank)
    checkpointer = CheckpointManager.Config(enable=True, folder=opts.folder, interval=opts.interval,
                                            last_save_model_only=False, initial_load_model_only=False).build(
        dataloader=data, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": step}, sd_adapter=None)
    checkpointer.load()

    while step.step < opts.steps:
        step.step += 1
        optimizers.zero_grad(set_to_none=training.disable_cuda_graphs)
        rows = data.next().to(device)
        tokens = torch.tensor(rows[:, 1:].numel(), device=device)
        if batch is not None:
            dist.all_reduce(tokens, group=batch.get_group())
        extra = {}
        if not opts.cpu:  # FlexAttention takes a block mask: each row one document, as torchtitan's post_dataloading_process
            positions = torch.arange(training.seq_len, device=device).expand(training.local_batch_size, -1)
            extra = dict(positions=positions, attention_masks=model.get_attention_masks(positions=positions))
        logits = model(rows[:, :-1], **extra)
        with loss_parallel() if opts.tp > 1 else contextlib.nullcontext():  # TP: the logits are vocabulary shards
            loss = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(), reduction="sum") / tokens
            loss.backward()
        if not opts.owner_held:
            dist_utils.clip_grad_norm_(list(model.parameters()), training.max_norm, foreach=True)
        optimizers.step()
        schedulers.step()
        checkpointer.save(step.step, last_step=step.step == opts.steps)
        loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
        if batch is not None:
            dist.all_reduce(loss, group=batch.get_group())
        if rank == 0:
            print(f"step {step.step}: loss {loss.item():.4f}, lr {schedulers.schedulers[0].get_last_lr()[0]:.4g}",
                  flush=True)
    checkpointer.close()
    if opts.export:
        # The module's own state dict with its DTensors made whole (collective; held matrices too):
        # get_model_state_dict(full_state_dict=True) fails on the fused wqkv ('FusedQKVLinear' object has no
        # attribute 'wq': its state-dict hook names wq, wk, wv), whatever the optimizer (docs/integrations.md)
        weights = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save(weights, opts.export)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
