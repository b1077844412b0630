"""DMuon inside torchtitan (issue 43), on two of its models, each sharded by its own parallelize function (FSDP2
over the 2 ranks), with SDPA attention (FlexAttention has no backward on the CPU):
  llama3      the debug Llama3 ("debugmodel") cut to 2 layers, parallelize_llama; 4 steps;
  qwen3-moe   the debug Qwen3 MoE ("debugmodel_moe") cut to 2 layers of 4 routed experts, top 2 (the flavor: 64,
              top 8), parallelize_qwen3 (expert parallelism 1: the stacks w1, w3 (4, 768, 256) and
              w2 (4, 256, 768) Shard(0), two whole experts a rank), and its ModelSpec.post_optimizer_build_fn
              (the load-balancing hook: each optimizer step first moves the routing bias expert_bias_E by the
              tokens each expert took on all ranks); 3 steps;
  qwen3-moe-ep the same under expert parallelism 2 (its own EP plan: each rank 2 whole experts on the (efsdp 1,
              ep 2) mesh, tokens to them by all-to-all; torchtitan's clip_grad_norm_ with ep_enabled; owner-held:
              each stack's EP slice held on its owner's EP group over "efsdp", the other matrices over "fsdp").
DMuon built by its OptimizersContainer from a ParamGroupConfig naming "DMuon"
(dmuon.torch.titan.DMuonOptimizers: the container with "DMuon" in its name → class table), its
warmup-stable-decay LR scheduler (LRSchedulersContainer) and its DCP checkpointer (CheckpointManager: saved after
step 2, a new model, optimizer, scheduler and checkpointer resume from it for the rest). The steps are
Trainer.train_step's: zero_grad(set_to_none=False), loss = summed cross-entropy / the global token count
(torchtitan disables FSDP's gradient division), torchtitan's clip_grad_norm_, optimizers.step(),
lr_schedulers.step(). Two modes:
  all-to-all    DMuon over FSDP2's DTensors;
  owner-held    ModelSpec.parallelize_fn = dmuon.torch.titan.owner_held(parallelize_fn): hold_on_owners,
                then the model's parallelize function, whose fully_shard calls leave the held matrices (the
                expert stacks too) out; torchtitan's clip_grad_norm_ must refuse (a RuntimeError: the held
                matrices' gradients are plain tensors beside FSDP2's DTensors), and dmuon.torch.clip_grad_norm_
                clips instead.
Every step's loss (summed over the ranks), gradient norm (Muon's and AdamW's updates hardly change when the held
gradients are scaled wrongly; the norm does) and the final weights equal the same container, hook, scheduler
and clipping over an unsharded copy in one process (DMuon over a process group of one rank) on the same
batches, within framework_runs.TOLERANCE; for the MoE the losses alone (Case.exact says why; DMuon skipping
the expert matrices at 2 ranks moved its step-3 loss by 1.4e-4 relative, its runs' noise was 6.3e-6). Before
training: the settings dmuon.torch.titan refuses, refused by name (owner_held under the MoE's expert parallelism
among them), and implementation="fused_opt_states_bf16" builds DMuon with bfloat16 states.

Run: PYTHONPATH=build/python:tests/python python tests/python/run_ranks.py --nproc 2 --timeout 400 -- \
    tests/python/torch_titan_test.py DIR
"""

import dataclasses
import pathlib
import shutil
import sys

import torch
import torch.distributed as dist
from torchtitan.config import ParallelismConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.models import llama3, qwen3
from torchtitan.models.common.moe import MoE

import dmuon.torch
from dmuon.torch import DMuon, titan
from framework_runs import TOLERANCE, compare, start
from rank_checks import check, finish
from rank_exit import exit_rank
from titan_cases import (MAX_NORM, PARALLELISM, PER_RANK, SAVED_AT, SCHEDULE, TRAINING, Case, backward_per_rank,
                         batches, checkpointed, full_weights, held_names, initial_weights, load_full, optimizer_config,
                         parallelized, summed_loss, two_layers_sdpa)

EXPERTS, TOP_K = 4, 2


def with_experts(moe):
    """An MoE.Config with EXPERTS routed experts, each token routed to TOP_K of them."""
    router, routed = moe.router, moe.routed_experts
    return dataclasses.replace(
        moe, num_experts=EXPERTS,
        router=dataclasses.replace(router, num_experts=EXPERTS, top_k=TOP_K,
                                   gate=dataclasses.replace(router.gate, out_features=EXPERTS)),
        routed_experts=dataclasses.replace(
            routed, inner_experts=dataclasses.replace(routed.inner_experts, num_experts=EXPERTS),
            token_dispatcher=dataclasses.replace(routed.token_dispatcher, num_experts=EXPERTS, top_k=TOP_K)))


