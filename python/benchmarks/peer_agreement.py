"""DMuon's 2026-recipe options against the peers' own code run beside it (issue 42), one process on the CPU:

  dion       microsoft/dion's Muon (or NorMuon) and DMuon (engine="torch") on the same parameters for STEPS steps,
             both orthogonalizing with one float32 Newton–Schulz (the torch engine's, handed to dion as its
             newton_schulz_func), momentum 0 and bfloat16-exact gradients (dion casts U to bfloat16 before its
             Newton–Schulz: exact on such U): what is compared is each optimizer's own option arithmetic —
             dion's adjust_lr against our scale ("spectral_norm" = "spectral", "rms_norm" = "match_rms_adamw"),
             cautious weight decay, split_sizes and num_heads (ours split_heads) row blocks with their per-block
             scales, its NorMuon against variant="normuon". Figure: |ours − dion| / |dion's change of the weights|,
             the worst step; beside it each one against the float64 reference (tests/python/muon_reference.py),
             over the reference's change. peer_agreement_fsdp2.py runs these cases at W ranks under FSDP2.
  megatron   Megatron-LM's QK-clip called on a stand-in for its attention module (its config, maxima and weights)
             against dmuon.torch.QKClip on the same weights (a DMuon step at lr 0, then the clip): SelfAttention's
             clip_qk on its fused qkv weight (query groups interleaved [q heads, k, v]) against FusedAttention with
             layout="grouped", multi-head and grouped-query attention, alpha 0.5 and 0.3; MLASelfAttention's clip_qk
             (multi-head latent attention: linear_q_proj or, with a q LoRA rank, linear_q_up_proj, and
             linear_kv_up_proj) against LatentAttention. Figure: the largest elementwise relative gap.

A peer that does not import is skipped with the reason. The peers are never part of dmuon: install or check them out
beside it (microsoft/dion's `dion` package; Megatron-LM's `megatron` package, importable without Transformer Engine)
and put them on PYTHONPATH. Prints a table; --json OUT writes it.

    PYTHONPATH=build/python:/path/to/dion:/path/to/Megatron-LM python3 python/benchmarks/peer_agreement.py [--json OUT]
"""

import argparse
import json
import pathlib
import sys
import types
import warnings

import torch

from dmuon.torch import DMuon, FusedAttention, LatentAttention, QKClip
from dmuon.torch.torch_engine import newton_schulz

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "python"))
from muon_reference import muon_apply_ref, scaled_orthogonal_ref  # noqa: E402

