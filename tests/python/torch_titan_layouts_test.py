"""DMuon inside torchtitan at 4 ranks, in three layouts: the first two on torch_titan_qk_clip_test's two models, the
third on a DeepSeek-V3 with a layer of routed experts:
  fsdp 2 x tp 2         each model laid out by its own tensor-parallel plan (the sharding configs its model config
                        sets: torch_titan_test.with_parallel_plan) and parallelize function (Module.parallelize, then
                        FSDP2 over "fsdp");
  replicate 2 x fsdp 2  HSDP (parallelism.data_parallel_replicate_degree 2): the parallelize function's fully_shard
                        over the 2-D (dp_replicate, fsdp) mesh, (Replicate(), Shard(0)) parameters; owner-held: the
                        matrices held over that mesh (an owner per shard group, its replica's copy on the other);
  fsdp 2 x tp 2, experts on efsdp 2 x ep 2
                        DeepSeek-V3's first 2 layers (the second of 8 routed experts, top 3, and shared experts) by its
                        TP and EP plans: the expert stacks (_StridedShard(0, 2), Shard(0)) on (efsdp, ep), tokens to
                        them by all-to-all; owner-held: each TP slice on its owner's TP group, each stack's EP slice on
                        its owner's EP group (two hold_on_owners calls), the router's gate (replicated over TP) left
                        to FSDP2; its losses, gradient norms and max_logits compared (bfloat16 experts: not weights).
Under TP:
  llama3    2 layers, the fused wqkv (grouped rows: a TP rank holds 2 of the 4 key-value groups, 8 of the 16 query
            heads) column-wise, wo row-wise, the feed-forward's w1, w3 column-wise and w2 row-wise, sequence
            parallel norms, the vocabulary-parallel head with loss parallelism;
  deepseek  its first layer (dense): latent attention with wq and wkv_b column-wise (8 of 16 heads a TP rank);
in both modes: all-to-all (DMuon over the (fsdp, tp) DTensors: (_StridedShard(0, 2), Shard(0)) and (Shard(0),
Shard(1))) and owner-held (dmuon.torch.titan.owner_held: each TP slice held on its owner's TP group, the data-parallel
mesh and the TP mesh joined, as torchtitan's meshes are views of one flat mesh), with titan_qk_clip (each rank
reports its own heads, found from the rows of the query weight it holds) at a tau that clips some heads, torchtitan's
CheckpointManager (DCP) saving after step 2 and a new model, optimizer, scheduler and checkpointer resuming from it.
The steps are torch_titan_test's: tokens and losses summed over the batch (data-parallel) mesh, the loss under
loss_parallel with TP (the head's logits are vocabulary shards), clipping at 1.0 (torchtitan's clip_grad_norm_;
dmuon.torch.clip_grad_norm_ when held).

Against torch_titan_qk_clip_test's one process (the unsharded model on every data-parallel rank's rows), each step's
loss, gradient norm (the one process's summed in float64) and QKClip.max_logits, and the final weights, within
framework_runs.TOLERANCE. torch_titan_pp_test runs TP within pipeline stages.

Run: PYTHONPATH=build/python:tests/python python tests/python/run_ranks.py --nproc 4 --timeout 400 -- \
    tests/python/torch_titan_layouts_test.py DIR
"""

import contextlib
import dataclasses
import pathlib
import shutil
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torchtitan.distributed import utils as dist_utils
from torchtitan.models import deepseek_v3

import dmuon.torch
from dmuon.torch.qk_clip_titan import titan_qk_clip
from framework_runs import TOLERANCE, compare, start
from rank_checks import check, finish
from rank_exit import exit_rank
from titan_cases import (MAX_NORM, PER_RANK, SAVED_AT, SCHEDULE, Case, batches, checkpointed, full_weights, held_names,
                         initial_weights, load_full, optimizer_config, parallelized, summed_loss, two_layers_sdpa)
from titan_qk_clip_cases import CASES, TAU, reference

# DeepSeek-V3's first 2 layers: one dense, one of 8 routed experts (top 3) and shared experts, latent attention; its
# experts multiply in bfloat16 (titan_cases.Case.exact): losses and max_logits compared, not weights
MOE = Case("deepseek-moe", lambda: two_layers_sdpa(deepseek_v3.model_registry("debugmodel")), 4, exact=False)


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    replicate: int
    tp: int
    ep: int
    cases: tuple

    @property
    def data_parallel(self):
        """The data-parallel ranks (each its own rows) of the 4."""
        return 4 // self.tp


LAYOUTS = (Layout("fsdp 2 x tp 2", replicate=1, tp=2, ep=1, cases=CASES),
           Layout("replicate 2 x fsdp 2 (HSDP)", replicate=2, tp=1, ep=1, cases=CASES),
           Layout("fsdp 2 x tp 2, experts on efsdp 2 x ep 2", replicate=1, tp=2, ep=2, cases=(MOE,)))


def build(case, layout, held, out):
    """Trainer.__init__'s order: the model through its plans and parallelize function, materialized, the
    optimizers (then the reference's weights), titan_qk_clip, the LR schedulers, the checkpointer."""
    _, dims, model = parallelized(case, held, out, tp=layout.tp, ep=layout.ep, replicate=layout.replicate)
    optimizers = optimizer_config().build(model_parts=[model])
    load_full(model, initial_weights(case))
    (clip,) = titan_qk_clip([model], optimizers, TAU[case.name])
    schedulers = SCHEDULE.build(optimizers=optimizers, training_steps=case.steps)
    return (dims, model, optimizers, clip, schedulers) + checkpointed(model, optimizers, schedulers, out)


