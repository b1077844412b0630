"""QK-clip (qk_clip.py) for a Hugging Face `transformers` model: its self-attention modules (those with q_proj,
k_proj and a layer_idx: Llama, Qwen2, Mistral, ...) become QKClip's attentions, and the model's attention
function ("eager" or "sdpa") is wrapped by one that reports each call's per-head maximum logit before calling it.

The logits are recomputed from the function's query and key (after the rotary embedding): q·kᵀ·scaling per head,
the key heads repeated for their query groups, masked as the call masks them (its attention_mask, boolean or
additive, or causal where it has none), under no_grad. That materializes one (batch, heads, q_len, k_len) tensor
per call (eager attention materializes the same; sdpa does not): the helper's cost, in memory and time.
"""

import sys

import torch

from dmuon.torch.qk_clip import Attention, QKClip


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


def hf_qk_clip(model, optimizer, tau, alpha=0.5):
    """A QKClip over `model`'s self-attention layers on DMuon `optimizer` (built over model.named_parameters() or
    the model, so its names are the model's), with the model's attention function wrapped to report their
    maxima. Returns the QKClip."""
    attentions, index, base_of = [], {}, {}
    names = {id(p): n for n, p in model.named_parameters()}
    for module in model.modules():
        if not (hasattr(module, "q_proj") and hasattr(module, "k_proj") and hasattr(module, "layer_idx")):
            continue
        config = module.config
        heads = config.num_attention_heads
        bias = [names.get(id(m.bias)) if m.bias is not None else None for m in (module.q_proj, module.k_proj)]
        attentions.append(Attention(q=names[id(module.q_proj.weight)], k=names[id(module.k_proj.weight)], heads=heads,
                                    kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                                    q_bias=bias[0], k_bias=bias[1]))
        index[id(module)] = len(attentions) - 1
        base_of[type(module).__module__] = sys.modules[type(module).__module__]
    if not attentions:
        raise ValueError("hf_qk_clip: the model has no self-attention module with q_proj, k_proj and layer_idx")
    clip = QKClip(optimizer, tau, attentions, alpha)
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = model.config._attn_implementation
    if base not in ("eager", "sdpa"):
        raise ValueError(f"hf_qk_clip: the model's attention is {base!r}; the helper wraps 'eager' and 'sdpa'")

    def reporting(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        with torch.no_grad():
            clip.report(index[id(module)], max_logits(query, key, attention_mask, scale,
                                                      getattr(module, "is_causal", True)))
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
