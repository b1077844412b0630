"""DMuon inside Hugging Face Trainer + accelerate (issue 43): a tiny Qwen2ForCausalLM from a config
(random init, nothing downloaded) trained by Trainer for a few steps with DMuon under accelerate's DDP
and FSDP2, in the all-to-all mode and with owner-held matrices, against a plain loop in one process
with the same optimizer (DMuon over a process group of one rank) on the same batches: every logged
loss and the exported weights within framework_runs.TOLERANCE; the exported safetensors complete (every
key of a fresh model): Trainer.save_model but under FSDP2 in the all-to-all mode (train() says why). DMuon is built by Trainer itself (optimizer_cls_and_kwargs with a factory,
so DMuon gets the model and routes embeddings and head to AdamW) before accelerate shards the model:
under FSDP2 accelerate then switches the optimizer's parameters to the sharded ones, which DMuon follows
at its first step (without that, DMuon went on updating the unsharded tensors: losses 4.5727, 4.5568,
4.5802 against the plain loop's 4.5727, 4.5682, 4.5784). A replacement after an update is refused.

accelerate applies FSDP only on accelerators (its AcceleratorState keeps FSDP for the MULTI_GPU family):
on a CPU job it silently trains under DDP. CpuFsdpTrainer turns accelerate's own FSDP2 path on for the
CPU; everything after it (fully_shard per decoder layer, the parameter switch in the optimizer) is
accelerate's and transformers' code, unchanged. Owner-held: hold_on_owners before Trainer, HeldTrainerMixin for the gradient norm, held_as_module in accelerate's ignored_modules.

Run: PYTHONPATH=build/python:tests/python python tests/python/run_ranks.py --nproc 2 --timeout 400 -- \
    tests/python/torch_hf_trainer_test.py DIR
"""

import pathlib
import sys

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from transformers import Trainer, TrainingArguments

from dmuon.torch import DMuon, hold_on_owners
from dmuon.torch.frameworks import HeldTrainerMixin, held_as_module
from framework_runs import MAX_NORM, OPTIM, PER_RANK, compare, make_model, plain_loop, start, tokens
from rank_checks import check, finish
from rank_exit import exit_rank

STEPS = 3


def dataset(world):
    return [{"input_ids": t, "labels": t} for t in tokens(STEPS * PER_RANK * world)]


class CpuFsdpTrainer(Trainer):
    """Trainer with accelerate's FSDP2 on a CPU job (module docstring)."""

    def create_accelerator_and_postprocess(self):
        AcceleratorState._reset_state(reset_partial_state=False)  # one Trainer after another in this process
        super().create_accelerator_and_postprocess()
        if self.args.fsdp_plugin_args is not None and not self.is_fsdp_enabled:
            state = self.accelerator.state
            state.distributed_type = DistributedType.FSDP
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = True


def reference(world, group):
    """The plain loop: Trainer's sequential sampler gives rank r the r-th PER_RANK rows of each step's
    PER_RANK·world, so a step covers the next PER_RANK·world rows; Trainer's "linear" schedule. Then a
    replacement of a parameter after an update is refused."""
    rows = tokens(STEPS * PER_RANK * world)
    losses, optimizer, weights = plain_loop(rows.split(PER_RANK * world), lambda s: 1.0 - s / STEPS, group)
    swapped = optimizer.param_groups[0]["params"][0]
    optimizer.param_groups[0]["params"][0] = torch.nn.Parameter(swapped.detach().clone())
    try:
        optimizer.step()
        check(False, "DMuon took a parameter replaced after its first update")
    except ValueError as e:
        check("replaced after its first update" in str(e), f"the refusal of a late replacement says {e}")
    return losses, weights


class CpuFsdpHeldTrainer(HeldTrainerMixin, CpuFsdpTrainer):
    """Trainer whose gradient norm is dmuon.torch.clip_grad_norm_'s (owner-held matrices)."""


def train(mode, held_mode, out):
    model = make_model()
    # accelerate then moves the model to its CPU device "cpu:0" (placeholders once took that index, and every
    # working copy was dropped between forward and backward: RuntimeError: setStorage ... of size 0)
    held = hold_on_owners(model) if held_mode else None
    fsdp = dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}) \
        if mode == "fsdp2" else {}
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=PER_RANK, max_steps=STEPS,
                             logging_steps=1, report_to=[], save_strategy="no", ddp_backend="gloo", use_cpu=True,
                             lr_scheduler_type="linear", max_grad_norm=MAX_NORM,
                             dataloader_drop_last=True, disable_tqdm=True, train_sampling_strategy="sequential",
                             **fsdp)
    trainer = (CpuFsdpHeldTrainer if held_mode else CpuFsdpTrainer)(model=model, args=args, train_dataset=dataset(dist.get_world_size()),
                             optimizer_cls_and_kwargs=(lambda: DMuon, OPTIM))
    if held_mode and mode == "fsdp2":
        trainer.accelerator.state.fsdp_plugin.ignored_modules = [held_as_module(held)]
    trainer.train()
    if held_mode:  # the held matrices stayed out of FSDP2 and DDP, whole on their owners
        registered = dict(trainer.model.named_parameters())
        check(all(not isinstance(registered[n], DTensor) for n in held.names) and len(held.names) == 14,
              f"{mode} owner-held: held matrices {held.names}, sharded by FSDP2 or missing")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if mode == "fsdp2" and not held_mode:  # accelerate 1.16's get_state_dict (broadcast_from_rank0=True) gives
        # DTensors on a CPU job, AdamW's run too, which safetensors cannot write: torch's full state dict here
        weights = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            trainer.model.save_pretrained(str(out), state_dict=weights)
    else:
        trainer.save_model(str(out))  # owner-held: HeldTrainerMixin's
    return losses, trainer


def main():
    out = pathlib.Path(sys.argv[1])
    rank, world, (ref_losses, ref_weights) = start(out, reference)
    for mode, held_mode in (("ddp", False), ("fsdp2", False), ("ddp", True), ("fsdp2", True)):
        label = mode + (" owner-held" if held_mode else "")
        run_out = out / label.replace(" ", "_")
        if rank == 0:
            print(f"{label}: training", flush=True)
        losses, trainer = train(mode, held_mode, run_out)
        dist.barrier()
        if rank == 0:
            compare(label, losses, load_file(run_out / "model.safetensors"), ref_losses, ref_weights)
        del trainer
        dist.barrier()
    return finish(f"torch_hf_trainer_test at {world} ranks: Trainer + accelerate (DDP, FSDP2; all-to-all and "
                  f"owner-held) vs the plain loop, {STEPS} steps")


if __name__ == "__main__":
    exit_rank(main())
