"""QK-clip inside torchtitan (dmuon.torch.qk_clip_titan.titan_qk_clip), at 2 ranks, on two of its models with SDPA
attention, each sharded by its own parallelize function (FSDP2 over the 2 ranks), in both modes (all-to-all;
owner-held: dmuon.torch.titan.owner_held):
  llama3    the debug Llama3 cut to 2 layers: a fused wqkv of 16 heads (FusedQKVLinear: grouped rows), 4 steps;
  deepseek  the debug DeepSeek-V3 cut to its first layer (dense): multi-head latent attention (wq, wkv_b), 4 steps;
DMuon built by DMuonOptimizers, titan_qk_clip at a tau that clips some heads and not others, the steps of
torch_titan_test (summed cross-entropy / the global token count; clipping at 1.0: torchtitan's clip_grad_norm_,
dmuon.torch.clip_grad_norm_ in the owner-held mode), against the same over the unsharded model in one process (DMuon
over a process group of rank 0 alone):
  maxima   each step's QKClip.max_logits equal the one process's (within TOLERANCE), and there, at the first step,
           the logits computed by hand from each attention's input (its projections and rotary embedding);
  clipped  the one process clipped some heads and left others;
  weights  every loss and final weight within framework_runs.TOLERANCE.
Before training, in one process: each model's step at lr 0 (the clip alone changes the weights) leaves every head's
largest logit on the same batch at min(S, tau), the defining property of the rule, by hand; a Qwen3 (q_norm, k_norm)
refused at a finite tau; FlexAttention's BlockMask (causal, and documents packed in a row) made the dense mask the
logits are taken under.

Run: PYTHONPATH=build/python:tests/python python tests/python/run_ranks.py --nproc 2 --timeout 400 -- \
    tests/python/torch_titan_qk_clip_test.py DIR
"""

import pathlib
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import create_block_mask
from torchtitan.components.optimizer import ParamGroupConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.models import qwen3

import dmuon.torch
from dmuon.torch import titan
from dmuon.torch.qk_clip_titan import call_mask, titan_qk_clip
from framework_runs import TOLERANCE, compare, start
from rank_checks import check, finish
from rank_exit import exit_rank
from titan_cases import (MAX_NORM, PER_RANK, SCHEDULE, batches, full_weights, initial_weights, load_full,
                         optimizer_config, parallelized, summed_loss, two_layers_sdpa)
from titan_qk_clip_cases import CASES, TAU, by_hand_maxima, logits_by_hand, reference

LABELLED = SimpleNamespace(label="an attention")  # what call_mask names in its errors


def build(case, held, out):
    """torch_titan_test's build without the checkpointer, and titan_qk_clip after the optimizers."""
    _, _, model = parallelized(case, held, out)
    optimizers = optimizer_config().build(model_parts=[model])
    load_full(model, initial_weights(case))
    (clip,) = titan_qk_clip([model], optimizers, TAU[case.name])
    return model, optimizers, clip, SCHEDULE.build(optimizers=optimizers, training_steps=case.steps)


def run(case, held, out):
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = batches(case, world)[:, rank * PER_RANK:(rank + 1) * PER_RANK]
    model, optimizers, clip, schedulers = build(case, held, out)
    losses, maxima = [], []
    for step in range(case.steps):
        optimizers.zero_grad(set_to_none=False)
        tokens = torch.tensor(rows[step][:, 1:].numel())
        dist.all_reduce(tokens)
        loss = summed_loss(model, rows[step], tokens)
        loss.backward()
        params = list(model.parameters())
        if held:
            dmuon.torch.clip_grad_norm_(params, MAX_NORM)
        else:
            dist_utils.clip_grad_norm_(params, MAX_NORM, foreach=True, pp_mesh=None, ep_enabled=False)
        optimizers.step()
        schedulers.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item())
        maxima.append(torch.cat(clip.max_logits))
    return losses, maxima, full_weights(model)