def qwen3_moe_spec():
    spec = two_layers_sdpa(qwen3.model_registry("debugmodel_moe"))
    for _, moe, parent, attr in list(spec.model.traverse(MoE.Config)):
        setattr(parent, attr, with_experts(moe))
    return spec


CASES = (Case("llama3", lambda: two_layers_sdpa(llama3.model_registry("debugmodel")), 4, exact=True),
         Case("qwen3-moe", qwen3_moe_spec, 3, exact=False),
         Case("qwen3-moe-ep", qwen3_moe_spec, 3, exact=False, expert_parallel=True))


class OneProcess:
    """The ParallelDims a ModelSpec.post_optimizer_build_fn reads, for the one process: no mesh to sum over."""
    ep_enabled, tp = False, 1

    def get_optional_mesh(self, dims):
        return None


def after_optimizers(spec, optimizers, model, dims):
    """Trainer.__init__'s call after building the optimizers (the MoE's load-balancing hook)."""
    if spec.post_optimizer_build_fn is not None:
        spec.post_optimizer_build_fn(optimizers, [model], dims)


def reference(case, world, group):
    """The same container, hook, scheduler and (torch's) clipping over the unsharded model in one process, every
    step on all ranks' rows, one backward per rank's rows: torchtitan's routed experts multiply in bfloat16
    (GroupedExperts.forward), so each rank's expert gradients are rounded to bfloat16 before FSDP2 sums them;
    with one backward over all rows the MoE's step-2 loss moved by 2.7e-5 relative from the ranks' (7.639510
    against 7.639719), with one per rank's rows by 2.6e-7."""
    spec = case.spec()
    model = spec.model.build()
    model.load_state_dict(initial_weights(case))
    optimizers = optimizer_config(process_group=group).build(model_parts=[model])
    after_optimizers(spec, optimizers, model, OneProcess())
    schedulers = SCHEDULE.build(optimizers=optimizers, training_steps=case.steps)
    losses, norms = [], []
    for rows in batches(case, world):
        optimizers.zero_grad(set_to_none=False)
        loss = backward_per_rank(model, rows)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizers.step()
        schedulers.step()
        losses.append(loss)
    return (losses, norms), {k: v.detach().clone() for k, v in model.state_dict().items()}


def build(case, held, out):
    """Trainer.__init__'s order: the model on the meta device, parallelize_fn, to_empty, init_weights, the
    optimizers and post_optimizer_build_fn (then the reference's weights), the LR schedulers, the checkpointer."""
    spec, dims, model = parallelized(case, held, out, ep=dist.get_world_size() if case.expert_parallel else 1)
    optimizers = optimizer_config().build(model_parts=[model])
    check([type(o) for o in optimizers] == [DMuon], f"torchtitan built {[type(o) for o in optimizers]}, not one DMuon")
    held_here = held_names(model)
    check(held == bool(held_here) and (not held or not case.expert_parallel or any("experts" in n for n in held_here)),
          f"{case.name}: held here {held_here}, mode held={held}")
    after_optimizers(spec, optimizers, model, dims)
    load_full(model, initial_weights(case))  # where torchtitan's checkpointer would load a seed checkpoint
    schedulers = SCHEDULE.build(optimizers=optimizers, training_steps=case.steps)
    return (model, optimizers, schedulers) + checkpointed(model, optimizers, schedulers, out)


def train_step(label, held, model, optimizers, schedulers, rows, ep_enabled=False):
    """Trainer.train_step's order: (loss summed over the ranks, the gradient norm before clipping)."""
    optimizers.zero_grad(set_to_none=TRAINING.disable_cuda_graphs)
    tokens = torch.tensor(rows[:, 1:].numel())
    dist.all_reduce(tokens)
    loss = summed_loss(model, rows, tokens)
    loss.backward()
    params = [p for p in model.parameters()]
    if held:
        try:
            dist_utils.clip_grad_norm_(params, MAX_NORM, foreach=True, pp_mesh=None, ep_enabled=False)
            check(False, f"{label}: torchtitan's clip_grad_norm_ read the held gradients")
        except RuntimeError:  # torch 2.15: "aten._foreach_norm.Scalar got mixed torch.Tensor and DTensor ..."
            pass
        norm = dmuon.torch.clip_grad_norm_(params, MAX_NORM)
    else:
        norm = dist_utils.clip_grad_norm_(params, MAX_NORM, foreach=True, pp_mesh=None, ep_enabled=ep_enabled)
    optimizers.step()
    schedulers.step()
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss.item(), float(norm)


