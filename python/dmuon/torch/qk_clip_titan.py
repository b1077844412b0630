"""QK-clip (qk_clip.py) for torchtitan's models (docs/integrations.md, "torchtitan"; tested with torchtitan 0.3.0).
Importing this module imports torchtitan.

Each model part's attention modules become QKClip's attentions, by the names torchtitan's optimizer container gives
the parameters (the part's own names):
  GQAttention, fused wqkv (FusedQKVLinear: per key-value group its query heads, its key head, its value head)
                                 FusedAttention(layout="grouped")              Llama3's, and others' by default
  GQAttention, wq / wk / wv (QKVLinear)         Attention
  DeepSeek-V3's multi-head latent attention (deepseek_v3.model.Attention; Kimi K2's)
                                 LatentAttention on wq (or wq_b after the low-rank wq_a) and wkv_b
and a forward pre-hook on each one's inner attention (SDPA or FlexAttention) reports the call's per-head maximum
logit from its query and key (after the rotary embedding): q·kᵀ·scale, masked as the call masks (causal for SDPA;
FlexAttention's BlockMask made dense from its mask_mod), under no_grad. Its cost is one (batch, heads, seq, seq)
float32 tensor per layer and call, as in qk_clip_hf.py.

Under tensor parallelism (torchtitan's plans: wqkv, wq, wq_b sharded by rows) a rank's call has its own query heads
only; it reports those, found from the rows of the query weight (a DTensor) the rank holds: whole heads, or whole
key-value groups of the grouped fused wqkv (qk_clip_hf.heads_computed).

Refused by name (ValueError): an attention with q_norm and k_norm (Qwen3: a rescaled projection changes none of its
logits) at a finite tau; at call time, a query with fewer heads than the attention whose rows on the rank are not
whole heads, a FlexAttention score_mod (the logits it changes are not q·kᵀ·scale) or masks by layer type (a mapping)
or varlen metadata.
"""

import contextlib

import torch
from torch.nn.attention.flex_attention import BlockMask, create_mask
from torchtitan.models.common.attention import FusedQKVLinear, GQAttention, QKVLinear
from torchtitan.models.deepseek_v3.model import Attention as LatentTitanAttention

from dmuon.torch.dtensors import local_part
from dmuon.torch.qk_clip import Attention, FusedAttention, LatentAttention, QKClip
from dmuon.torch.qk_clip_hf import heads_computed, max_logits
from dmuon.torch.torch_private import pipeline_stages


def attention_of(module, names):
    """The QKClip attention of a torchtitan attention module (its parameters' names in `names`), or None for any
    other module."""
    def name(linear, part="weight"):
        tensor = getattr(linear, part, None)
        return None if tensor is None else names[id(tensor)]

    if isinstance(module, LatentTitanAttention):
        q = module.wq if module.q_lora_rank == 0 else module.wq_b
        return LatentAttention(q=name(q), kv=name(module.wkv_b), heads=module.n_heads,
                               qk_nope_head_dim=module.qk_nope_head_dim, qk_rope_head_dim=module.qk_rope_head_dim,
                               v_head_dim=module.v_head_dim)
    if isinstance(module, GQAttention):
        qkv = module.qkv_linear
        if isinstance(qkv, FusedQKVLinear):
            return FusedAttention(qkv=name(qkv.wqkv), heads=module.n_heads, kv_heads=module.n_kv_heads,
                                  bias=name(qkv.wqkv, "bias"), layout="grouped")
        if isinstance(qkv, QKVLinear):
            return Attention(q=name(qkv.wq), k=name(qkv.wk), heads=module.n_heads, kv_heads=module.n_kv_heads,
                             q_bias=name(qkv.wq, "bias"), k_bias=name(qkv.wk, "bias"))
    return None