def check_the_rule(case, alone):
    """Kimi K2's defining property, whatever the rows' layout: with lr 0 (the step changes the weights by the clip
    alone), each attention's per-head largest logits from the same input after the step are the ones before times
    γ_h = τ / S_h where S_h > τ (both computed by hand), and unchanged elsewhere."""
    torch.manual_seed(0)
    model = case.spec().model.build()
    model.load_state_dict(initial_weights(case))
    config = titan.DMuonOptimizers.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="DMuon",
                                       optimizer_kwargs=dict(lr=0.0, adamw_lr=0.0, weight_decay=0.1))],
        optimizer_factory_kwargs_by_name={"DMuon": dict(ns_dtype="float32", process_group=alone)})
    optimizers = config.build(model_parts=[model])
    titan_qk_clip([model], optimizers, TAU[case.name])
    seen = by_hand_maxima(model)
    rows = batches(case, 1)[0]
    summed_loss(model, rows, rows[:, 1:].numel()).backward()
    optimizers.step()  # each attention's logits again from the same input (a layer's input moves with the clip)
    before = torch.cat([m for *_, m in seen])
    after = torch.cat([logits_by_hand(module, x, positions) for module, x, positions, _ in seen])
    want = torch.where(before > TAU[case.name], TAU[case.name] / before, torch.ones_like(before)) * before
    gap = float(((after - want).abs() / want).max())
    check(gap <= 1e-5 and bool((before > TAU[case.name]).any()),
          f"{case.name}: the logits after the clip are {gap:.2e} away from Kimi K2's γ·S "
          f"({int((before > TAU[case.name]).sum())} of {before.numel()} heads above tau)")
    print(f"{case.name}: after the clip (lr 0) every head's largest logit within {gap:.2e} of min(S, tau)", flush=True)


def one_process_checks(out):
    """A Qwen3's q_norm and k_norm refused at a finite tau; FlexAttention's BlockMask made dense."""
    torch.manual_seed(0)
    model = two_layers_sdpa(qwen3.model_registry("debugmodel")).model.build()
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]  # collective: all make all
    for case in CASES:
        check_the_rule(case, alone)
    optimizers = optimizer_config(process_group=alone).build(model_parts=[model])
    try:
        titan_qk_clip([model], optimizers, 1.0)
        check(False, "titan_qk_clip took a Qwen3 (q_norm, k_norm) at a finite tau")
    except ValueError as e:
        check("normalizes its queries and keys after the projection (q_norm and k_norm" in str(e),
              f"the Qwen3 refusal names no reason: {e}")
    check(len(titan_qk_clip([model], optimizers, float("inf"))) == 1, "tau=inf on a Qwen3 made no QKClip")
    q, k = torch.zeros(2, 3, 8, 4), torch.zeros(2, 3, 8, 4)
    causal = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 8, 8, device="cpu")
    mask, is_causal = call_mask(LABELLED, q, k, causal, None)
    check(not is_causal and mask.shape == (2, 3, 8, 8) and torch.equal(mask, torch.ones(8, 8, dtype=torch.bool)
                                                                      .tril().expand(2, 3, 8, 8)),
          "the causal BlockMask is not the lower triangle")
    starts = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])  # three documents packed in a row
    documents = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (starts[qi] == starts[ki]), None, None, 8, 8,
                                  device="cpu")
    mask, _ = call_mask(LABELLED, q, k, documents, None)
    want = torch.ones(8, 8, dtype=torch.bool).tril() & (starts[:, None] == starts[None, :])
    check(torch.equal(mask[1, 2], want), "the documents' BlockMask is not their causal blocks")
    for masks, score_mod, needle in (({"full": causal}, None, "dict masks"), (causal, lambda s, *a: s, "score_mod")):
        try:
            call_mask(LABELLED, q, k, masks, score_mod)
            check(False, f"call_mask took {needle}")
        except ValueError as e:
            check(needle.split()[0] in str(e), f"the {needle} refusal names nothing: {e}")


def main():
    out = pathlib.Path(sys.argv[1])
    rank, world, refs = start(out, lambda world, group: {c.name: reference(c, world, group) for c in CASES})
    one_process_checks(out)
    for case in CASES:
        for mode, held in (("all-to-all", False), ("owner-held", True)):
            label = f"torchtitan {case.name} {mode} with titan_qk_clip"
            losses, maxima, weights = run(case, held, out / case.name / mode)
            if rank == 0:
                (ref_losses, ref_maxima, clipped, _), ref_weights = refs[case.name]
                gap = max(float(((a - b).abs() / b.abs()).max()) for a, b in zip(maxima, ref_maxima))
                # the logits of weights within TOLERANCE of the one process's: within it too (1.3e-5 seen)
                check(gap <= TOLERANCE, f"{label}: max_logits {gap:.2e} away from the one process's")
                check(clipped == {True, False}, f"{label}: heads above tau={TAU[case.name]} over the steps: "
                      f"{sorted(clipped)} (some clipped, others not, wanted)")
                compare(label, losses, weights, ref_losses, ref_weights)
                print(f"{label}: max_logits within {gap:.2e} of the one process's, largest "
                      f"{float(max(m.max() for m in maxima)):.4f} (tau {TAU[case.name]})", flush=True)
            dist.barrier()
    return finish(f"torch_titan_qk_clip_test at {world} ranks: titan_qk_clip on torchtitan's Llama3 (fused wqkv) "
                  "and DeepSeek-V3 (latent attention) under FSDP2, both modes, vs one process")


if __name__ == "__main__":
    exit_rank(main())
