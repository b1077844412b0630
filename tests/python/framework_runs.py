"""What the framework tests (torch_hf_trainer_test, torch_lightning_test, torch_titan_test) share: the tiny Qwen2
the first two train, the plain loop in one process they are held to, and the comparison.

The tolerance: the runs differ from the one-process loop by float32 rounding in the gradients' summation
order (ε = 1.2e-7), which Newton–Schulz (Keller's coefficients, a = 3.4445 per step, 5 steps) amplifies by
up to a^5 = 486: rtol = ε·a^5 = 5.8e-5 (as torch_hf_model_test).
"""

import torch
import torch.distributed as dist

from dmuon.torch import DMuon
from dmuon.torch.mpirun import init_process_group
from rank_checks import check

TOLERANCE = 5.8e-5
MAX_NORM = 1.0  # the gradient norms of these runs are 1.13 to 1.21: every step clips
PER_RANK, SEQ = 2, 16
OPTIM = dict(lr=0.02, adamw_lr=3e-3, weight_decay=0.01, ns_dtype="float32")  # float32 tolerances, whatever the machine
CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def make_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM  # here: torch_titan_test uses the rest without it

    torch.manual_seed(3)
    return Qwen2ForCausalLM(Qwen2Config(**CONFIG, attn_implementation="eager"))


def tokens(rows):
    gen = torch.Generator().manual_seed(9)
    return torch.randint(0, CONFIG["vocab_size"], (rows, SEQ), generator=gen)


def plain_loop(batches, schedule, group):
    """DMuon over `group` (one rank) in one process, each step one batch (all ranks' rows of that step),
    torch's clipping, LambdaLR(schedule): (losses, weights)."""
    model = make_model()
    optimizer = DMuon(model, process_group=group, **OPTIM)
    lr = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    losses = []
    for batch in batches:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        lr.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, optimizer, {k: v.detach().clone() for k, v in model.state_dict().items()}


def compare(label, losses, weights, ref_losses, ref_weights):
    """Checks a run's per-step losses and exported weights against the plain loop's."""
    check(len(losses) == len(ref_losses) and all(abs(a - b) <= TOLERANCE * abs(b) for a, b in zip(losses, ref_losses)),
          f"{label}: the framework's losses {losses}, the plain loop's {ref_losses}")
    check(set(weights) == set(ref_weights), f"{label}: exported keys {sorted(set(weights) ^ set(ref_weights))} unlike "
          "a fresh model's")
    for k, v in ref_weights.items():
        if k in weights:
            gap = (weights[k] - v).abs().max().item()
            check(gap <= TOLERANCE * max(1.0, v.abs().max().item()), f"{label}: '{k}' differs from the plain loop's "
                  f"by {gap:.3g}")
    print(f"{label}: losses {[f'{x:.6f}' for x in losses]} (plain loop {[f'{x:.6f}' for x in ref_losses]})", flush=True)


def start(out, reference):
    """Starts the ranks; rank 0 makes the folder `out` and runs reference(world, group of rank 0 alone):
    (rank, world, its (losses, weights) on rank 0, else (None, None))."""
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    alone = dist.new_group([0])  # collective: every rank makes it
    result = (None, None)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        result = reference(world, alone)
    dist.barrier()
    return rank, world, result
