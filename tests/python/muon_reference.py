"""The float64 Newton–Schulz of DESIGN section 2.1, the update of Muon's options and the float64 one-process
optimizer (Reference: Muon and AdamW, DESIGN sections 1 and 2.1) that the Python tests compare dmuon against."""

import math

import torch

KELLER = (3.4445, -4.7750, 2.0315)


def newton_schulz_ref(u, steps=5):
    """Keller's quintic on the transposed-if-tall matrix u (rows, cols), normalised by its Frobenius
    norm + 1e-7, in float64."""
    x = u.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    a, b, c = KELLER
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def update_scale(rows, cols, kind):
    """s of Muon's update W ← W·(1 − lr·wd) − lr·s·O for an m × n = rows × cols matrix, by the scale's
    definition (docs/optimizers.md, "Update scales")."""
    return {"original": max(1.0, rows / cols) ** 0.5,   # KellerJordan/Muon
            "match_rms_adamw": 0.2 * max(rows, cols) ** 0.5,  # Moonlight
            "spectral": (rows / cols) ** 0.5,             # RMS→RMS operator norm 1
            "unit_rms": max(rows, cols) ** 0.5}[kind]     # element RMS 1


def normuon_ref(o, v, beta2):
    """NorMuon's normalization of an orthogonalized matrix o (rows, cols) with its per-row second moment v (rows,)
    (arXiv 2510.05491, algorithm 1; microsoft/dion's normuon.py): (normalized o, new v), float64."""
    o = o.double()
    v = beta2 * v + (1 - beta2) * (o * o).mean(dim=1)
    normalized = o / (v.sqrt() + 1e-8)[:, None]
    return normalized * (o.norm() / normalized.norm().clamp(min=1e-8)), v


def stored(t, dtype):
    """A state value as a DMuon with state_dtype `dtype` (a torch dtype or a param group's name of one) stores it:
    t itself (float32, None: the tests' float32 parameters), or t rounded to bfloat16, to nearest even from its
    float64 value in one rounding (8 significant bits; torch's .to(torch.bfloat16) of a float64 rounds twice, through
    float32), kept as float64."""
    if dtype in (None, torch.float32, "float32"):
        return t
    if dtype not in (torch.bfloat16, "bfloat16"):
        raise ValueError(f"stored: no rounding rule for state_dtype {dtype}")
    mantissa, exponent = torch.frexp(t)  # t = mantissa · 2^exponent, |mantissa| in [0.5, 1)
    return torch.ldexp(torch.round(mantissa * 256) / 256, exponent)  # torch.round: half to even


