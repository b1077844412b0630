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
from torchtitan.models import deepseek_v3, llama3, qwen3
from torchtitan.models.common.attention import GQAttention

import dmuon.torch
from dmuon.torch import titan
from dmuon.torch.qk_clip_titan import call_mask, titan_qk_clip
from framework_runs import TOLERANCE, compare, start
from rank_checks import check, finish
from rank_exit import exit_rank
from torch_titan_test import (MAX_NORM, PER_RANK, SCHEDULE, Case, backward_per_rank, batches, full_weights,
                              initial_weights, load_full, optimizer_config, parallelized, summed_loss,
                              two_layers_sdpa)

STEPS = 4
# Within each model's per-head largest logits over these steps without the clip (llama3 0.23-0.60, deepseek
# 0.51-1.51, at 2 ranks' rows): some heads clipped, others not
CASES = (Case("llama3", lambda: two_layers_sdpa(llama3.model_registry("debugmodel")), STEPS, exact=True),
         Case("deepseek", lambda: two_layers_sdpa(deepseek_v3.model_registry("debugmodel"), layers=1), STEPS,
              exact=True))
TAU = {"llama3": 0.34, "deepseek": 0.65, "deepseek-moe": 0.65}  # the last: torch_titan_layouts_test's MoE
LABELLED = SimpleNamespace(label="an attention")  # what call_mask names in its errors


def queries_and_keys(module, x, positions):
    """An attention's queries and keys (B, L, N, H) after the rotary embedding, by hand from its input x."""
    if isinstance(module, deepseek_v3.model.Attention):  # latent: q from wq, k from wkv_a's latent and its rope key
        b, s, _ = x.shape
        q = module.wq(x).view(b, s, -1, module.qk_head_dim)
        q_nope, q_pe = q.split([module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
        latent, k_pe = module.wkv_a(x).split([module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = module.rope(q_pe, k_pe.unsqueeze(2), positions)
        k_nope = module.wkv_b(module.kv_norm(latent)).view(b, s, -1, module.qk_nope_head_dim + module.v_head_dim)
        k_nope = k_nope[..., :module.qk_nope_head_dim]
        return (torch.cat([q_nope, q_pe], dim=-1),
                torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)), module.softmax_scale
    q, k, _ = module.qkv_linear(x)
    q, k = module.rope(q, k, positions)
    return (q, k), module.head_dim ** -0.5


def logits_by_hand(module, x, positions):
    """An attention's per-head largest logit (causal) from its input, by hand: (heads,) float64."""
    with torch.no_grad():
        (q, k), scale = queries_and_keys(module, x, positions)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        logits = (q.float() @ k.float().transpose(-1, -2)) * scale
        causal = torch.ones(logits.shape[-2:], dtype=torch.bool).tril()
        return logits.masked_fill(~causal, -torch.inf).amax(dim=(0, 2, 3)).double()


def by_hand_maxima(model):
    """Forward pre-hooks on each attention module computing its per-head largest logit from its input by hand;
    returns the list they append (module, input, positions, maxima) to."""
    seen = []

    def hook(module, args, kwargs):
        positions = kwargs.get("positions", args[2] if len(args) > 2 else None)
        seen.append((module, args[0], positions, logits_by_hand(module, args[0], positions)))

    for m in model.modules():
        if isinstance(m, (deepseek_v3.model.Attention, GQAttention)):
            m.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def reference(case, world, group):
    """The one process: the unsharded model, the container, titan_qk_clip, torch's clipping; every step on all
    ranks' rows, one backward per rank's rows. ((losses, max_logits per step, heads clipped, gradient norms summed
    in float64 (torch's float32 one was 7e-5 relative from it at 4 ranks, torch_titan_pp_test)), weights)."""
    spec = case.spec()
    model = spec.model.build()
    model.load_state_dict(initial_weights(case))
    optimizers = optimizer_config(process_group=group).build(model_parts=[model])
    (clip,) = titan_qk_clip([model], optimizers, TAU[case.name])
    schedulers = SCHEDULE.build(optimizers=optimizers, training_steps=case.steps)
    seen = by_hand_maxima(model)
    losses, maxima, norms = [], [], []
    for step, rows in enumerate(batches(case, world)):
        optimizers.zero_grad(set_to_none=False)
        loss = backward_per_rank(model, rows)
        norms.append(float(sum(p.grad.double().pow(2).sum() for p in model.parameters())) ** 0.5)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizers.step()
        schedulers.step()
        losses.append(loss)
        maxima.append(torch.cat(clip.max_logits))
        if step == 0:  # by hand: each attention's maxima over the rank's row blocks
            layers = len(clip.attentions)
            by_hand = torch.stack([m for *_, m in seen]).view(world, layers, -1).amax(dim=0).flatten()
            gap = float(((maxima[0] - by_hand).abs() / by_hand.abs()).max())
            check(gap <= 1e-5, f"{case.name}: one process's max_logits vs the logits by hand: {gap:.2e}")
            print(f"{case.name}: the one process's max_logits at step 1 within {gap:.2e} of the logits by hand",
                  flush=True)
        seen.clear()
    clipped = {bool(v) for m in maxima for v in (m > TAU[case.name]).tolist()}
    return (losses, maxima, clipped, norms), {k: v.detach().clone() for k, v in model.state_dict().items()}


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