def tensor_parallel_slices(model):
    """The names of the parameters sharded over the "tp" mesh dim (what makes this run tensor-parallel)."""
    return [n for n, p in model.named_parameters() if isinstance(p, DTensor) and "tp" in p.device_mesh.mesh_dim_names
            and p.placements[p.device_mesh.mesh_dim_names.index("tp")].is_shard()]


def train_step(dims, held, model, optimizers, schedulers, clip, rows):
    """Trainer.train_step's order: (loss summed over the batch mesh, gradient norm, max_logits)."""
    batch = dims.get_mesh("batch")
    optimizers.zero_grad(set_to_none=False)
    tokens = dist_utils.dist_sum_tensor(torch.tensor(rows[:, 1:].numel()), batch)
    with loss_parallel() if dims.tp_enabled else contextlib.nullcontext():  # TP: the logits are vocabulary shards
        loss = summed_loss(model, rows, tokens)
        loss.backward()
    params = list(model.parameters())
    if held:
        norm = dmuon.torch.clip_grad_norm_(params, MAX_NORM)
    else:
        norm = dist_utils.clip_grad_norm_(params, MAX_NORM, foreach=True, pp_mesh=None, ep_enabled=dims.ep_enabled)
    optimizers.step()
    schedulers.step()
    loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().clone()
    dist.all_reduce(loss, group=batch.get_group())
    return loss.item(), float(norm), torch.cat(clip.max_logits)


def run(case, layout, held, label, out):
    """Steps 1..SAVED_AT, saved; a new model, optimizer, scheduler and checkpointer resume for the rest:
    ([(loss, norm, max_logits)] of each step, full weights)."""
    dims, model, optimizers, clip, schedulers, state, checkpointer = build(case, layout, held, out)
    sliced = tensor_parallel_slices(model)
    check((len(sliced) >= 4) == (layout.tp > 1), f"{label}: tensor parallelism sharded {sliced}")
    held_here = held_names(model)
    check(held == bool(held_here) and (not held or layout.ep == 1 or any("experts" in n for n in held_here)),
          f"{label}: held here {held_here}")
    dp_rank = dims.get_mesh("batch").get_local_rank()
    rows = batches(case, layout.data_parallel)[:, dp_rank * PER_RANK:(dp_rank + 1) * PER_RANK]
    steps = []
    for step in range(1, SAVED_AT + 1):
        steps.append(train_step(dims, held, model, optimizers, schedulers, clip, rows[step - 1]))
        state.step = step
        checkpointer.save(step)
    checkpointer.close()
    dims, model, optimizers, clip, schedulers, state, checkpointer = build(case, layout, held, out)
    check(checkpointer.load() and state.step == SAVED_AT, f"{label}: resumed at step {state.step}, not {SAVED_AT}")
    for step in range(SAVED_AT + 1, case.steps + 1):
        steps.append(train_step(dims, held, model, optimizers, schedulers, clip, rows[step - 1]))
    checkpointer.close()
    return steps, full_weights(model)


def main():
    out = pathlib.Path(sys.argv[1])
    runs = {(c, layout.data_parallel) for layout in LAYOUTS for c in layout.cases}
    rank, world, refs = start(out, lambda world, group: {(c.name, dp): reference(c, dp, group) for c, dp in runs})
    check(world == 4, f"torch_titan_layouts_test runs at 4 ranks, not {world}")
    for layout, case in ((layout, case) for layout in LAYOUTS for case in layout.cases):
        for mode, held in (("all-to-all", False), ("owner-held", True)):
            label = f"torchtitan {case.name} ({layout.name}) {mode} with titan_qk_clip"
            folder = out / f"{case.name}-{layout.replicate}x{layout.tp}x{layout.ep}" / mode
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
            dist.barrier()
            steps, weights = run(case, layout, held, label, folder)
            if rank == 0:
                (ref_losses, ref_maxima, clipped, ref_norms), ref_weights = refs[(case.name, layout.data_parallel)]
                norms = [n for _, n, _ in steps]
                check(all(abs(a - b) <= TOLERANCE * b for a, b in zip(norms, ref_norms)),
                      f"{label}: gradient norms {norms}, the one process's {ref_norms}")
                gap = max(float(((m - r).abs() / r.abs()).max()) for (_, _, m), r in zip(steps, ref_maxima))
                check(gap <= TOLERANCE, f"{label}: max_logits {gap:.2e} away from the one process's")
                check(clipped == {True, False}, f"{label}: the one process clipped {sorted(clipped)} (some heads, "
                      f"not all, wanted at tau {TAU[case.name]})")
                compare(label, [l for l, _, _ in steps], weights if case.exact else {}, ref_losses,
                        ref_weights if case.exact else {})
                print(f"{label}: gradient norms {[f'{n:.6f}' for n in norms]} (one process "
                      f"{[f'{n:.6f}' for n in ref_norms]}); max_logits within {gap:.2e}", flush=True)
            dist.barrier()
    return finish(f"torch_titan_layouts_test at {world} ranks: torchtitan's Llama3 (fused wqkv) and DeepSeek-V3 "
                  f"(latent attention) under FSDP2 x TP by their own plans, under HSDP, and (the MoE) TP x EP, both "
                  f"modes, titan_qk_clip, DCP save and resume, vs one process")


if __name__ == "__main__":
    exit_rank(main())
