"""QK-clip (MuonClip: Kimi K2, arXiv 2507.20534; Megatron's qk_clip for grouped-query and latent attention), after the
step.

The model reports, per attention and per query head h, the maximum logit it saw this step (QKClip.report; several
reports in a step, micro-batches or ranks, keep the largest; under tensor parallelism each rank reports the heads it
computes): S_h = max over the step's batch of q_i·k_j·scaling,
the softmax's input. After the update, per key-value group g (the query heads sharing one key head; multi-head and
latent attention: one query head per group):
    S_g = max_{h in g} S_h,   γ_g = τ / S_g where S_g > τ, else 1
and every row of the projections that makes g's logits is scaled by a power of γ_g, so that each logit of g is
multiplied by γ_g (at most τ on the step's batch):
    Attention        W_q's rows of g's query heads ·γ_g^α,  W_k's rows of key head g ·γ_g^(1−α)   (biases likewise)
    FusedAttention   the same rows of one fused qkv weight (and bias); its v rows untouched
    LatentAttention  (multi-head latent attention, DeepSeek-V2/V3, Kimi K2) per head h: W_q's q_C rows (no rotary)
                     ·γ_h^α and its q_R rows (rotary) ·γ_h, W_kv's k_C rows ·γ_h^(1−α), its v rows untouched; the
                     rotary key k_R is shared by every head and left alone (its logit part q_R·k_R gets γ_h whole)
α = 0.5 on multi-head attention is Kimi K2's √γ; a group's common γ is Megatron's for grouped queries; the latent rule
is K2's and Megatron's MLASelfAttention.clip_qk.

Each attention becomes, per parameter it names, a rule per global row: (its group g, its exponent e), the row scaled
by γ_g^e (e = 0: untouched). No collective of its own: each rank puts its maxima in its own slot of the step's
gradient all-reduce (gradient_check.py), so the sum holds every rank's and the largest over the slots is the job's;
every rank then scales the rows it holds (a row shard under fully_shard or tensor parallelism, the whole matrix on an
owner-held matrix's owner, a full copy on every replica), all with the same γ; QKClip.max_logits keeps the step's
S_h, the figure training logs watch. Device tensors throughout: the host reads nothing.

A maximum the rule cannot take (NaN, +inf, or a finite S so large that γ = τ/S falls below the smallest normal
number of a clipped parameter's dtype, which would scale its rows to 0) is never used: the step's clip is skipped
whole (γ = 1 everywhere), so a clip never scales a weight by 0 or NaN and, as γ ∈ (0, 1], never turns a finite weight
non-finite; the optimizer then follows its nonfinite= option (optimizer.py): "error" skips the whole step on the
device and raises naming the attention, its layer and the head; "skip" updates without the clip and counts it
(skipped_steps, last_skip). −inf (a head whose logits were all masked, or nobody reported), 0 and negative maxima
are below τ: γ = 1. τ = ∞ only records max_logits and never skips.
"""

import contextlib
from dataclasses import dataclass

import torch

from dmuon.torch.gradient_check import to_device
from dmuon.torch.step_hooks import StepHook


def _head_size(name, rows, heads):
    """Rows per head of parameter `name` (rows of them in heads heads); ValueError when they do not divide."""
    if heads < 1 or rows % heads:
        raise ValueError(f"'{name}' has {rows} rows, not a multiple of its {heads} heads")
    return rows // heads


def _rule(block_groups, pattern):
    """(group per row (rows,) long, exponent per row (rows,) float64) of consecutive blocks of rows, each laid out as
    pattern ((row count, exponent) pairs), block b in group block_groups[b]."""
    exponent = torch.tensor([e for count, e in pattern for _ in range(count)], dtype=torch.float64)
    group = torch.as_tensor(block_groups, dtype=torch.long).repeat_interleave(exponent.numel())
    return group, exponent.repeat(len(block_groups))