DION_CASES = [  # (case, shapes, dion's optimizer and options, ours)
    ("spectral, cautious wd", [(128, 64), (64, 128)], dict(adjust_lr="spectral_norm", cautious_wd=True),
     dict(scale="spectral", cautious_wd=True)),
    ("AdamW-matched RMS", [(96, 48), (48, 96)], dict(adjust_lr="rms_norm"), dict(scale="match_rms_adamw")),
    ("split_sizes 64+32+32, spectral", [(128, 64)], dict(adjust_lr="spectral_norm", split_sizes=(64, 32, 32)),
     dict(scale="spectral", split_sizes=[64, 32, 32])),
    ("split_sizes, RMS, cautious wd", [(128, 64)],
     dict(adjust_lr="rms_norm", split_sizes=(64, 32, 32), cautious_wd=True),
     dict(scale="match_rms_adamw", split_sizes=[64, 32, 32], cautious_wd=True)),
    ("4 heads, spectral", [(64, 96)], dict(adjust_lr="spectral_norm", num_heads=4), dict(scale="spectral", split_heads=4)),
    # 96 rows and 12 heads divide by 2, 3 and 4 ranks, as dion's split_sizes and num_heads need under FSDP2
    ("split_sizes 48+24+24, RMS", [(96, 64)], dict(adjust_lr="rms_norm", split_sizes=(48, 24, 24)),
     dict(scale="match_rms_adamw", split_sizes=[48, 24, 24])),
    ("12 heads, RMS, cautious wd", [(96, 64)], dict(adjust_lr="rms_norm", num_heads=12, cautious_wd=True),
     dict(scale="match_rms_adamw", split_heads=12, cautious_wd=True)),
    ("NorMuon, spectral", [(128, 64), (64, 128)], dict(normuon=True, adjust_lr="spectral_norm"),
     dict(variant="normuon", scale="spectral")),
    ("NorMuon, split_sizes 48+24+24, RMS", [(96, 64)],
     dict(normuon=True, adjust_lr="rms_norm", split_sizes=(48, 24, 24)),
     dict(variant="normuon", scale="match_rms_adamw", split_sizes=[48, 24, 24])),
    ("NorMuon, 12 heads, spectral, cautious wd", [(96, 64)],
     dict(normuon=True, adjust_lr="spectral_norm", num_heads=12, cautious_wd=True),
     dict(variant="normuon", scale="spectral", split_heads=12, cautious_wd=True)),
]
QK_CASES = [(8, 2, 16, 32, 0.5), (4, 4, 8, 24, 0.5), (6, 3, 4, 12, 0.3), (8, 1, 8, 16, 0.5)]  # heads, groups, hd, hidden, α
MLA_CASES = [(4, 8, 4, 8, 24, None, 0.5), (8, 16, 8, 16, 32, 12, 0.5), (6, 4, 2, 6, 16, 8, 0.3)]  # heads, nope, rope,
# v, hidden, q LoRA rank (None: a plain linear_q_proj of the hidden state), α; kv's input: the latent of rank 12
LR, WD, STEPS, TAU = 0.02, 0.1, 5, 1.0
BETA2 = 0.95  # NorMuon's (dion's muon_beta2, our normuon_beta2)


def ns_float32(u, epsilon=1e-7):
    """dion's newton_schulz_func: the torch engine's float32 Keller quintic, float32 out (dion casts U, not O)."""
    return newton_schulz(u.float(), "keller", 5, "standard", torch.float32, eps=float(epsilon))


def case_inputs(case, shapes):
    """(start weights, gradients of each of the STEPS steps): seeded by the case, so every rank draws the same;
    the gradients bfloat16-exact (dion casts U to bfloat16)."""
    gen = torch.Generator().manual_seed(len(case))
    start = [torch.randn(s, generator=gen) * 0.05 for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(torch.bfloat16).float() for s in shapes] for _ in range(STEPS)]
    return start, grads


def dion_optimizer(params, theirs_opts, mesh=None):
    """dion's Muon (or NorMuon) over params with the case's options, momentum 0, our float32 Newton–Schulz."""
    import dion
    # dion's update functions are torch.compile(fullgraph=True): each case's shapes and options recompile them,
    # past dynamo's default limit of 8 (then a hard failure)
    torch._dynamo.config.recompile_limit = 64
    group = {k: v for k, v in theirs_opts.items() if k in ("split_sizes", "num_heads")}
    extra = dict(muon_beta2=BETA2) if theirs_opts.get("normuon") else {}
    return (dion.NorMuon if theirs_opts.get("normuon") else dion.Muon)(
        [dict(params=params, **group)], distributed_mesh=mesh, lr=LR, mu=0.0, weight_decay=WD, nesterov=False,
        cautious_wd=theirs_opts.get("cautious_wd", False), adjust_lr=theirs_opts["adjust_lr"],
        newton_schulz_func=ns_float32, **extra)


def dmuon_optimizer(named, ours_opts):
    """DMuon (torch engine, float32 Newton–Schulz) over named (name, parameter) pairs, momentum 0."""
    return DMuon([dict(params=named, **ours_opts)], lr=LR, momentum=0.0, nesterov=False, weight_decay=WD,
                 algo="standard", engine="torch", ns_dtype="float32", normuon_beta2=BETA2)