def scaled_orthogonal_ref(u, options, scale="match_rms_adamw", variance=None):
    """s·O of a matrix u (rows, cols) under a param group's Muon options (missing ones: the defaults, `scale`
    for the scale): Newton–Schulz of u, or of each block split off it by hand (split_heads or split_sizes
    along split_dim) with each block's own s, as if each block were a parameter. variant="normuon": each
    block's O normalized by normuon_ref with its v, variance[block index] (absent: zeros), which it updates
    (stored by the options' state_dtype: the normalization uses the new v, the next step the stored one)."""
    steps, extra = options.get("ns_steps", 5), options.get("extra_scale_factor", 1.0)
    kind = options.get("scale", scale)
    dim, heads, sizes = options.get("split_dim", 0), options.get("split_heads"), options.get("split_sizes")
    if heads is None and sizes is None:
        blocks = [u]
    else:
        blocks = torch.split(u, list(sizes) if sizes is not None else u.shape[dim] // heads, dim)
    out = []
    for index, block in enumerate(blocks):
        o = newton_schulz_ref(block, steps)
        if options.get("variant", "muon") == "normuon":
            v = variance.get(index, torch.zeros(o.shape[0], dtype=torch.float64))
            o, new = normuon_ref(o, v, options.get("normuon_beta2", 0.95))
            variance[index] = stored(new, options.get("state_dtype"))
        out.append(o * update_scale(block.shape[0], block.shape[1], kind) * extra)
    return torch.cat(out, dim)


def muon_apply_ref(w, o, lr, weight_decay, s, cautious_wd=False):
    """W·(1 − lr·wd) − lr·s·O; with cautious weight decay the decay only where W·O ≥ 0 (arXiv 2510.12402)."""
    decayed = w * (1 - lr * weight_decay)
    if cautious_wd:
        decayed = torch.where(w * o >= 0, decayed, w)
    return decayed - lr * s * o


def qk_clip_ref(w_q, w_k, maxima, tau, kv_heads, alpha=0.5):
    """QK-clip of Kimi K2 (arXiv 2507.20534, MuonClip) with grouped queries as Megatron's qk_clip: per key-value
    group g, γ = min(1, τ / max of its query heads' maximum logits); W_q's rows of the group's query heads times
    γ^α, W_k's rows of head g times γ^(1−α) (a bias is a W of one column). Returns the new (W_q, W_k), float64."""
    heads = maxima.numel()
    w_q, w_k = w_q.double().clone(), w_k.double().clone()
    q_rows, k_rows = w_q.shape[0] // heads, w_k.shape[0] // kv_heads
    per_group = heads // kv_heads
    for g in range(kv_heads):
        s = float(maxima[g * per_group:(g + 1) * per_group].max())
        gamma = tau / s if s > tau else 1.0
        w_q[g * per_group * q_rows:(g + 1) * per_group * q_rows] *= gamma ** alpha
        w_k[g * k_rows:(g + 1) * k_rows] *= gamma ** (1 - alpha)
    return w_q, w_k


def fused_qk_clip_ref(w_qkv, maxima, tau, kv_heads, layout, alpha=0.5):
    """qk_clip_ref on a fused qkv weight (or a bias as a W of one column): rows [q heads, k heads, v heads]
    ("stacked") or per key-value group [its q heads, its k head, its v head] ("grouped", Megatron's); v untouched.
    Returns the new W, float64."""
    heads = maxima.numel()
    size = w_qkv.shape[0] // (heads + 2 * kv_heads)
    if layout == "stacked":
        q, k, v = w_qkv.double().split([heads * size, kv_heads * size, kv_heads * size])
        return torch.cat([*qk_clip_ref(q, k, maxima, tau, kv_heads, alpha), v])
    blocks = w_qkv.double().view(kv_heads, heads // kv_heads + 2, size, *w_qkv.shape[1:])  # (G, H/G + 2, d, ...)
    q = blocks[:, :-2].reshape(heads * size, *w_qkv.shape[1:])
    k = blocks[:, -2].reshape(kv_heads * size, *w_qkv.shape[1:])
    q, k = qk_clip_ref(q, k, maxima, tau, kv_heads, alpha)
    out = blocks.clone()
    out[:, :-2] = q.view(kv_heads, heads // kv_heads, size, *w_qkv.shape[1:])
    out[:, -2] = k.view(kv_heads, size, *w_qkv.shape[1:])
    return out.reshape(w_qkv.shape)


def latent_qk_clip_ref(w_q, w_kv, maxima, tau, nope, rope, v, alpha=0.5):
    """QK-clip of Kimi K2 for multi-head latent attention (arXiv 2507.20534, MuonClip; Megatron's
    MLASelfAttention.clip_qk): per head h, γ = min(1, τ / its maximum logit); W_q's head rows [q_C (nope rows),
    q_R (rope rows)] times [γ^α, γ], W_kv's head rows [k_C (nope rows), v (v rows)] times [γ^(1−α), 1]; the shared
    rotary key untouched. Returns the new (W_q, W_kv), float64."""
    w_q, w_kv = w_q.double().clone(), w_kv.double().clone()
    for h, s in enumerate(maxima.tolist()):
        gamma = tau / s if s > tau else 1.0
        q = w_q[h * (nope + rope):(h + 1) * (nope + rope)]
        q[:nope] *= gamma ** alpha
        q[nope:] *= gamma
        w_kv[h * (nope + v):h * (nope + v) + nope] *= gamma ** (1 - alpha)
    return w_q, w_kv


def muon_matrices(w):
    """w as a (count, rows, cols) stack of its Muon matrices: a 3-D parameter is a stack of experts (the tests'
    models have no other), any other one (out, in·k…) matrix."""
    return w if w.dim() == 3 else w.reshape(1, w.shape[0], -1)


class Reference:
    """Muon (lerp momentum, nesterov, NS per matrix, scale, decoupled decay; the options of a
    parameter's hyper: ns_steps, scale, extra_scale_factor, cautious_wd, split, NorMuon) + AdamW
    (torch.optim.AdamW), float64. The rounding rule of a hyper's state_dtype (bfloat16): each state value (Muon's
    momentum, NorMuon's v, AdamW's m and v) is rounded to bfloat16 when it is stored (`stored`); the step's math
    uses the values it computed, in float64, the next step the stored ones."""

    def __init__(self, values, hyper, clip=None, scale="match_rms_adamw"):
        """values: the initial tensors by name; hyper: per name its param group's values (a DMuon's: hyper_of),
        settable before each step; clip: clip_grad_norm's max norm; scale: Muon's scale where hyper has none."""
        self.w = {n: v.detach().double().clone() for n, v in values.items()}
        self.hyper, self.clip, self.scale = hyper, clip, scale
        self.state = {n: {} for n in values}

    @classmethod
    def of_muon_names(cls, initial, muon, hyper, scale, clip=None, momentum=0.95):
        """Muon (Nesterov, `momentum`) on the names `muon` with hyper's lr and weight_decay, AdamW on the rest with
        its adamw_lr, adamw_betas, adamw_eps and adamw_weight_decay: one setting for every parameter."""
        muon = set(muon)
        return cls(initial, {n: dict(use_muon=True, momentum=momentum, nesterov=True, lr=hyper["lr"],
                                     weight_decay=hyper["weight_decay"]) if n in muon else
                             dict(use_muon=False, lr=hyper["adamw_lr"], betas=hyper["adamw_betas"],
                                  eps=hyper["adamw_eps"], weight_decay=hyper["adamw_weight_decay"])
                             for n in initial}, clip, scale)

    def step(self, grads):
        """One step on the full gradients by name; returns the global gradient norm (before clipping)."""
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
        factor = self.clip / (norm + 1e-6) if self.clip and norm > self.clip else 1.0
        for name, g in grads.items():
            g = g.double() * factor
            h, st, w = self.hyper[name], self.state[name], self.w[name]
            if h["use_muon"]:
                beta = h["momentum"]
                m = beta * st.get("m", torch.zeros_like(w)) + (1 - beta) * g
                st["m"] = stored(m, h.get("state_dtype"))
                u = (1 - beta) * g + beta * m if h["nesterov"] else m
                variances = st.setdefault("normuon_v", {})  # NorMuon's, per matrix of the parameter, per block
                so = torch.stack([scaled_orthogonal_ref(m, h, self.scale, variances.setdefault(j, {}))
                                  for j, m in enumerate(muon_matrices(u))]).reshape(w.shape)
                self.w[name] = muon_apply_ref(w, so, h["lr"], h["weight_decay"], 1.0, h.get("cautious_wd", False))
            else:
                b1, b2 = h["betas"]
                st["t"] = st.get("t", 0) + 1
                m = b1 * st.get("m", torch.zeros_like(w)) + (1 - b1) * g
                v = b2 * st.get("v", torch.zeros_like(w)) + (1 - b2) * g * g
                st["m"], st["v"] = stored(m, h.get("state_dtype")), stored(v, h.get("state_dtype"))
                bias1, bias2 = 1 - b1 ** st["t"], 1 - b2 ** st["t"]
                w = w * (1 - h["lr"] * h["weight_decay"])
                self.w[name] = w - (h["lr"] / bias1) * m / (v.sqrt() / math.sqrt(bias2) + h["eps"])
        return norm


def hyper_of(opt):
    """{parameter name, as DMuon names it: its param group's values}."""
    groups = [g for g in opt.param_groups for _ in g["params"]]
    return {n: dict(g) for n, g in zip(opt.param_groups_names, groups)}