def call_mask(attention, query, key, attention_masks, score_mod):
    """(mask for max_logits, is_causal) of an inner attention's call: None and causal for SDPA's; a FlexAttention
    BlockMask as a dense boolean (B, H, Tq, Tk) mask. ValueError naming the attention otherwise."""
    if score_mod is not None:
        raise ValueError(f"titan_qk_clip: attention '{attention.label}' has a FlexAttention score_mod; QK-clip bounds "
                         "q·kᵀ·scale, which it changes")
    if attention_masks is None:
        return None, True
    if not isinstance(attention_masks, BlockMask):
        raise ValueError(f"titan_qk_clip: attention '{attention.label}' is given {type(attention_masks).__name__} "
                         "masks; the reporting takes none (SDPA, causal) or one FlexAttention BlockMask")
    batch, heads, q_len, k_len = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    return create_mask(attention_masks.mask_mod, batch, heads, q_len, k_len, device=query.device), False


def titan_qk_clip(model_parts, optimizers, tau, alpha=0.5, pp_schedule=None):
    """QKClips over torchtitan model parts (Trainer's model_parts: one, or a pipeline rank's stages) on their
    optimizers (the OptimizersContainer built over them, DMuonOptimizers: one DMuon per part), one per part that
    has attention, with each attention's inner attention hooked to report its maxima. Returns the QKClips.

    Under pipeline parallelism give pp_schedule (pipelining_fn's schedule): each stage's first forward is a
    metadata inference on uninitialized inputs, whose logits are not the batch's; a forward context on each stage
    (PipelineStage.register_forward_context) pauses its QKClip there. ValueError without it where the optimizers
    run over pipeline stages (DMuonOptimizers made a stage_group)."""
    if getattr(optimizers, "stage_group", None) is not None and pp_schedule is None:
        raise ValueError("titan_qk_clip: the optimizers run over pipeline stages; give pp_schedule= (pipelining_fn's "
                         "schedule), so that each stage's metadata-inference forward reports nothing")
    clips = []
    for part, optimizer in zip(model_parts, optimizers):
        names = {id(p): n for n, p in part.named_parameters()}
        found = [(m, attention_of(m, names)) for m in part.modules()]
        found = [(m, a) for m, a in found if a is not None]
        for module, attention in found:
            if getattr(module, "q_norm", None) is not None and isinstance(module, GQAttention) and tau != float("inf"):
                raise ValueError(f"titan_qk_clip: attention '{attention.label}' normalizes its queries and keys after "
                                 "the projection (q_norm and k_norm: Qwen3), so rescaling the projection changes none "
                                 "of its logits and QK-clip cannot bound them; tau=float('inf') only records "
                                 "max_logits")
        if not found:
            continue
        clip = QKClip(optimizer, tau, [a for _, a in found], alpha)
        for i, (module, attention) in enumerate(found):
            module.inner_attention.register_forward_pre_hook(_reporter(clip, i, attention, module), with_kwargs=True)
        if pp_schedule is not None:
            for stage in pipeline_stages(pp_schedule):
                if stage.submod is part:
                    stage.register_forward_context(
                        lambda info, c=clip: c.paused() if info.is_metadata_inference else contextlib.nullcontext())
        clips.append(clip)
    return clips


def query_weight(module):
    """The weight whose rows make a torchtitan attention module's queries (fused: with the keys and values)."""
    if isinstance(module, LatentTitanAttention):
        return (module.wq if module.q_lora_rank == 0 else module.wq_b).weight
    qkv = module.qkv_linear
    return qkv.wqkv.weight if isinstance(qkv, FusedQKVLinear) else qkv.wq.weight


def _reporter(clip, index, attention, module):
    heads_of = {}  # query heads of a call → the global heads they are (None: all); the layout is fixed

    def report(inner, args, kwargs):
        query, key = (local_part(t).transpose(1, 2) for t in args[:2])  # (B, L, N, H) → (B, N, L, H)
        count = query.shape[1]  # under TP: this rank's heads (torchtitan's are DTensors sharded by heads)
        if count not in heads_of:  # which global heads: from the query weight's rows this rank holds
            heads_of[count] = heads_computed(attention, query_weight(module), count, "titan_qk_clip")
        mask, causal = call_mask(attention, query, key, kwargs.get("attention_masks"), kwargs.get("score_mod"))
        scale = kwargs.get("scale")
        scale = scale if scale is not None else query.shape[-1] ** -0.5
        with torch.no_grad():
            clip.report(index, max_logits(query, key, mask, scale, causal and kwargs.get("is_causal", True)),
                        heads_of[count])
    return report
