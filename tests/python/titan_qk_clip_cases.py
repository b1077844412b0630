"""QK-clip's titan cases (torch_titan_qk_clip_test.py, torch_titan_layouts_test.py): torchtitan's Llama3 (a fused
wqkv) and DeepSeek-V3 (latent attention) at a tau each that clips some heads and not others, each attention's largest
logits computed by hand from its input, and the one process's run with titan_qk_clip that the tests compare
against."""

import torch
from torchtitan.models import deepseek_v3, llama3
from torchtitan.models.common.attention import GQAttention

from dmuon.torch.qk_clip_titan import titan_qk_clip
from rank_checks import check
from titan_cases import (MAX_NORM, SCHEDULE, Case, backward_per_rank, batches, initial_weights, optimizer_config,
                         two_layers_sdpa)

STEPS = 4
# Within each model's per-head largest logits over these steps without the clip (llama3 0.23-0.60, deepseek
# 0.51-1.51, at 2 ranks' rows): some heads clipped, others not
CASES = (Case("llama3", lambda: two_layers_sdpa(llama3.model_registry("debugmodel")), STEPS, exact=True),
         Case("deepseek", lambda: two_layers_sdpa(deepseek_v3.model_registry("debugmodel"), layers=1), STEPS,
              exact=True))
TAU = {"llama3": 0.34, "deepseek": 0.65, "deepseek-moe": 0.65}  # the last: torch_titan_layouts_test's MoE


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
