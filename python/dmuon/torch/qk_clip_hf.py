"""QK-clip (qk_clip.py) for a Hugging Face `transformers` model: its self-attention modules (those with a layer_idx
and q_proj and k_proj: Llama, Qwen2, Mistral, ...; a fused qkv_proj: Phi-3; kv_b_proj, the latent attention of
DeepSeek-V2/V3 and Kimi K2) become QKClip's attentions, and the model's attention function ("eager" or "sdpa") is
wrapped by one that reports each call's per-head maximum logit before calling it.

The logits are recomputed from the function's query and key (after the rotary embedding): q·kᵀ·scaling per head,
the key heads repeated for their query groups, masked as the call masks them (its attention_mask, boolean or
additive, or causal where it has none), under no_grad. That materializes one (batch, heads, q_len, k_len) tensor
per call (eager attention materializes the same; sdpa does not): the helper's cost, in memory and time.

Under tensor parallelism (transformers' column-wise plan for q_proj and k_proj: parallelize_module, or
from_pretrained's tp_plan) a rank's call has its own query heads only; it reports those, found from the rows of the
query weight (a DTensor) that the rank holds, and QKClip takes every rank's maxima into one step.
"""

import sys

import torch

from dmuon.torch.dtensors import is_dtensor
from dmuon.torch.placements import local_spans
from dmuon.torch.qk_clip import Attention, FusedAttention, LatentAttention, QKClip, heads_of_rows