@dataclass(frozen=True)
class Attention:
    """Separate projections, by the names DMuon gives its parameters: q's weight (heads × head_dim rows), k's weight
    (kv_heads × head_dim rows), optional biases."""

    q: str
    k: str
    heads: int
    kv_heads: int = None  # None: heads (multi-head attention)
    q_bias: str = None
    k_bias: str = None

    @property
    def groups(self):
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def label(self):
        return self.q

    def query_blocks(self, rows):
        """(rows a block, the global query heads of block b) of the query weight of `rows` rows: what a TP rank
        holds whole blocks of (heads_of_rows); None where no block of rows is a set of query heads alone."""
        return rows // self.heads, lambda b: [b]

    def row_rules(self, alpha, rows_of):
        """[(parameter name, (group per row, exponent per row))]."""
        out = []
        for name, count, exponent in ((self.q, self.heads, alpha), (self.k, self.groups, 1.0 - alpha),
                                      (self.q_bias, self.heads, alpha), (self.k_bias, self.groups, 1.0 - alpha)):
            if name is not None:
                size = _head_size(name, rows_of(name), count)
                per_group = count // self.groups  # query heads: heads // groups; key heads: 1
                out.append((name, _rule([h // per_group for h in range(count)], [(size, exponent)])))
        return out


@dataclass(frozen=True)
class FusedAttention:
    """One fused qkv projection (weight, optional bias) of heads query heads and kv_heads key and value heads of equal
    size, its rows laid out as `layout`: "stacked" [every query head, every key head, every value head] (a GPT's
    c_attn, Phi-3's qkv_proj) or "grouped" [per key-value group: its query heads, its key head, its value head]
    (Megatron's linear_qkv)."""

    qkv: str
    heads: int
    kv_heads: int = None  # None: heads
    bias: str = None
    layout: str = "stacked"

    @property
    def groups(self):
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def label(self):
        return self.qkv

    def query_blocks(self, rows):
        if self.layout != "grouped":  # stacked: a row shard of the fused weight is not some heads' q, k and v
            return None
        per_group = self.heads // self.groups
        return rows // self.groups, lambda g: list(range(g * per_group, (g + 1) * per_group))

    def row_rules(self, alpha, rows_of):
        if self.layout not in ("stacked", "grouped"):
            raise ValueError(f"layout must be 'stacked' or 'grouped', got {self.layout!r}")
        per_group = self.heads // self.groups
        out = []
        for name in (self.qkv, self.bias):
            if name is None:
                continue
            size = _head_size(name, rows_of(name), self.heads + 2 * self.groups)
            if self.layout == "grouped":
                rule = _rule(list(range(self.groups)), [(per_group * size, alpha), (size, 1.0 - alpha), (size, 0.0)])
            else:
                q = _rule([h // per_group for h in range(self.heads)], [(size, alpha)])
                k = _rule(list(range(self.groups)), [(size, 1.0 - alpha)])
                v = _rule([0] * self.groups, [(size, 0.0)])
                rule = tuple(torch.cat(parts) for parts in zip(q, k, v))
            out.append((name, rule))
        return out


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2/V3's MLA, Kimi K2's): q, the weight making the queries (q_proj, or
    q_b_proj after a low-rank q_a_proj), heads × (qk_nope_head_dim + qk_rope_head_dim) rows, each head's rows without
    rotary embedding first; kv, the up-projection of the compressed keys and values (kv_b_proj), heads ×
    (qk_nope_head_dim + v_head_dim) rows, each head's key rows first. The shared rotary key (kv_a_proj_with_mqa's last
    qk_rope_head_dim rows) is not clipped."""

    q: str
    kv: str
    heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def groups(self):
        return self.heads

    @property
    def label(self):
        return self.q

    def query_blocks(self, rows):
        return rows // self.heads, lambda b: [b]

    def row_rules(self, alpha, rows_of):
        out = []
        for name, pattern in ((self.q, [(self.qk_nope_head_dim, alpha), (self.qk_rope_head_dim, 1.0)]),
                              (self.kv, [(self.qk_nope_head_dim, 1.0 - alpha), (self.v_head_dim, 0.0)])):
            size = _head_size(name, rows_of(name), self.heads)
            if size != sum(count for count, _ in pattern):
                raise ValueError(f"'{name}' has {size} rows a head, not the " +
                                 " + ".join(str(count) for count, _ in pattern) + " of its head dimensions")
            out.append((name, _rule(list(range(self.heads)), pattern)))
        return out


def heads_of_rows(attention, rows, total):
    """The global query heads of `rows` (sorted global row indices, a TP rank's) of the attention's query weight of
    `total` rows (Attention's q, FusedAttention's qkv, LatentAttention's q), in row order; None where they are not
    whole blocks (attention.query_blocks: heads, or a grouped fused weight's key-value groups)."""
    blocks = attention.query_blocks(total)
    if blocks is None or not rows:
        return None
    size, heads_of = blocks
    starts = rows[::size]
    if size < 1 or any(s % size for s in starts) or rows != [s + i for s in starts for i in range(size)]:
        return None
    return [h for s in starts for h in heads_of(s // size)]


class QKClip(StepHook):
    """QK-clip of `attentions` (a list of Attention, FusedAttention or LatentAttention) with threshold tau and
    exponent alpha on DMuon `optimizer`'s parameters, run by its step() (which it joins: one QKClip per optimizer).
    ValueError naming the attention for a parameter the optimizer lacks, head counts that do not fit its rows, or a
    parameter clipped by two rules."""

    def __init__(self, optimizer, tau, attentions, alpha=0.5):
        if not tau > 0:
            raise ValueError(f"QKClip: tau must be > 0, got {tau!r}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"QKClip: alpha must be in [0, 1], got {alpha!r}")
        index = {name: i for i, name in enumerate(optimizer.param_groups_names)}
        layouts = optimizer.layouts()

        def rows_of(name):
            if name not in index:
                raise ValueError(f"no parameter '{name}' in the optimizer")
            return layouts[index[name]].global_shape[0]

        self.tau, self.alpha, self.attentions = float(tau), float(alpha), list(attentions)
        self._parts = []  # per attention: {parameter index: (group per global row, exponent per global row)}
        clipped_by = {}
        for a in self.attentions:
            try:
                if a.groups < 1 or a.heads % a.groups:
                    raise ValueError(f"{a.heads} query heads do not split into {a.groups} key-value groups")
                rules = a.row_rules(self.alpha, rows_of)
            except ValueError as error:
                raise ValueError(f"QKClip: attention '{a.label}': {error}") from None
            for name, _ in rules:
                if name in clipped_by:
                    raise ValueError(f"QKClip: attention '{a.label}': '{name}' is already clipped (attention "
                                     f"'{clipped_by[name]}')")
                clipped_by[name] = a.label
            self._parts.append({index[name]: rule for name, rule in rules})
        self._offsets = [sum(a.heads for a in self.attentions[:i]) for i in range(len(self.attentions))]
        self._heads = sum(a.heads for a in self.attentions)
        # The largest maximum the rule takes: γ = τ/S must stay a normal number of every clipped parameter's dtype.
        tiny = max((torch.finfo(layouts[i].tensor.dtype).tiny for parts in self._parts for i in parts),
                   default=torch.finfo(torch.float32).tiny)
        self._ceiling = self.tau / tiny
        self._maxima = None  # (heads of every attention,) float64 on the reports' device; -inf: not reported
        self.max_logits = None  # per attention, the job's largest logit per query head at the last step (for logs)
        self.skipped = None  # () bool device tensor: the last step's clip was skipped (a maximum it cannot take)
        self.skipped_steps = 0  # steps whose clip was skipped (nonfinite="skip"), counted when the step settles
        self.last_skip = None  # why the last skipped clip was skipped: the maxima it could not take
        self._on_device = {}  # (parameter index, device) → its rules there
        self._head_index = {}  # (reported heads, device) → their indices there
        self._paused = 0  # > 0: inside paused(), reports ignored
        self._optimizer = optimizer
        optimizer.add_step_hook(self, key="qk_clip")

    @contextlib.contextmanager
    def paused(self):
        """Reports inside are ignored: a forward that is not training's (a pipeline stage's metadata inference on
        uninitialized inputs, an evaluation)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def report(self, attention, maxima, heads=None):
        """This rank's maximum logits of attention `attention` (its position in `attentions`) in this step: a tensor
        (heads,), or (len(heads),) for the query heads `heads` alone (their global indices, a list of ints: under
        tensor parallelism a rank computes its heads only). Kept as the largest of the step's reports, until the
        step."""
        if self._paused:
            return
        a = self.attentions[attention]
        maxima = maxima.detach().reshape(-1).to(torch.float64)
        count = a.heads if heads is None else len(heads)
        if maxima.numel() != count:
            raise ValueError(f"QKClip.report: attention '{a.label}' reports {count} heads, got {maxima.numel()} "
                             "maxima")
        if heads is not None and (len(set(heads)) != count or not all(0 <= h < a.heads for h in heads)):
            raise ValueError(f"QKClip.report: attention '{a.label}' has heads 0..{a.heads - 1}, got {list(heads)}")
        if self._maxima is None:
            self._maxima = torch.full((self._heads,), -torch.inf, dtype=torch.float64, device=maxima.device)
        part = self._maxima[self._offsets[attention]:self._offsets[attention] + a.heads]
        if heads is None:
            torch.maximum(part, maxima.to(part.device), out=part)
        else:
            key = (tuple(heads), part.device)
            if key not in self._head_index:
                self._head_index[key] = to_device(list(heads), torch.long, part.device)
            index = self._head_index[key]
            part[index] = torch.maximum(part[index], maxima.to(part.device))

    def extra(self, rank, world):
        """This rank's part of the step's all-reduce (world × heads,): its maxima in its own slot, zeros elsewhere
        (so the sum is every rank's maxima); the step's reports are then forgotten (StepHook)."""
        device = None if self._maxima is None else self._maxima.device
        out = torch.zeros((world, self._heads), dtype=torch.float64, device=device)
        out[rank] = -torch.inf if self._maxima is None else self._maxima
        self._maxima = None
        return out.reshape(-1)

    def _rule_on(self, i, rule, device):
        key = (i, device)
        if key not in self._on_device:
            self._on_device[key] = tuple(t.to(device) for t in rule)
        return self._on_device[key]

    def _job_maxima(self, reduced):
        """The job's maximum per head (heads,) from the all-reduced slots (world × heads,): the largest over the
        ranks' slots, NaN where any slot is NaN."""
        if not self._heads:
            return reduced.new_empty(0)
        return reduced.view(-1, self._heads).max(dim=0).values

    def _takes(self, maxima):
        """Per head (heads,) bool: whether the rule can take its maximum (−inf, or finite and at most the ceiling
        where γ = τ/S stays a normal number of the clipped dtypes); every head under τ = ∞."""
        if self.tau == float("inf"):
            return torch.ones_like(maxima, dtype=torch.bool)
        return (maxima == -torch.inf) | (torch.isfinite(maxima) & (maxima <= self._ceiling))

    def usable(self, reduced):
        """() bool device tensor: whether the step's clip can run, every maximum taken (from the all-reduced
        slots; no host read)."""
        return self._takes(self._job_maxima(reduced)).all()

    def veto(self, reduced):
        """usable() (StepHook): under nonfinite="error" a maximum the rule cannot take skips the whole step."""
        return self.usable(reduced)

    def settle(self, reduced, update):
        """The problems of a settled step (StepHook): its maxima the rule could not take, described; under
        nonfinite="skip" also counted (count_skip), as the update ran without the clip."""
        unusable = self.problems(reduced)
        if not unusable:
            return []
        problem = self.describe(unusable)
        if self._optimizer.nonfinite == "skip":
            self.count_skip(f"update {update}: {problem}; the update ran without it")
        return [problem]

    def problems(self, reduced):
        """[(attention position, query head, maximum)] the rule cannot take, from the all-reduced slots (a host
        list or tensor: what the optimizer reads when the step settles)."""
        maxima = self._job_maxima(torch.as_tensor(reduced, dtype=torch.float64))
        bad = (~self._takes(maxima)).nonzero().flatten().tolist()
        out = []
        for h in bad:
            i = max(k for k, offset in enumerate(self._offsets) if offset <= h)
            out.append((i, h - self._offsets[i], float(maxima[h])))
        return out

    def describe(self, problems):
        """The problems (problems()) in words: each attention by its query parameter and layer (the first number in
        that parameter's name, else its position in attentions), the query head and the maximum."""
        def one(i, head, value):
            label = self.attentions[i].label
            layer = next((f"layer {part}" for part in label.split(".") if part.isdigit()),
                         f"attention {i} of the QKClip")
            return f"attention '{label}' ({layer}) query head {head}: {value}"
        return ("QK-clip cannot take the maximum logit of " + "; ".join(one(*p) for p in problems) +
                f" (NaN, inf, or above {self._ceiling:.3g}, where γ = τ/S would scale the weights to 0)")

    def count_skip(self, message):
        """A settled step whose clip was skipped (nonfinite="skip"): counted, with its reason kept in last_skip."""
        self.skipped_steps += 1
        self.last_skip = message

    def after_step(self, reduced, written):
        """The module's rescale of the rows this rank holds, from the all-reduced slots (world × heads,) (StepHook),
        where it is allowed (a () bool device tensor): under nonfinite="error" where the step's update was kept
        (written; a maximum the rule cannot take vetoed it), under "skip" where every maximum is taken (usable());
        else nothing changes (γ = 1). Returns the step's qk_clip_skipped for the optimizer's last_stats."""
        layouts = self._optimizer.layouts()
        allowed = written if self._optimizer.nonfinite == "error" else self.usable(reduced)
        maxima = self._job_maxima(reduced)
        self.max_logits = [maxima[offset:offset + a.heads] for a, offset in zip(self.attentions, self._offsets)]
        self.skipped = ~self._takes(maxima).all()
        for a, parts, offset in zip(self.attentions, self._parts, self._offsets):
            group_max = maxima[offset:offset + a.heads].view(a.groups, -1).max(dim=1).values  # (groups,)
            gamma = torch.where(allowed & (group_max > self.tau), self.tau / group_max, torch.ones_like(group_max))
            for i, rule in parts.items():
                layout = layouts[i]
                if layout.held_elsewhere:
                    continue
                local = layout.local(layout.tensor)
                rows = layout.mine.spans[0].indices()
                if not rows:
                    continue
                group, exponent = self._rule_on(i, rule, gamma.device)
                mine = to_device(rows, torch.long, gamma.device)
                factor = gamma[group[mine]].pow(exponent[mine])  # (local rows,)
                local.mul_(factor.to(local.device, local.dtype).view(-1, *[1] * (local.dim() - 1)))
        return {"qk_clip_skipped": self.skipped}
