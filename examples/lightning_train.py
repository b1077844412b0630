"""Lightning with dmuon.torch.DMuon (docs/integrations.md): a LightningModule over a small Qwen2ForCausalLM built
from a config (nothing downloaded) trained on random tokens, under DDPStrategy (the default) or
ModelParallelStrategy (--fsdp2: fully_shard in configure_model), in the all-to-all mode or with owner-held
matrices (--owner-held, FSDP2 only here), then a checkpoint (--checkpoint PATH; ModelParallelStrategy writes a
distributed one through DCP) from which a later run resumes (--resume).

    torchrun --standalone --nproc_per_node 2 examples/lightning_train.py [--fsdp2 [--owner-held]] [--cpu]
    PYTHONPATH=build/python when running from the build tree.
"""

import argparse
import os

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from transformers import Qwen2Config, Qwen2ForCausalLM

import dmuon.torch

MAX_NORM = 1.0


class Qwen2Module(L.LightningModule):
    def __init__(self, fsdp2, owner_held):
        super().__init__()
        self.fsdp2, self.owner_held = fsdp2, owner_held
        torch.manual_seed(0)  # every rank the same initial model
        self.model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False))

    def configure_model(self):
        if not self.fsdp2:
            return
        mesh = self.device_mesh["data_parallel"]
        # owner-held: hold_on_owners before fully_shard, which leaves the held matrices out (ignored_params)
        ignored = dmuon.torch.hold_on_owners(self.model, mesh).params if self.owner_held else set()
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh, ignored_params=ignored)
        fully_shard(self.model, mesh=mesh, ignored_params=ignored)

    def training_step(self, batch, index):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        # Held gradients cannot be clipped by Lightning's gradient_clip_val (torch's clipping reads them on every
        # rank): DMuon clips them itself (clip_grad_norm), with the same global norm.
        optimizer = dmuon.torch.DMuon(self.model, lr=0.02, adamw_lr=3e-3, weight_decay=0.01,
                                      clip_grad_norm=MAX_NORM if self.owner_held else None)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.1, 1.0 - step / 1000))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fsdp2", action="store_true", help="ModelParallelStrategy: FSDP2 over every rank")
    parser.add_argument("--owner-held", action="store_true", help="DMuon's owner-centric mode (with --fsdp2)")
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--checkpoint", default="runs/lightning.ckpt")
    parser.add_argument("--resume", action="store_true", help="resume from --checkpoint")
    opts = parser.parse_args()
    if opts.owner_held and not opts.fsdp2:
        raise SystemExit("--owner-held goes with --fsdp2 here (DDP's checkpoints are rank 0's alone)")

    devices = int(os.environ.get("WORLD_SIZE", 1))
    strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1) if opts.fsdp2 \
        else DDPStrategy(process_group_backend="gloo" if opts.cpu else "nccl")
    trainer = L.Trainer(accelerator="cpu" if opts.cpu else "gpu", devices=devices, strategy=strategy,
                        max_epochs=opts.epochs, logger=False, enable_checkpointing=False,
                        gradient_clip_val=None if opts.owner_held else MAX_NORM)
    tokens = torch.randint(0, 512, (64, 64), generator=torch.Generator().manual_seed(0))
    trainer.fit(Qwen2Module(opts.fsdp2, opts.owner_held), torch.utils.data.DataLoader(tokens, batch_size=4),
                ckpt_path=opts.checkpoint if opts.resume else None)
    trainer.save_checkpoint(opts.checkpoint)


if __name__ == "__main__":
    main()