def reference_weights(start, grads, ours_opts, scaled_orthogonal=scaled_orthogonal_ref):
    """The float64 reference (tests/python/muon_reference.py, each option by its definition): the weights after
    each step, [step][matrix]. scaled_orthogonal(u, options, variance=) → s·O (its NorMuon state in variance, a
    dict per matrix)."""
    weights, variances, out = [w.double() for w in start], [{} for _ in start], []
    for step_grads in grads:
        weights = [muon_apply_ref(w, scaled_orthogonal(g, ours_opts, variance=v), LR, WD, 1.0,
                                  ours_opts.get("cautious_wd", False))
                   for w, g, v in zip(weights, step_grads, variances)]
        out.append(weights)
    return out


def relative(a, b, start):
    """|a − b| over |b − start| (Frobenius): a gap measured against b's change of the weights."""
    b = b.double()
    return float((a.double() - b).norm() / (b - start.double()).norm())


def dion_rows():
    rows = []
    for case, shapes, theirs_opts, ours_opts in DION_CASES:
        start, grads = case_inputs(case, shapes)
        theirs = [torch.nn.Parameter(v.clone()) for v in start]
        ours = [torch.nn.Parameter(v.clone()) for v in start]
        dion = dion_optimizer(theirs, theirs_opts)
        dmuon = dmuon_optimizer([(f"w{i}", p) for i, p in enumerate(ours)], ours_opts)
        gap = to_ref = dion_to_ref = 0.0
        for step_grads, ref in zip(grads, reference_weights(start, grads, ours_opts)):
            for params in (theirs, ours):
                for p, g in zip(params, step_grads):
                    p.grad = g.clone()
            dion.step()
            dmuon.step()
            for a, b, r, s in zip(ours, theirs, ref, start):
                gap = max(gap, relative(a.detach(), b.detach(), s))
                to_ref = max(to_ref, relative(a.detach(), r, s))
                dion_to_ref = max(dion_to_ref, relative(b.detach(), r, s))
        rows.append({"peer": "dion", "case": case, "steps": STEPS, "gap": gap, "ours_vs_f64": to_ref,
                     "dion_vs_f64": dion_to_ref})
    return rows


def clip_with_dmuon(weights, attention, maxima, alpha):
    """The weights ({name: tensor}) after a DMuon step at lr 0 and QKClip(attention) with `maxima` reported."""
    params = {n: torch.nn.Parameter(w.clone()) for n, w in weights.items()}
    opt = DMuon(list(params.items()), lr=0.0, ns_dtype="float32")
    clip = QKClip(opt, TAU, [attention], alpha=alpha)
    for p in params.values():
        p.grad = torch.zeros_like(p)
    clip.report(0, maxima)
    opt.step()
    return {n: p.detach() for n, p in params.items()}


def relative_gap(ours, theirs):
    return max(float(((ours[n] - theirs[n]).abs() / theirs[n].abs().clamp_min(1e-30)).max()) for n in theirs)


def megatron_stand_in(maxima, alpha, **fields):
    """A stand-in for a Megatron attention module: its QK-clip config and this step's maxima, plus `fields`."""
    return types.SimpleNamespace(
        config=types.SimpleNamespace(qk_clip=True, qk_clip_threshold=TAU, qk_clip_alpha=alpha,
                                     **fields.pop("config", {})),
        core_attention=types.SimpleNamespace(current_max_attn_logits=maxima.clone()), **fields)


