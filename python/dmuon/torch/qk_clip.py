"""QK-clip (MuonClip: Kimi K2, arXiv 2507.20534; Megatron's qk_clip for grouped-query attention), after the step.

The model reports, per attention and per query head h, the maximum logit it saw this step (QKClip.report; several
reports in a step, micro-batches or ranks, keep the largest): S_h = max over the step's batch of q_i·k_j·scaling,
the softmax's input. After the update, per key-value group g (the query heads sharing one key head; multi-head
attention: one query head per group):
    S_g = max_{h in g} S_h,   γ_g = τ / S_g where S_g > τ, else 1
    W_q's rows of every query head of g  ← ·γ_g^α,   W_k's rows of key head g  ← ·γ_g^(1−α)     (α = 0.5: K2's √γ)
and their biases likewise, so every logit of group g is multiplied by γ_g (at most τ on the step's batch). Multi-
head attention with α = 0.5 is Kimi K2's rule; a group's common γ is Megatron's for grouped queries. Multi-head
latent attention (K2's own q_C, k_C, q_R split) is not handled.

No collective of its own: each rank puts its maxima in its own slot of the step's gradient all-reduce
(gradient_check.py), so the sum holds every rank's and the largest over the slots is the job's; every rank then
scales the rows it holds (a row shard under fully_shard, the whole matrix on an owner-held matrix's owner, a full
copy on every replica), all with the same γ. Device tensors throughout: the host reads nothing.
"""

from dataclasses import dataclass

import torch

from dmuon.torch.gradient_check import to_device


@dataclass(frozen=True)
class Attention:
    """One attention's projections, by the names DMuon gives its parameters: q's weight (heads × head_dim rows),
    k's weight (kv_heads × head_dim rows), optional biases."""

    q: str
    k: str
    heads: int
    kv_heads: int = None  # None: heads (multi-head attention)
    q_bias: str = None
    k_bias: str = None

    @property
    def groups(self):
        return self.heads if self.kv_heads is None else self.kv_heads


class QKClip:
    """QK-clip of `attentions` (a list of Attention) with threshold tau and exponent alpha on DMuon `optimizer`'s
    parameters, run by its step() (which it joins: one QKClip per optimizer). ValueError naming the attention for a
    parameter the optimizer lacks or a head count that does not divide its rows."""

    def __init__(self, optimizer, tau, attentions, alpha=0.5):
        if not tau > 0:
            raise ValueError(f"QKClip: tau must be > 0, got {tau!r}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"QKClip: alpha must be in [0, 1], got {alpha!r}")
        index = {name: i for i, name in enumerate(optimizer.param_groups_names)}
        self.tau, self.alpha, self.attentions = float(tau), float(alpha), list(attentions)
        self._parts = []  # per attention: {parameter index: "q" or "k"}
        for a in self.attentions:
            if a.groups < 1 or a.heads % a.groups:
                raise ValueError(f"QKClip: attention '{a.q}': {a.heads} query heads do not split into {a.groups} "
                                 "key-value groups")
            parts = {}
            for side, name, count in (("q", a.q, a.heads), ("k", a.k, a.groups), ("q", a.q_bias, a.heads),
                                      ("k", a.k_bias, a.groups)):
                if name is None:
                    continue
                if name not in index:
                    raise ValueError(f"QKClip: attention '{a.q}': no parameter '{name}' in the optimizer")
                rows = optimizer._layouts[index[name]].global_shape[0]
                if rows % count:
                    raise ValueError(f"QKClip: attention '{a.q}': '{name}' has {rows} rows, not a multiple of its "
                                     f"{count} heads")
                parts[index[name]] = side
            self._parts.append(parts)
        self._offsets = [sum(a.heads for a in self.attentions[:i]) for i in range(len(self.attentions))]
        self._heads = sum(a.heads for a in self.attentions)
        self._maxima = None  # (heads of every attention,) float64 on the reports' device; -inf: not reported
        self._optimizer = optimizer
        optimizer._qk_clip = self

    def report(self, attention, maxima):
        """This rank's maximum logits of attention `attention` (its position in `attentions`) in this step: a
        tensor (heads,). Kept as the largest of the step's reports, until the step."""
        a = self.attentions[attention]
        maxima = maxima.detach().reshape(-1).to(torch.float64)
        if maxima.numel() != a.heads:
            raise ValueError(f"QKClip.report: attention '{a.q}' has {a.heads} heads, got {maxima.numel()} maxima")
        if self._maxima is None:
            self._maxima = torch.full((self._heads,), -torch.inf, dtype=torch.float64, device=maxima.device)
        part = self._maxima[self._offsets[attention]:self._offsets[attention] + a.heads]
        torch.maximum(part, maxima.to(part.device), out=part)

    def slots(self, rank, world):
        """This rank's part of the step's all-reduce (world × heads,): its maxima in its own slot, zeros elsewhere
        (so the sum is every rank's maxima); the step's reports are then forgotten."""
        device = None if self._maxima is None else self._maxima.device
        out = torch.zeros((world, self._heads), dtype=torch.float64, device=device)
        out[rank] = -torch.inf if self._maxima is None else self._maxima
        self._maxima = None
        return out.reshape(-1)

    def apply(self, reduced, layouts):
        """The module's rescale of the rows this rank holds, from the all-reduced slots (world × heads,)."""
        world = reduced.numel() // self._heads
        maxima = reduced.view(world, self._heads).max(dim=0).values
        for a, parts, offset in zip(self.attentions, self._parts, self._offsets):
            group_max = maxima[offset:offset + a.heads].view(a.groups, -1).max(dim=1).values  # (groups,)
            gamma = torch.where(group_max > self.tau, self.tau / group_max, torch.ones_like(group_max))
            per_head = {"q": gamma.pow(self.alpha).repeat_interleave(a.heads // a.groups),  # (heads,)
                        "k": gamma.pow(1.0 - self.alpha)}                                 # (groups,)
            for i, side in parts.items():
                layout = layouts[i]
                if layout.held_elsewhere:
                    continue
                local = layout.local(layout.tensor)
                rows = layout.mine.spans[0].indices()
                if not rows:
                    continue
                head_rows = layout.global_shape[0] // per_head[side].numel()
                factor = per_head[side][to_device(rows, torch.long, gamma.device) // head_rows]
                local.mul_(factor.to(local.device, local.dtype).view(-1, *[1] * (local.dim() - 1)))