def max_logits(query, key, attention_mask, scaling, is_causal):
    """Per query head, the largest logit q·kᵀ·scaling that the mask lets through: query (B, H, Tq, d), key
    (B, G, Tk, d) → (H,)."""
    heads, groups = query.shape[1], key.shape[1]
    key = key.repeat_interleave(heads // groups, dim=1)
    logits = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scaling  # (B, H, Tq, Tk)
    if attention_mask is not None:
        mask = attention_mask[..., :key.shape[-2]]
        logits = logits.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else logits + mask.float()
    elif is_causal and query.shape[-2] > 1:
        q_len, k_len = query.shape[-2], key.shape[-2]
        allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
        logits = logits.masked_fill(~allowed, -torch.inf)
    return logits.amax(dim=(0, 2, 3))


def attention_of(module, names):
    """The QKClip attention of a transformers self-attention module (by its parameters' names in `names`), or None
    for any other module."""
    if not hasattr(module, "layer_idx"):
        return None
    config = module.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads

    def name(linear, part="weight"):
        tensor = getattr(linear, part)
        return None if tensor is None else names[id(tensor)]

    if getattr(module, "kv_b_proj", None) is not None:  # latent: q_proj, or q_b_proj after a low-rank q_a_proj
        q = module.q_proj if getattr(module, "q_proj", None) is not None else module.q_b_proj
        return LatentAttention(q=name(q), kv=name(module.kv_b_proj), heads=heads,
                               qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
                               v_head_dim=config.v_head_dim)
    if getattr(module, "qkv_proj", None) is not None:
        return FusedAttention(qkv=name(module.qkv_proj), heads=heads, kv_heads=kv_heads,
                              bias=name(module.qkv_proj, "bias"))
    if hasattr(module, "q_proj") and hasattr(module, "k_proj"):
        return Attention(q=name(module.q_proj), k=name(module.k_proj), heads=heads, kv_heads=kv_heads,
                         q_bias=name(module.q_proj, "bias"), k_bias=name(module.k_proj, "bias"))
    return None


def query_weight(module):
    """The weight whose rows make the module's queries (their heads' rows in head order)."""
    if getattr(module, "kv_b_proj", None) is not None and getattr(module, "q_proj", None) is None:
        return module.q_b_proj.weight
    return module.qkv_proj.weight if getattr(module, "qkv_proj", None) is not None else module.q_proj.weight


def heads_computed(attention, weight, count, caller):
    """The global query heads of a call of `attention` whose query has `count` heads: None for all of them; fewer
    under tensor parallelism (a column-wise plan): the heads of the rows this rank holds of `weight`, the query's
    weight (a fused qkv one in its "grouped" layout: whole key-value groups), a DTensor sharded by rows. ValueError
    naming the caller and the attention where they are not whole heads."""
    if count == attention.heads:
        return None
    problem = "its query weight is not a DTensor sharded by rows"
    if is_dtensor(weight):
        rows = local_spans(tuple(weight.shape), tuple(weight.device_mesh.shape), weight.device_mesh.get_coordinate(),
                           tuple(weight.placements))[0].indices()
        heads = heads_of_rows(attention, rows, weight.shape[0])
        if heads is not None and len(heads) == count:
            return heads
        problem = (f"its rows on this rank ({len(rows)} of {weight.shape[0]}) are not {count} whole heads" +
                   (" (whole key-value groups of its grouped fused weight)" if isinstance(attention, FusedAttention)
                    else ""))
    raise ValueError(f"{caller}: attention '{attention.label}' computed {count} of its {attention.heads} query "
                     f"heads here, and {problem}: which heads they are is unknown")


def hf_qk_clip(model, optimizer, tau, alpha=0.5):
    """A QKClip over `model`'s self-attention layers on DMuon `optimizer` (built over model.named_parameters() or
    the model, so its names are the model's), with the model's attention function wrapped to report their
    maxima. Returns the QKClip. ValueError for an attention normalizing its queries or keys after the projection
    (q_norm, k_norm), where the rule cannot act, unless tau is float("inf") (max_logits alone, for the logs)."""
    attentions, index, base_of = [], {}, {}
    names = {id(p): n for n, p in model.named_parameters()}
    for module in model.modules():
        attention = attention_of(module, names)
        if attention is None:
            continue
        norms = [n for n in ("q_norm", "k_norm") if getattr(module, n, None) is not None]
        if norms and tau != float("inf"):
            raise ValueError(f"hf_qk_clip: attention '{attention.label}' normalizes its queries or keys after the "
                             f"projection ({' and '.join(norms)}: Qwen3, OLMo2, Gemma3), so rescaling the projection "
                             "changes none of its logits and QK-clip cannot bound them; tau=float('inf') only "
                             "records max_logits")
        attentions.append(attention)
        index[id(module)] = len(attentions) - 1
        base_of[type(module).__module__] = sys.modules[type(module).__module__]
    if not attentions:
        raise ValueError("hf_qk_clip: the model has no self-attention module with a layer_idx and q_proj and k_proj, "
                         "qkv_proj or kv_b_proj")
    clip = QKClip(optimizer, tau, attentions, alpha)
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = model.config._attn_implementation
    heads_of = {}  # (module id, query heads of its calls) → the global heads they are (None: all)
    if base not in ("eager", "sdpa"):
        raise ValueError(f"hf_qk_clip: the model's attention is {base!r}; the helper wraps 'eager' and 'sdpa'")

    def reporting(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        i = index[id(module)]
        call = (id(module), query.shape[1])
        if call not in heads_of:  # the layout is fixed: worked out at the first call
            heads_of[call] = heads_computed(attentions[i], query_weight(module), query.shape[1], "hf_qk_clip")
        with torch.no_grad():
            clip.report(i, max_logits(query, key, attention_mask, scale, getattr(module, "is_causal", True)),
                        heads_of[call])
        function = (base_of[type(module).__module__].eager_attention_forward if base == "eager"
                    else ALL_ATTENTION_FUNCTIONS["sdpa"])
        return function(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    name = f"dmuon_qk_clip_{base}_{id(clip)}"  # the registry is global: one name per model
    AttentionInterface.register(name, reporting)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])  # the masks the base function takes
    model.config._attn_implementation_internal = name
    for sub in model.modules():  # sub-models' configs (a decoder's own config object)
        config = getattr(sub, "config", None)
        if config is not None and getattr(config, "_attn_implementation_internal", None) == base:
            config._attn_implementation_internal = name
    return clip