def megatron_rows():
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    rows = []
    for heads, groups, hd, hidden, alpha in QK_CASES:
        per_group = heads // groups
        gen = torch.Generator().manual_seed(heads * 100 + groups)
        fused = torch.randn(groups * (per_group + 2) * hd, hidden, generator=gen)  # per group: [q heads, k, v] rows
        worst, clipped = 0.0, 0
        for _ in range(5):
            maxima = torch.rand(heads, generator=gen) * 2 * TAU
            weight = torch.nn.Parameter(fused.clone())
            attention = megatron_stand_in(maxima, alpha, num_attention_heads_per_partition=heads,
                                          num_query_groups_per_partition=groups, query_projection_size=heads * hd,
                                          kv_projection_size=groups * hd, linear_qkv=types.SimpleNamespace(weight=weight))
            attention._clip_linear_qkv = lambda w, a=attention: SelfAttention._clip_linear_qkv(a, w)
            with torch.no_grad():
                SelfAttention.clip_qk(attention)
            ours = clip_with_dmuon({"qkv": fused}, FusedAttention(qkv="qkv", heads=heads, kv_heads=groups,
                                                                  layout="grouped"), maxima, alpha)
            worst = max(worst, relative_gap(ours, {"qkv": weight.detach()}))
            clipped += int((maxima.view(groups, -1).max(dim=1).values > TAU).sum())
        rows.append({"peer": "megatron", "case": f"QK-clip, fused qkv, {heads} heads / {groups} groups, alpha {alpha} "
                     f"({clipped} groups clipped in 5 trials)", "steps": 5, "gap": worst})
    for heads, nope, rope, v, hidden, q_rank, alpha in MLA_CASES:
        gen = torch.Generator().manual_seed(heads * 1000 + nope)
        q_start = torch.randn(heads * (nope + rope), q_rank or hidden, generator=gen)
        kv_start = torch.randn(heads * (nope + v), 12, generator=gen)
        worst, clipped = 0.0, 0
        for _ in range(5):
            maxima = torch.rand(heads, generator=gen) * 2 * TAU
            q, kv = torch.nn.Parameter(q_start.clone()), torch.nn.Parameter(kv_start.clone())
            q_layer = "linear_q_proj" if q_rank is None else "linear_q_up_proj"
            attention = megatron_stand_in(
                maxima, alpha, config=dict(q_lora_rank=q_rank, qk_head_dim=nope, qk_pos_emb_head_dim=rope,
                                           v_head_dim=v),
                num_attention_heads_per_partition=heads, cache_mla_latents=False,
                linear_kv_up_proj=types.SimpleNamespace(weight=kv), **{q_layer: types.SimpleNamespace(weight=q)})
            attention._clip_q_proj_weight = lambda w, a=attention: MLASelfAttention._clip_q_proj_weight(a, w)
            attention._clip_kv_proj_weight = lambda w, a=attention: MLASelfAttention._clip_kv_proj_weight(a, w)
            with torch.no_grad():
                MLASelfAttention.clip_qk(attention)
            ours = clip_with_dmuon({"q": q_start, "kv": kv_start},
                                   LatentAttention(q="q", kv="kv", heads=heads, qk_nope_head_dim=nope,
                                                   qk_rope_head_dim=rope, v_head_dim=v), maxima, alpha)
            worst = max(worst, relative_gap(ours, {"q": q.detach(), "kv": kv.detach()}))
            clipped += int((maxima > TAU).sum())
        rank = "no q LoRA" if q_rank is None else f"q LoRA rank {q_rank}"
        rows.append({"peer": "megatron", "case": f"QK-clip, latent attention, {heads} heads of {nope}+{rope} (v {v}), "
                     f"{rank}, alpha {alpha} ({clipped} heads clipped in 5 trials)", "steps": 5, "gap": worst})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # the peers' import-time notices (no Transformer Engine, no absl)
    rows = []
    for peer, run in (("dion", dion_rows), ("megatron", megatron_rows)):
        try:
            rows += run()
        except ImportError as error:
            rows.append({"peer": peer, "case": f"skipped: {error}", "steps": 0, "gap": None})
    print("| peer | case | steps | gap | ours vs f64 | dion vs f64 |\n|---|---|---|---|---|---|")
    for r in rows:
        figures = " | ".join("" if r.get(k) is None else f"{r[k]:.2e}" for k in ("gap", "ours_vs_f64", "dion_vs_f64"))
        print(f"| {r['peer']} | {r['case']} | {r['steps']} | {figures} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
