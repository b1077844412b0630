"""DMuon inside Lightning (issue 43): a LightningModule over a tiny Qwen2ForCausalLM from a config (random
init, nothing downloaded) whose configure_optimizers returns DMuon and a per-step LR schedule, trained by
lightning.Trainer under DDPStrategy and ModelParallelStrategy (FSDP2: fully_shard in configure_model),
the latter also with owner-held matrices (hold_on_owners in configure_model, before fully_shard), and
ModelParallelStrategy with tensor parallelism over every rank (data_parallel_size 1: configure_model applies
the model's own base_model_tp_plan with torch's parallelize_module on the "tensor_parallel" mesh, then
fully_shard on "data_parallel"; owner-held: hold_on_owners between the two, each TP slice on its owner's TP
group), in both modes; a TP group's ranks read the same rows. Each
run trains one epoch (2 steps), saves a checkpoint (DDP: rank 0's torch.save; ModelParallelStrategy:
a distributed checkpoint through DCP), and a new Trainer and module resume from it for a second epoch.
Every step's loss (the mean over the ranks) and the final weights equal the plain loop in one process
(DMuon over a process group of one rank) on the same batches, within framework_runs.TOLERANCE.

Run: PYTHONPATH=build/python:tests/python python tests/python/run_ranks.py --nproc 2 --timeout 400 -- \
    tests/python/torch_lightning_test.py DIR
"""

import pathlib
import sys

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dmuon.torch import DMuon, hold_on_owners
from framework_runs import MAX_NORM, OPTIM, PER_RANK, compare, make_model, plain_loop, start, tokens
from rank_checks import check, finish
from rank_exit import exit_rank

EPOCHS, STEPS_PER_EPOCH = 2, 2


def schedule(step):
    return 1.0 - step / 10


def rows(data_parallel):
    return tokens(STEPS_PER_EPOCH * PER_RANK * data_parallel)


def reference(data_parallel, group):
    """The plain loop: a DistributedSampler without shuffling (fit's; Lightning's own shuffles) gives
    data-parallel rank r the rows r, r + D, ..., so step s of an epoch covers rows s·B·D to (s + 1)·B·D − 1."""
    losses, _, weights = plain_loop(list(rows(data_parallel).split(PER_RANK * data_parallel)) * EPOCHS, schedule,
                                    group)
    return losses, weights


class Qwen2Module(L.LightningModule):
    def __init__(self, mode, held_mode):
        super().__init__()
        self.mode, self.held_mode, self.losses = mode, held_mode, []
        self.model = make_model()

    def configure_model(self):
        if self.mode == "ddp" or self.held_mode is None:
            return
        mesh = self.device_mesh["data_parallel"]
        if self.mode == "tp":  # the model's own plan: q, k, v, gate, up column-wise; o, down row-wise
            styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
            parallelize_module(self.model.model, self.device_mesh["tensor_parallel"],
                               {path: styles[style]() for path, style in self.model.config.base_model_tp_plan.items()})
        ignored = hold_on_owners(self.model, mesh).params if self.held_mode else set()
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh, ignored_params=ignored)
        fully_shard(self.model, mesh=mesh, ignored_params=ignored)
        self.held_mode = None  # configured: a resumed run's module is configured anew

    def training_step(self, batch, index):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        # owner-held: torch's clipping (Lightning's gradient_clip_val) cannot read a held gradient away from
        # its owner, and under TP it stops at gradients on two meshes ("All operands in aten.stack.default must
        # have the same mesh": the TP slices' (data_parallel, tensor_parallel) and the norms' data_parallel), so
        # DMuon clips
        optimizer = DMuon(self.model, clip_grad_norm=MAX_NORM if self.trainer.gradient_clip_val is None else None,
                          **OPTIM)
        lr = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lr, "interval": "step"}}


def data_parallel(mode):
    """The data-parallel ranks of a mode (each reads its own rows)."""
    return 1 if mode == "tp" else dist.get_world_size()


def fit(mode, held_mode, epochs, checkpoint=None, save=None):
    world = dist.get_world_size()
    strategy = DDPStrategy(process_group_backend="gloo") if mode == "ddp" else ModelParallelStrategy(
        data_parallel_size=data_parallel(mode), tensor_parallel_size=world // data_parallel(mode))
    trainer = L.Trainer(accelerator="cpu", devices=dist.get_world_size(), num_nodes=1, strategy=strategy,
                        max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=None if held_mode or mode == "tp" else MAX_NORM,
                        use_distributed_sampler=False)
    module = Qwen2Module(mode, held_mode)
    dp = data_parallel(mode)
    data = rows(dp)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=dp, rank=dist.get_rank() % dp, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=PER_RANK, sampler=sampler)
    trainer.fit(module, loader, ckpt_path=checkpoint)
    if save is not None:
        trainer.save_checkpoint(save)
    losses = torch.stack(module.losses)
    dist.all_reduce(losses)
    return (losses / dist.get_world_size()).tolist(), module, trainer


def main():
    out = pathlib.Path(sys.argv[1])
    rank, world, refs = start(out, lambda world, group: {dp: reference(dp, group) for dp in (world, 1)})
    for mode, held_mode in (("ddp", False), ("fsdp2", False), ("fsdp2", True), ("tp", False), ("tp", True)):
        label = mode + (" owner-held" if held_mode else "")
        ref_losses, ref_weights = refs[data_parallel(mode)] if rank == 0 else (None, None)
        path = str(out / (label.replace(" ", "_") + ".ckpt"))
        first, _, _ = fit(mode, held_mode, 1, save=path)
        second, module, trainer = fit(mode, held_mode, EPOCHS, checkpoint=path)
        check(trainer.global_step == EPOCHS * STEPS_PER_EPOCH and len(second) == STEPS_PER_EPOCH,
              f"{label}: resumed at step {trainer.global_step - len(second)} of {trainer.global_step}")
        q = module.model.model.layers[0].self_attn.q_proj.weight
        on_tp = isinstance(q, DTensor) and "tensor_parallel" in q.device_mesh.mesh_dim_names
        held = getattr(q, "_dmuon_held", None) is not None  # under TP a held slice keeps its TP DTensor
        check(held == held_mode and (mode == "tp") == (isinstance(q, DTensor) and "tensor_parallel" in
                                                       q.device_mesh.mesh_dim_names),
              f"{label}: q_proj's weight is a {type(q).__name__} {getattr(q, 'placements', '')}, held {held}")
        weights = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            compare(label, first + second, weights, ref_losses, ref_weights)
        del module, trainer
        dist.barrier()
    return finish(f"torch_lightning_test at {world} ranks: Lightning (DDP, ModelParallelStrategy with FSDP2 and "
                  f"with TP; all-to-all and owner-held), checkpoint and resume, vs the plain loop, {EPOCHS * STEPS_PER_EPOCH} steps")


if __name__ == "__main__":
    exit_rank(main())
