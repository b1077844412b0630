"""Hugging Face Trainer + accelerate with dmuon.torch.DMuon (docs/integrations.md): a small Qwen2ForCausalLM
built from a config (nothing downloaded) trained on random tokens, under DDP (the default) or accelerate's
FSDP2 (--fsdp2), in the all-to-all mode or with owner-held matrices (--owner-held).

    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py [--fsdp2] [--owner-held] [--cpu]
    PYTHONPATH=build/python when running from the build tree.

accelerate applies FSDP on GPUs only: with --cpu and --fsdp2 it would train under DDP, so this script stops.
"""

import argparse

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainingArguments

import dmuon.torch
from dmuon.torch.frameworks import HeldTrainerMixin, held_as_module


class HeldTrainer(HeldTrainerMixin, Trainer):
    """Trainer whose gradient norm (logged, and clipped to max_grad_norm) reads held gradients on their owners."""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fsdp2", action="store_true", help="accelerate's FSDP2, every decoder layer a unit")
    parser.add_argument("--owner-held", action="store_true", help="DMuon's owner-centric mode")
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--output-dir", default="runs/hf_trainer")
    opts = parser.parse_args()

    config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    torch.manual_seed(0)  # every rank the same initial model
    model = Qwen2ForCausalLM(config)
    tokens = torch.randint(0, config.vocab_size, (256, 64), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]

    fsdp = dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}) \
        if opts.fsdp2 else {}
    args = TrainingArguments(output_dir=opts.output_dir, per_device_train_batch_size=4, max_steps=opts.steps,
                             logging_steps=1, report_to=[], save_strategy="no", use_cpu=opts.cpu,
                             ddp_backend="gloo" if opts.cpu else None, **fsdp)
    held = None
    if opts.owner_held:  # after TrainingArguments (it starts torch.distributed), before Trainer wraps the model
        held = dmuon.torch.hold_on_owners(model)
    # The optimizer line: a factory (not an Optimizer class), so Trainer passes the model itself and DMuon routes
    # the embedding and the head to AdamW by module type. Trainer's own weight-decay groups are not used.
    trainer = (HeldTrainer if held else Trainer)(
        model=model, args=args, train_dataset=data,
        optimizer_cls_and_kwargs=(lambda: dmuon.torch.DMuon, dict(lr=0.02, adamw_lr=3e-3, weight_decay=0.01)))
    if opts.fsdp2 and not trainer.is_fsdp_enabled:
        raise SystemExit("accelerate applies FSDP on GPUs only: drop --cpu, or drop --fsdp2 for DDP")
    if held is not None and opts.fsdp2:  # accelerate's fully_shard leaves the held matrices to their owners
        trainer.accelerator.state.fsdp_plugin.ignored_modules = [held_as_module(held)]
    trainer.train()
    trainer.save_model(opts.output_dir)


if __name__ == "__main__":
    main()