def run(case, label, held, out):
    """Steps 1..SAVED_AT, saved; a new model, optimizer, scheduler and checkpointer resume from the checkpoint
    for the rest: ([(loss, gradient norm)] of each step, full weights)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = batches(case, world)[:, rank * PER_RANK:(rank + 1) * PER_RANK]
    losses = []
    model, optimizers, schedulers, state, checkpointer = build(case, held, out)
    check(not checkpointer.load(), f"{label}: a checkpoint was there before the first save")
    for step in range(1, SAVED_AT + 1):
        losses.append(train_step(label, held, model, optimizers, schedulers, mine[step - 1],
                                 case.expert_parallel))
        state.step = step
        checkpointer.save(step)
    checkpointer.close()
    model, optimizers, schedulers, state, checkpointer = build(case, held, out)
    check(checkpointer.load() and state.step == SAVED_AT, f"{label}: resumed at step {state.step}, not {SAVED_AT}")
    lrs = [g["lr"] for o in optimizers for g in o.param_groups]
    for step in range(state.step + 1, case.steps + 1):
        losses.append(train_step(label, held, model, optimizers, schedulers, mine[step - 1],
                                 case.expert_parallel))
    checkpointer.close()
    check(schedulers.schedulers[0].last_epoch == case.steps, f"{label}: the scheduler is at step "
          f"{schedulers.schedulers[0].last_epoch} after resuming (lrs at the resume: {lrs})")
    return losses, full_weights(model)


def bf16_states():
    """optimizer.implementation='fused_opt_states_bf16': DMuon's states in bfloat16 (Muon's momentum, AdamW's moments);
    with DMuon kwargs asking another state_dtype, refused by name."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))  # weights to Muon, biases to AdamW
    optimizers = dataclasses.replace(optimizer_config(), implementation="fused_opt_states_bf16").build(
        model_parts=[model])
    dtypes = {key: value.dtype for opt in optimizers for entry in opt.state.values() for key, value in entry.items()
              if key != "step"}
    check(dtypes == dict.fromkeys(("momentum_buffer", "exp_avg", "exp_avg_sq"), torch.bfloat16),
          f"implementation='fused_opt_states_bf16': DMuon's states are {dtypes}")
    try:
        dataclasses.replace(optimizer_config(state_dtype=torch.float32), implementation="fused_opt_states_bf16").build(
            model_parts=[model])
        check(False, "optimizer.implementation='fused_opt_states_bf16' taken with DMuon's state_dtype=torch.float32")
    except ValueError as e:
        check("optimizer.implementation='fused_opt_states_bf16'" in str(e), f"the refusal names no setting: {e}")


def refusals():
    """The settings dmuon.torch.titan refuses, each by name, before anything collective."""
    world = dist.get_world_size()
    for case, cp, parallelism, setting in (
            (CASES[0], 1, ParallelismConfig(), "parallelism.spmd_backend='spmd_types'"),
            (CASES[1], world, PARALLELISM, f"parallelism.context_parallel_degree={world}")):
        dims = ParallelDims(dp_replicate=1, dp_shard=world // cp, cp=cp, tp=1, pp=1, ep=1, world_size=world)
        try:
            titan.owner_held(case.spec().parallelize_fn)(torch.nn.Linear(2, 2), parallel_dims=dims,
                                                         parallelism=parallelism)
            check(False, f"{case.name}: owner_held took {setting}")
        except ValueError as e:
            check(setting in str(e), f"{case.name}: the refusal names no {setting}: {e}")


def main():
    out = pathlib.Path(sys.argv[1])
    rank, world, refs = start(out, lambda world, group: {  # one reference a model (the MoE's serves both layouts)
        c.spec: reference(c, world, group) for c in {c.spec: c for c in CASES}.values()})
    refusals()
    bf16_states()
    for case in CASES:
        for mode, held in (("all-to-all", False), ("owner-held", True)):
            label = f"{case.name} {mode}"
            folder = out / case.name / mode
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
            dist.barrier()
            steps, weights = run(case, label, held, folder)
            if rank == 0:
                (ref, ref_norms), ref_weights = refs[case.spec]
                # the gradient norms: Muon's and AdamW's updates hardly change when gradients are scaled
                norms = [n for _, n in steps]
                check(not case.exact or all(abs(a - b) <= TOLERANCE * b for a, b in zip(norms, ref_norms)),
                      f"{label}: gradient norms {norms}, the one process's {ref_norms}")
                compare(f"torchtitan {label}", [l for l, _ in steps], weights if case.exact else {}, ref,
                        ref_weights if case.exact else {})
            dist.barrier()
    return finish(f"torch_titan_test at {world} ranks: torchtitan's Llama3 debugmodel (parallelize_llama, "
                  f"{CASES[0].steps} steps) and Qwen3 debugmodel_moe ({EXPERTS} experts, parallelize_qwen3, "
                  f"{CASES[1].steps} steps; also under EP) under FSDP2, OptimizersContainer with DMuon, "
                  f"LRSchedulersContainer, CheckpointManager (DCP) save and resume, all-to-all and owner-held, vs one "
                  f"process")


if __name__ == "__main__":
    exit_rank(main())
