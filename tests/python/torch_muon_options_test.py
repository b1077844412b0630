"""Muon's options per param group (python/dmuon/torch/muon_options.py), one process
(torch_muon_options_ranks_test.py runs them at several ranks, in both modes):
  torch.optim.Muon   groups with their own ns_steps and scale equal torch.optim.Muon's per-group
                     ns_steps / adjust_lr_fn (both with the float64 reference Newton–Schulz) and the
                     float64 reference; a unit_rms group with an extra_scale_factor and cautious weight
                     decay the reference alone (torch.optim.Muon has neither)
  whole optimizer    a group's options give its matrices the update of an optimizer built with those
                     options, bit for bit (coefficients, algorithm, steps, scales, cautious weight decay)
  buckets            a bucket batches matrices of equal options only; one Newton–Schulz handle per setting
  checkpoints        a state_dict carries the groups' options; loading it sets them, resuming bit for bit
  schedulers         an LR scheduler sets each group's lr; the options stay
  errors             a bad option in a group names the group and the key; every option at and past its bounds
                     (non-finite ones included) refused at construction, and by load_state_dict with nothing changed
  scales             muon_scale's four kinds against their definitions; an unknown kind raises
  split              split Newton–Schulz against the matrix split by hand; a split that does not fit is named
  NorMuon            against the float64 formula (unsplit, column and row blocks), its v's shape, a resume bit
                     for bit, a skipped step that keeps v, v's packing into another dtype's message
  QK-clip            against Kimi K2's rule in float64 (grouped queries, biases, two reports a step); the
                     Hugging Face helper's maxima against logits computed by hand (eager and sdpa), outputs kept;
                     maxima it cannot take (inf, NaN, γ underflowing): raised with nothing changed, or the clip
                     skipped and counted; −inf, 0, negative, τ: no clip; a huge finite one clips to finite weights;
                     a non-finite gradient with a clip: nothing changed; τ and α at and past their bounds (issue 58)

Run: PYTHONPATH=build/python python -m pytest -q tests/python/torch_muon_options_test.py
"""

import copy
import io
import re
from types import SimpleNamespace

import pytest
import torch
from torch.optim import lr_scheduler

from dmuon.torch import Attention, DMuon, FusedAttention, LatentAttention, QKClip, hf_qk_clip
from dmuon.torch.muon_options import SCALES, muon_scale
from dmuon.torch.exchange import pack, packed_numel, unpack
from dmuon.torch.qk_clip import heads_of_rows
from dmuon.torch.qk_clip_hf import heads_computed
from muon_reference import (KELLER, Reference, fused_qk_clip_ref, hyper_of, latent_qk_clip_ref, newton_schulz_ref,
                            qk_clip_ref, update_scale)

SPECS = [("a.weight", (12, 5)), ("b.weight", (4, 10)), ("c.weight", (12, 5)), ("d.weight", (6, 6))]
STEPS = 6
FLOAT32_EPS = torch.finfo(torch.float32).eps
LR, MOMENTUM, WD = 0.02, 0.9, 0.1


def parameters(seed=7):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.5) for name, shape in SPECS}


def grads_of(step):
    gen = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(shape, generator=gen) for name, shape in SPECS}


def set_grads(params, grads):
    for name, p in params.items():
        p.grad = grads[name].to(p.dtype).clone()


# (group options, torch.optim.Muon's spelling of them or None where it has no such option)
GROUP_OPTIONS = {"a.weight": (dict(scale="original"), dict(adjust_lr_fn="original")),
                 "b.weight": (dict(scale="spectral", ns_steps=3), dict(adjust_lr_fn="spectral_unclamped", ns_steps=3)),
                 "c.weight": (dict(ns_steps=4), dict(adjust_lr_fn="match_rms_adamw", ns_steps=4)),
                 "d.weight": (dict(scale="unit_rms", extra_scale_factor=0.3, cautious_wd=True), None)}


def test_groups_with_their_own_options_equal_torch_optim_muon_per_group(monkeypatch):
    params = parameters()
    opt = DMuon([{"params": [(n, params[n])], **options} for n, (options, _) in GROUP_OPTIONS.items()],
                lr=LR, momentum=MOMENTUM, weight_decay=WD, algo="standard", balancer="lpt", ns_dtype="float32")

    def reference_newton_schulz(grad, ns_coefficients, ns_steps, eps):
        assert tuple(ns_coefficients) == KELLER
        return newton_schulz_ref(grad, ns_steps)

    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", reference_newton_schulz)
    twins = {n: torch.nn.Parameter(params[n].detach().double().clone()) for n, (_, t) in GROUP_OPTIONS.items() if t}
    muon = torch.optim.Muon([{"params": [twins[n]], **GROUP_OPTIONS[n][1]} for n in twins], lr=LR,
                            weight_decay=WD, momentum=MOMENTUM, nesterov=True)
    ref = Reference({n: p.detach() for n, p in params.items()}, hyper_of(opt))
    for t in range(1, STEPS + 1):
        grads = grads_of(t)
        ref.step(grads)
        set_grads(params, grads)
        set_grads(twins, {n: g.double() for n, g in grads.items()})
        opt.step()
        muon.step()
        for n, (rows, cols) in SPECS:
            options = GROUP_OPTIONS[n][0]
            s = update_scale(rows, cols, options.get("scale", "match_rms_adamw")) * options.get("extra_scale_factor", 1)
            if n in twins:  # torch's float64 step and the reference's differ by float64 rounding (conventions test)
                err = float((twins[n].detach() - ref.w[n]).abs().max())
                assert err <= t * 490 * 30 * 2.0 ** -53 * float(ref.w[n].abs().max()), \
                    f"torch.optim.Muon {n} at step {t}: {err:.2e} from the float64 reference"
            # DMuon in float32: lr·s·O with O within 2e-6 per element of float64 NS, a few ulps of W per step
            bound = t * LR * s * 2e-6 + 4 * t * FLOAT32_EPS * ref.w[n].abs()
            excess = float(((params[n].detach().double() - ref.w[n]).abs() - bound).max())
            assert excess <= 0, f"DMuon {n} at step {t}: {excess:.2e} beyond the float64 reference's bound"
    assert len(opt._ns) == 3  # steps 5 (a, d), 3 (b), 4 (c)


WHOLE_OPTIONS = [dict(coeffs="you"), dict(coeffs="polar-express", ns_steps=6), dict(algo="gram"),
                 dict(ns_steps=2, scale="spectral"), dict(scale="unit_rms", extra_scale_factor=0.5),
                 dict(cautious_wd=True), dict(scale="original", cautious_wd=True, extra_scale_factor=2.0)]


@pytest.mark.parametrize("options", WHOLE_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_a_groups_options_give_the_update_of_an_optimizer_built_with_them_bit_for_bit(options):
    params, alone = parameters(), parameters()
    opt = DMuon([{"params": [("a.weight", params["a.weight"]), ("d.weight", params["d.weight"])], **options},
                 {"params": [(n, params[n]) for n in ("b.weight", "c.weight")]}], weight_decay=WD, balancer="lpt")
    with_options = DMuon([(n, alone[n]) for n in ("a.weight", "d.weight")], weight_decay=WD, balancer="lpt", **options)
    without = DMuon([(n, alone[n]) for n in ("b.weight", "c.weight")], weight_decay=WD, balancer="lpt")
    for t in range(STEPS):
        grads = grads_of(t)
        set_grads(params, grads)
        set_grads(alone, grads)
        for o in (opt, with_options, without):
            o.step()
    for n in params:
        assert torch.equal(params[n], alone[n]), f"{n} differs from the optimizer built with {options}"
    assert not torch.equal(params["a.weight"], parameters()["a.weight"])


def test_a_bucket_batches_matrices_of_equal_options_only():
    params = parameters()
    opt = DMuon([{"params": [("a.weight", params["a.weight"])], "lr": 0.01},
                 {"params": [("c.weight", params["c.weight"])], "lr": 0.03},      # a's options, another lr
                 {"params": [("b.weight", params["b.weight"])], "ns_steps": 3},
                 {"params": [("d.weight", params["d.weight"])], "cautious_wd": True}], balancer="lpt")
    buckets = sorted(sorted(k.name for k in bucket) for bucket in opt._buckets)
    assert buckets == [["a.weight", "c.weight"], ["b.weight"], ["d.weight"]]
    assert len(opt._ns) == 2 and opt.ns is opt.ns_of(opt._matrices[0].options)  # steps 5 and 3


def train_and_load(params, opt, twins, loaded):
    """Trains params with opt 3 steps, then gives twins params' values and loaded opt's state_dict (torch.save)."""
    for t in range(3):
        set_grads(params, grads_of(t))
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    for n, p in params.items():
        twins[n].data.copy_(p.detach())
    loaded.load_state_dict(torch.load(buffer, weights_only=True))


def train_both_to_the_end(params, opt, twins, loaded):
    """Steps 3.. of both runs; every parameter must then be bit-identical."""
    for t in range(3, STEPS):
        for ps, o in ((params, opt), (twins, loaded)):
            set_grads(ps, grads_of(t))
            o.step()
    for n in params:
        assert torch.equal(params[n], twins[n]), n


def test_a_state_dict_carries_the_groups_options_and_resumes_bit_for_bit():
    params, twins = parameters(), parameters()

    def build(ps, options):
        return DMuon([{"params": [(n, ps[n]) for n in ("a.weight", "b.weight")], **options},
                      {"params": [(n, ps[n]) for n in ("c.weight", "d.weight")]}], weight_decay=WD, balancer="lpt")

    options = dict(ns_steps=3, scale="spectral", extra_scale_factor=1.5, cautious_wd=True, coeffs="polar-express")
    opt, loaded = build(params, options), build(twins, {})
    train_and_load(params, opt, twins, loaded)
    assert {k: loaded.param_groups[0][k] for k in options} == options
    assert {k.options for k in loaded._matrices} == {k.options for k in opt._matrices}
    train_both_to_the_end(params, opt, twins, loaded)


def test_an_lr_scheduler_sets_each_groups_lr_and_the_options_stay():
    params = parameters()
    opt = DMuon([{"params": [("a.weight", params["a.weight"])], "scale": "spectral", "lr": 0.04},
                 {"params": [("b.weight", params["b.weight"])], "ns_steps": 3}], lr=0.02, balancer="lpt")
    sched = lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for t in range(5):
        set_grads(params, grads_of(t))
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.005]
    assert [(g["scale"], g["ns_steps"]) for g in opt.param_groups] == [("spectral", 5), ("match_rms_adamw", 3)]


@pytest.mark.parametrize("key, value, needle", [
    ("ns_steps", 0, "ns_steps must be an integer >= 1"), ("ns_steps", 2.5, "ns_steps must be an integer >= 1"),
    ("coeffs", "nope", "coeffs must be one of keller, you, polar-express"),
    ("algo", "fast", "algo must be one of auto, standard, gram"),
    ("scale", "sqrt", "scale must be one of original, match_rms_adamw, spectral, unit_rms"),
    ("extra_scale_factor", -1.0, "extra_scale_factor must be a finite number > 0"),
    ("cautious_wd", "yes", "cautious_wd must be True or False")])
def test_a_bad_option_in_a_group_names_the_group_and_the_key(key, value, needle):
    params = parameters()
    with pytest.raises(ValueError, match=f"param group of 'b.weight'.*{needle}"):
        DMuon([{"params": [("a.weight", params["a.weight"])]}, {"params": [("b.weight", params["b.weight"])],
                                                                 key: value}])
    with pytest.raises(ValueError, match=f"DMuon: {needle}"):
        DMuon([("a.weight", params["a.weight"])], **{key: value})


def test_a_muon_option_in_an_adamw_group_is_refused():
    with pytest.raises(ValueError, match=r"sets \['scale'\], which none of its parameters uses"):
        DMuon([{"params": [torch.nn.Parameter(torch.randn(4))], "scale": "spectral"}])


@pytest.mark.parametrize("rows, cols", [(12, 5), (4, 10), (6, 6), (1, 7)])
def test_muon_scale_meets_each_kinds_definition(rows, cols):
    for kind in SCALES:
        assert muon_scale(rows, cols, kind) == pytest.approx(update_scale(rows, cols, kind), rel=4 * 2.0 ** -52)
    with pytest.raises(ValueError, match="scale must be one of"):  # never Moonlight's factor for an unknown kind
        muon_scale(rows, cols, "match_rms")


# ---- split Newton–Schulz ----

SPLIT_CASES = [dict(split_heads=4), dict(split_heads=4, split_dim=1, scale="spectral"),
               dict(split_sizes=[2, 6, 4], cautious_wd=True), dict(split_sizes=[3, 5], split_dim=1, scale="original")]


@pytest.mark.parametrize("options", SPLIT_CASES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_split_newton_schulz_equals_the_matrix_split_by_hand(options):
    gen = torch.Generator().manual_seed(3)
    params = {n: torch.nn.Parameter(torch.randn(12, 8, generator=gen) * 0.5) for n in ("q.weight", "k.weight")}
    params["o.weight"] = torch.nn.Parameter(torch.randn(8, 12, generator=gen) * 0.5)  # unsplit, the same group kind
    opt = DMuon([{"params": [(n, params[n]) for n in ("q.weight", "k.weight")], **options},
                 {"params": [("o.weight", params["o.weight"])]}], lr=LR, momentum=MOMENTUM, weight_decay=WD,
                algo="standard", balancer="lpt", ns_dtype="float32")
    ref = Reference({n: p.detach() for n, p in params.items()}, hyper_of(opt))
    whole = Reference({n: p.detach() for n, p in params.items()},
                      {n: {k: v for k, v in h.items() if not k.startswith("split")} for n, h in hyper_of(opt).items()})
    for t in range(1, STEPS + 1):
        gen = torch.Generator().manual_seed(200 + t)
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
        for r in (ref, whole):
            r.step(grads)
        set_grads(params, grads)
        opt.step()
        for n in ("q.weight", "k.weight"):
            # per block as the unsplit test: lr·s·O within 2e-6 per element, a few ulps of W per step; s of a block
            s = max(update_scale(12, 8, options.get("scale", "match_rms_adamw")), 4.0)
            bound = t * LR * s * 2e-6 + 4 * t * FLOAT32_EPS * ref.w[n].abs()
            excess = float(((params[n].detach().double() - ref.w[n]).abs() - bound).max())
            assert excess <= 0, f"{n} at step {t}: {excess:.2e} beyond the split reference's bound"
            assert float((ref.w[n] - whole.w[n]).abs().max()) > 1e3 * float(bound.max()), "the split changes nothing"
    assert opt._buckets[0][0].blocks is not None and len(opt._buckets) == 2


@pytest.mark.parametrize("options, needle", [
    (dict(split_heads=5), r"'q.weight' \(12×8\) has 12 rows, not a multiple of split_heads=5"),
    (dict(split_sizes=[4, 5], split_dim=1), r"'q.weight' \(12×8\) has 8 columns, but split_sizes \[4, 5\] sum to 9"),
    (dict(split_sizes=[3, 3]), r"'q.weight' \(12×8\) has 12 rows, but split_sizes \[3, 3\] sum to 6"),
    (dict(split_heads=2, split_sizes=[6, 6]), "split_heads and split_sizes are two ways of one split"),
    (dict(split_dim=2, split_heads=2), "split_dim must be 0"),
    (dict(split_sizes=[12]), "split_sizes must be a list of two or more integers")])
def test_a_split_that_does_not_fit_names_the_matrix(options, needle):
    q = torch.nn.Parameter(torch.randn(12, 8))
    with pytest.raises(ValueError, match=needle):
        DMuon([{"params": [("q.weight", q)], **options}])


# Every Muon option at and past its bounds (issue 58's property test, one process; the QK-clip's τ and α and its
# maxima below, the maxima at 1-4 ranks in both modes in torch_muon_options_ranks_test): (key, value, needle).
BAD_OPTIONS = [("ns_steps", 0, "ns_steps must be an integer >= 1"), ("ns_steps", 2.5, "ns_steps must be an integer"),
               ("coeffs", "kj", "coeffs must be one of"), ("algo", None, "algo must be one of"),
               ("scale", "rms", "scale must be one of"),
               ("extra_scale_factor", 0.0, "extra_scale_factor must be a finite number > 0"),
               ("extra_scale_factor", -1.0, "extra_scale_factor must be a finite number > 0"),
               ("extra_scale_factor", float("inf"), "extra_scale_factor must be a finite number > 0"),
               ("extra_scale_factor", float("nan"), "extra_scale_factor must be a finite number > 0"),
               ("cautious_wd", 1, "cautious_wd must be True or False"), ("variant", "adam", "variant must be one of"),
               ("normuon_beta2", 1.0, r"normuon_beta2 must be a number in \[0, 1\)"),
               ("normuon_beta2", -0.1, r"normuon_beta2 must be a number in \[0, 1\)"),
               ("normuon_beta2", float("nan"), r"normuon_beta2 must be a number in \[0, 1\)"),
               ("split_heads", 5, r"has 12 rows, not a multiple of split_heads=5"),
               ("split_heads", 0, "split_heads must be an integer >= 1"),
               ("split_sizes", [5, 5], r"has 12 rows, but split_sizes \[5, 5\] sum to 10"),
               ("split_dim", 2, "split_dim must be 0")]


@pytest.mark.parametrize("key, value, needle", BAD_OPTIONS)
def test_a_bad_option_is_refused_at_construction_and_by_load_state_dict_with_nothing_changed(key, value, needle):
    """A bad value of every Muon option: DMuon refuses it naming the key; load_state_dict refuses a state dict that
    carries it before writing anything (weights, state, groups as they were)."""
    with pytest.raises(ValueError, match=needle):
        DMuon([{"params": [("q.weight", torch.nn.Parameter(torch.randn(12, 8)))], key: value}])
    q = torch.nn.Parameter(torch.randn(12, 8))
    opt = DMuon([("q.weight", q)], variant="normuon")
    q.grad = torch.randn(12, 8)
    opt.step()
    saved = opt.state_dict()
    q.grad = torch.randn(12, 8)
    opt.step()
    before = every_tensor({"q.weight": q}, opt), copy.deepcopy(opt.param_groups[0])
    saved["param_groups"][0][key] = value
    with pytest.raises(ValueError, match=needle):
        opt.load_state_dict(saved)
    assert_unchanged(before[0], {"q.weight": q}, opt)
    assert {k: v for k, v in opt.param_groups[0].items() if k != "params"} == \
        {k: v for k, v in before[1].items() if k != "params"}


@pytest.mark.parametrize("tau, alpha, needle", [
    (0.0, 0.5, "tau must be > 0"), (-1.0, 0.5, "tau must be > 0"), (float("nan"), 0.5, "tau must be > 0"),
    (1.0, -0.1, r"alpha must be in \[0, 1\]"), (1.0, 1.5, r"alpha must be in \[0, 1\]"),
    (1.0, float("nan"), r"alpha must be in \[0, 1\]")])
def test_qk_clip_refuses_tau_and_alpha_past_their_bounds_and_joins_nothing(tau, alpha, needle):
    params, opt, _ = qk_model("error", clipped=False)
    with pytest.raises(ValueError, match=needle):
        QKClip(opt, tau, [Attention(q="q.weight", k="k.weight", heads=QK_HEADS, kv_heads=QK_GROUPS)], alpha)
    assert opt._step_hooks == []  # no QKClip joined its step (DMuon.add_step_hook)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_qk_clip_at_alpha_0_and_1_scales_one_side_by_the_whole_gamma(alpha):
    """α at its bounds: the whole γ on k (α = 0) or on q and its bias (α = 1), the other side as without a clip."""
    params, opt, clip = qk_model("error", alpha=alpha)
    twins, twin_opt, _ = qk_model("error", clipped=False)
    clip.report(0, torch.tensor([4 * TAU, 1.0, 1.0, 1.0]))  # group 0 (query heads 0, 1; key head 0): γ = 1/4
    opt.step()
    twin_opt.step()
    untouched, scaled, rows = (("q.weight", "k.weight", slice(0, 3)) if alpha == 0.0 else
                               ("k.weight", "q.weight", slice(0, 6)))
    assert torch.equal(params[untouched], twins[untouched])
    torch.testing.assert_close(params[scaled][rows], twins[scaled][rows] / 4, rtol=2 * FLOAT32_EPS, atol=0)
    assert torch.equal(params[scaled][rows.stop:], twins[scaled][rows.stop:])


def test_qk_clip_at_tau_inf_records_even_an_inf_maximum_and_scales_nothing():
    params, opt, clip = qk_model("error", tau=float("inf"))
    twins, twin_opt, _ = qk_model("error", clipped=False)
    clip.report(0, torch.tensor([float("inf"), 5.0, 1.0, 1.0]))
    opt.step()
    twin_opt.step()
    assert all(torch.equal(params[n], twins[n]) for n in params) and not bool(clip.skipped)
    assert float(clip.max_logits[0][0]) == float("inf")


# ---- NorMuon ----

# (name, shape, options): unsplit, column blocks (v of 2 columns), row blocks with their own β₂, and plain Muon
NORMUON = [("a.weight", (12, 5), dict(variant="normuon")),
           ("b.weight", (4, 10), dict(variant="normuon", split_heads=2, split_dim=1, scale="spectral")),
           ("c.weight", (12, 5), dict(variant="normuon", split_sizes=[4, 8], normuon_beta2=0.9, cautious_wd=True)),
           ("d.weight", (6, 6), dict())]


def normuon_optimizer(params, **kwargs):
    return DMuon([{"params": [(n, params[n])], **options} for n, _, options in NORMUON], lr=LR, momentum=MOMENTUM,
                 weight_decay=WD, algo="standard", balancer="lpt", ns_dtype="float32", **kwargs)


def test_normuon_equals_the_reference_and_keeps_a_v_per_row_and_column_block():
    params = parameters()
    opt = normuon_optimizer(params)
    ref = Reference({n: p.detach() for n, p in params.items()}, hyper_of(opt))
    muon = Reference({n: p.detach() for n, p in params.items()},
                     {n: dict(h, variant="muon") for n, h in hyper_of(opt).items()})
    for t in range(1, STEPS + 1):
        grads = grads_of(t)
        for r in (ref, muon):
            r.step(grads)
        set_grads(params, grads)
        opt.step()
        for n, (rows, cols), options in NORMUON:
            # as the unsplit test, lr·s·Ô within 2e-6 per element of O times 2 (NorMuon's rows of O have RMS
            # 1/√max(m, n) within a few percent, so it scales a row by about 1 and adds its relative error once
            # more), and a few ulps of W per step
            s = max(update_scale(rows, cols, options.get("scale", "match_rms_adamw")), 1.0)
            bound = t * LR * s * 4e-6 + 4 * t * FLOAT32_EPS * ref.w[n].abs()
            excess = float(((params[n].detach().double() - ref.w[n]).abs() - bound).max())
            assert excess <= 0, f"{n} at step {t}: {excess:.2e} beyond the NorMuon reference's bound"
            if options:
                assert float((ref.w[n] - muon.w[n]).abs().max()) > 1e2 * float(bound.max()), "NorMuon changes nothing"
    widths = {n: tuple(opt.state[params[n]]["variance_neuron"].shape) for n, _, o in NORMUON if o}
    assert widths == {"a.weight": (12, 1), "b.weight": (4, 2), "c.weight": (12, 1)}
    assert "variance_neuron" not in opt.state[params["d.weight"]]
    ref_v = ref.state["b.weight"]["normuon_v"][0]  # column block 1's v, after the steps
    assert torch.allclose(opt.state[params["b.weight"]]["variance_neuron"][:, 1].double(), ref_v[1], rtol=1e-4)


def test_normuon_resumes_from_a_state_dict_bit_for_bit_and_a_skipped_step_keeps_v():
    params, twins = parameters(), parameters()
    opt, loaded = normuon_optimizer(params, nonfinite="skip"), normuon_optimizer(twins, nonfinite="skip")
    train_and_load(params, opt, twins, loaded)
    v = {n: opt.state[params[n]]["variance_neuron"].clone() for n, _, o in NORMUON if o}
    set_grads(params, {n: g * float("nan") for n, g in grads_of(3).items()})
    opt.step()  # skipped: a non-finite gradient
    assert opt.skipped_steps == 1
    for n, value in v.items():
        assert torch.equal(opt.state[params[n]]["variance_neuron"], value), f"{n}: a skipped step changed v"
    train_both_to_the_end(params, opt, twins, loaded)
    plain = DMuon([{"params": [(n, twins[n])]} for n, _, _ in NORMUON], balancer="lpt")
    with pytest.raises(ValueError, match=r"'a.weight' has state \['momentum_buffer', 'variance_neuron'\] in the "
                                         r"saved state, \['momentum_buffer'\] here"):
        plain.load_state_dict(opt.state_dict())


@pytest.mark.parametrize("value", ["adam", None])
def test_a_bad_variant_or_beta2_names_the_key(value):
    q = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="variant must be one of muon, normuon"):
        DMuon([{"params": [("q.weight", q)], "variant": value}])
    with pytest.raises(ValueError, match="normuon_beta2 must be a number in"):
        DMuon([("q.weight", q)], variant="normuon", normuon_beta2=1.0 if value else -0.1)


@pytest.mark.parametrize("dtype, message", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                            (torch.float32, torch.float32)])
def test_normuon_v_travels_in_a_message_of_another_dtype_bit_for_bit(dtype, message):
    v = torch.randn(7, 3).to(dtype)  # an odd count: the packed message pads
    packed = pack(v, message)
    assert packed.dtype == message and packed.numel() == packed_numel(v.numel(), dtype, message)
    received = torch.cat([torch.ones(1, dtype=message), packed])[1:]  # at an offset in a message, as received
    assert torch.equal(unpack(received, dtype, v.numel()).view(v.shape), v)


# ---- QK-clip (qk_clip.py) ----

TAU, QK_HEADS, QK_GROUPS = 1.5, 4, 2


def clip_against_reference(shapes, attention, clip_ref, groups):
    """DMuon + QKClip(attention) over `shapes` ({name: shape}, one "o.weight" never clipped) for STEPS steps with
    random maxima (two micro-batches' reports), each step against the float64 Reference followed by clip_ref(w,
    maxima) (the rule written from its definition, in place on the reference's weights); the clip must fire for some
    of the `groups` groups (on odd steps; even steps' maxima stay below TAU)."""
    gen = torch.Generator().manual_seed(9)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=gen) * 0.5) for n, s in shapes.items()}
    opt = DMuon([(n, p) for n, p in params.items()], lr=LR, momentum=MOMENTUM, weight_decay=WD, algo="standard",
                balancer="lpt", ns_dtype="float32")
    clip = QKClip(opt, TAU, [attention])
    ref = Reference({n: p.detach() for n, p in params.items()}, hyper_of(opt))
    fired = 0
    for t in range(1, STEPS + 1):
        grads = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
        top = 2 * TAU if t % 2 else 0.8 * TAU  # even steps never clip
        micro = [torch.rand(attention.heads, generator=gen) * top for _ in range(2)]  # two micro-batches' maxima
        for m in micro:
            clip.report(0, m)
        maxima = torch.maximum(*micro).double()
        ref.step(grads)
        clip_ref(ref.w, maxima)
        fired += int((maxima.view(groups, -1).max(dim=1).values > TAU).sum())
        set_grads(params, grads)
        opt.step()
        for n in shapes:
            # the Muon bound of the tests above (s ≤ 0.2·√12); the rescale's factors ≤ 1 round once more
            bound = t * LR * 0.7 * 2e-6 + 6 * t * FLOAT32_EPS * ref.w[n].abs()
            excess = float(((params[n].detach().double() - ref.w[n]).abs() - bound).max())
            assert excess <= 0, f"{n} at step {t}: {excess:.2e} beyond the QK-clip reference's bound"
    assert fired > 0, f"the clip never fired in {STEPS} steps"
    assert clip._maxima is None  # the step forgot its reports


def test_qk_clip_equals_kimi_k2s_rule_with_grouped_queries_on_weights_and_biases():
    def clip_ref(w, maxima):
        w["q.weight"], w["k.weight"] = qk_clip_ref(w["q.weight"], w["k.weight"], maxima, TAU, QK_GROUPS)
        biases = qk_clip_ref(w["q.bias"][:, None], w["k.bias"][:, None], maxima, TAU, QK_GROUPS)
        w["q.bias"], w["k.bias"] = biases[0][:, 0], biases[1][:, 0]

    clip_against_reference({"q.weight": (12, 8), "k.weight": (6, 8), "q.bias": (12,), "k.bias": (6,),
                            "o.weight": (8, 12)},
                           Attention(q="q.weight", k="k.weight", heads=QK_HEADS, kv_heads=QK_GROUPS, q_bias="q.bias",
                                     k_bias="k.bias"), clip_ref, QK_GROUPS)


def test_a_second_qk_clip_on_an_optimizer_takes_the_first_ones_place():
    """One QKClip per optimizer (its docstring): a second one made on it takes the first's place among the step's
    hooks (DMuon.add_step_hook's key), so only the second's threshold clips. lr 0: the step changes nothing else."""
    torch.manual_seed(0)
    params = {n: torch.nn.Parameter(torch.randn(4, 4)) for n in ("q.weight", "k.weight")}
    opt = DMuon(list(params.items()), lr=0.0)
    attention = Attention(q="q.weight", k="k.weight", heads=2)
    first = QKClip(opt, 1.0, [attention])  # would clip maxima of 4
    second = QKClip(opt, 100.0, [attention])  # does not
    for clip in (first, second):
        clip.report(0, torch.tensor([4.0, 4.0]))
    before = {n: p.detach().clone() for n, p in params.items()}
    for p in params.values():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert all(torch.equal(before[n], p.detach()) for n, p in params.items())
    assert second.max_logits is not None and first.max_logits is None


@pytest.mark.parametrize("layout", ["stacked", "grouped"])
def test_qk_clip_of_a_fused_qkv_equals_the_rule_on_its_q_and_k_rows(layout):
    def clip_ref(w, maxima):
        w["qkv.weight"] = fused_qk_clip_ref(w["qkv.weight"], maxima, TAU, QK_GROUPS, layout)
        w["qkv.bias"] = fused_qk_clip_ref(w["qkv.bias"][:, None], maxima, TAU, QK_GROUPS, layout)[:, 0]

    rows = (QK_HEADS + 2 * QK_GROUPS) * 3  # heads of 3 rows
    clip_against_reference({"qkv.weight": (rows, 8), "qkv.bias": (rows,), "o.weight": (8, 12)},
                           FusedAttention(qkv="qkv.weight", heads=QK_HEADS, kv_heads=QK_GROUPS, bias="qkv.bias",
                                          layout=layout), clip_ref, QK_GROUPS)


def test_qk_clip_of_latent_attention_equals_kimi_k2s_rule():
    nope, rope, v = 2, 1, 3

    def clip_ref(w, maxima):
        w["q.weight"], w["kv.weight"] = latent_qk_clip_ref(w["q.weight"], w["kv.weight"], maxima, TAU, nope, rope, v)

    clip_against_reference({"q.weight": (QK_HEADS * (nope + rope), 8), "kv.weight": (QK_HEADS * (nope + v), 6),
                            "o.weight": (8, 12)},
                           LatentAttention(q="q.weight", kv="kv.weight", heads=QK_HEADS, qk_nope_head_dim=nope,
                                           qk_rope_head_dim=rope, v_head_dim=v), clip_ref, QK_HEADS)


def qk_model(mode, clipped=True, seed=3, tau=TAU, alpha=0.5):
    """(params, DMuon(nonfinite=mode), its QKClip of q and k at tau and alpha or None): q, k, o weights (Muon), q's
    bias (AdamW), gradients set."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"q.weight": (12, 8), "k.weight": (6, 8), "o.weight": (8, 12), "q.bias": (12,)}
    params = {n: torch.nn.Parameter(torch.randn(s, generator=gen)) for n, s in shapes.items()}
    opt = DMuon(list(params.items()), lr=LR, momentum=MOMENTUM, weight_decay=WD, nonfinite=mode, balancer="lpt",
                ns_dtype="float32", variant="normuon")
    clip = QKClip(opt, tau, [Attention(q="q.weight", k="k.weight", heads=QK_HEADS, kv_heads=QK_GROUPS,
                                       q_bias="q.bias")], alpha) if clipped else None
    set_grads(params, {n: torch.randn(s, generator=gen) for n, s in shapes.items()})
    return params, opt, clip


def every_tensor(params, opt):
    """{name or (name, state key): a copy} of every parameter and optimizer state tensor."""
    out = {n: p.detach().clone() for n, p in params.items()}
    out.update(((n, k), v.clone()) for n, p in params.items() for k, v in opt.state[p].items())
    return out


def assert_unchanged(before, params, opt):
    after = every_tensor(params, opt)
    changed = [k for k, v in before.items() if not torch.equal(v, after[k])]
    assert not changed, f"changed by a step that raised: {changed}"


UNTAKEN = [float("inf"), float("nan"), 1e300]  # 1e300: finite, but γ = τ/S underflows float32 to 0


@pytest.mark.parametrize("value", UNTAKEN)
def test_a_maximum_the_clip_cannot_take_raises_under_error_and_changes_nothing(value):
    """Issue 58's reproduction: an inf (or NaN, or a maximum whose γ underflows the weights' dtype) in one head used to
    zero its group's q and k rows. Under nonfinite="error" the step raises naming the attention, its layer and the
    head, and every weight and state tensor is as it was, bit for bit."""
    params, opt, clip = qk_model("error")
    before = every_tensor(params, opt)
    clip.report(0, torch.tensor([1.0, 1.0, value, 2.0], dtype=torch.float64))
    with pytest.raises(FloatingPointError, match=r"attention 'q.weight' \(attention 0 of the QKClip\) query head 2: "
                                                 rf"{re.escape(str(value))}.* at update 1 "
                                                 r"\(that step was skipped: nothing changed\)"):
        opt.step()
    assert_unchanged(before, params, opt)
    assert opt.updates == 0 and bool(clip.skipped)


@pytest.mark.parametrize("value", UNTAKEN)
def test_a_maximum_the_clip_cannot_take_skips_the_clip_under_skip_and_counts_it(value):
    """Under nonfinite="skip" the step updates as without a clip (a twin optimizer without one, bit for bit), the
    clip is counted skipped and the step's stats say so."""
    params, opt, clip = qk_model("skip")
    twins, twin_opt, _ = qk_model("skip", clipped=False)
    clip.report(0, torch.tensor([value, 1.0, 1.0, 2.0], dtype=torch.float64))
    opt.step()
    twin_opt.step()
    assert all(torch.equal(params[n], twins[n]) for n in params)
    assert clip.skipped_steps == 1 and opt.updates == 1 and opt.skipped_steps == 0
    assert bool(opt.last_stats["qk_clip_skipped"])
    assert "attention 'q.weight' (attention 0 of the QKClip) query head 0" in clip.last_skip
    clip.report(0, torch.tensor([1.0, 1.0, 1.0, 2.0]))  # a maximum it takes: the next step clips again
    opt.step()
    assert not bool(opt.last_stats["qk_clip_skipped"]) and clip.skipped_steps == 1


@pytest.mark.parametrize("value", [-float("inf"), 0.0, -3.0, TAU])
def test_maxima_at_or_below_tau_change_nothing_of_the_update(value):
    """−inf (every logit masked), 0, negative, τ itself: γ = 1, the update is that of a twin without a clip."""
    params, opt, clip = qk_model("error")
    twins, twin_opt, _ = qk_model("error", clipped=False)
    clip.report(0, torch.full((QK_HEADS,), value))
    opt.step()
    twin_opt.step()
    assert all(torch.equal(params[n], twins[n]) for n in params) and not bool(clip.skipped)


def test_a_huge_finite_maximum_clips_by_the_rule_and_leaves_the_weights_finite_and_nonzero():
    """5e19 (an overflowing bf16 forward's scale): γ = τ/S is tiny but normal; the rows are scaled by the rule, every
    weight finite and non-zero."""
    params, opt, clip = qk_model("error")
    clip.report(0, torch.tensor([5e19, 1.0, 1.0, 1.0], dtype=torch.float64))
    opt.step()
    q = params["q.weight"].detach()
    assert bool(q.isfinite().all()) and bool((q[:3] != 0).all()) and float(q[:3].abs().max()) < 1e-8


def test_a_step_that_raises_on_a_non_finite_gradient_with_qk_clip_changes_nothing():
    """The clip used to rescale q and k before the step raised on a non-finite gradient."""
    params, opt, clip = qk_model("error")
    params["o.weight"].grad[1, 2] = float("nan")
    before = every_tensor(params, opt)
    clip.report(0, torch.tensor([4.0, 1.0, 1.0, 9.0]))  # would clip both groups
    with pytest.raises(FloatingPointError, match="non-finite gradient in parameter 'o.weight' on rank 0"):
        opt.step()
    assert_unchanged(before, params, opt)


def test_hf_qk_clip_reproduction_leaves_the_weights_unchanged_and_says_why():
    """Issue 58's reproduction on a Hugging Face model: clip.report(0, [inf, 1, 1, 1]); opt.step()."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    opt = DMuon(model.named_parameters(), balancer="lpt")
    clip = hf_qk_clip(model, opt, tau=HF_TAU)
    model(torch.randint(0, 32, (2, 5))).logits.sum().backward()
    params = dict(model.named_parameters())
    before = every_tensor(params, opt)
    clip.report(0, torch.tensor([float("inf"), 1.0, 1.0, 1.0]))
    with pytest.raises(FloatingPointError, match=r"attention 'model.layers.0.self_attn.q_proj.weight' \(layer 0\) "
                                                 r"query head 0: inf"):
        opt.step()
    assert_unchanged(before, params, opt)


@pytest.mark.parametrize("attention, needle", [
    (Attention(q="q.weight", k="nope", heads=4), "no parameter 'nope'"),
    (Attention(q="q.weight", k="q.weight", heads=5), "'q.weight' has 12 rows, not a multiple of its 5 heads"),
    (Attention(q="q.weight", k="q.weight", heads=4, kv_heads=3), "4 query heads do not split into 3"),
    (Attention(q="q.weight", k="q.weight", heads=4), "'q.weight' is already clipped"),
    (FusedAttention(qkv="q.weight", heads=4, kv_heads=2), "'q.weight' has 12 rows, not a multiple of its 8 heads"),
    (FusedAttention(qkv="q.weight", heads=2, layout="interleaved"), "layout must be 'stacked' or 'grouped'"),
    (LatentAttention(q="q.weight", kv="q.weight", heads=2, qk_nope_head_dim=4, qk_rope_head_dim=1, v_head_dim=2),
     "'q.weight' has 6 rows a head, not the 4 \\+ 1 of its head dimensions")])
def test_a_qk_clip_that_does_not_fit_names_the_attention(attention, needle):
    opt = DMuon([("q.weight", torch.nn.Parameter(torch.randn(12, 8)))])
    with pytest.raises(ValueError, match=needle):
        QKClip(opt, TAU, [attention])


def test_qk_clip_takes_reports_of_some_heads_each_into_one_step():
    """Reports of some query heads each (what tensor parallelism's ranks report: hf_qk_clip) make the step's maxima
    of every head, largest kept; max_logits holds them after the step (-inf: a head nobody reported)."""
    params = {"q.weight": torch.nn.Parameter(torch.randn(12, 8)), "k.weight": torch.nn.Parameter(torch.randn(6, 8))}
    opt = DMuon(list(params.items()))
    clip = QKClip(opt, TAU, [Attention(q="q.weight", k="k.weight", heads=QK_HEADS, kv_heads=QK_GROUPS)])
    assert clip.max_logits is None
    clip.report(0, torch.tensor([1.0, 2.0]), heads=[2, 3])
    clip.report(0, torch.tensor([3.0, 0.5]), heads=[1, 0])
    clip.report(0, torch.tensor([0.25, 5.0]), heads=[0, 3])
    set_grads(params, {n: torch.randn(p.shape) for n, p in params.items()})
    opt.step()
    assert torch.equal(clip.max_logits[0], torch.tensor([0.5, 3.0, 1.0, 5.0], dtype=torch.float64))
    clip.report(0, torch.tensor([1.0]), heads=[1])
    opt.step()
    assert torch.equal(clip.max_logits[0], torch.tensor([-torch.inf, 1.0, -torch.inf, -torch.inf],
                                                        dtype=torch.float64))


@pytest.mark.parametrize("maxima, heads, needle", [
    (torch.ones(2), [0], "attention 'q.weight' reports 1 heads, got 2 maxima"),
    (torch.ones(2), [1, 1], r"attention 'q.weight' has heads 0..3, got \[1, 1\]"),
    (torch.ones(2), [3, 4], r"attention 'q.weight' has heads 0..3, got \[3, 4\]"),
    (torch.ones(3), None, "attention 'q.weight' reports 4 heads, got 3 maxima")])
def test_a_qk_clip_report_that_does_not_fit_names_the_attention(maxima, heads, needle):
    opt = DMuon([("q.weight", torch.nn.Parameter(torch.randn(12, 8))),
                 ("k.weight", torch.nn.Parameter(torch.randn(6, 8)))])
    clip = QKClip(opt, TAU, [Attention(q="q.weight", k="k.weight", heads=QK_HEADS, kv_heads=QK_GROUPS)])
    with pytest.raises(ValueError, match=needle):
        clip.report(0, maxima, heads)


@pytest.mark.parametrize("weight, attention", [
    (torch.nn.Linear(8, 12).weight, Attention(q="q.weight", k="k.weight", heads=4)),
    (torch.nn.Linear(8, 24).weight, FusedAttention(qkv="q.weight", heads=4))])
def test_qk_clip_names_an_attention_whose_heads_it_cannot_place(weight, attention):
    """A call computing fewer query heads than the attention has, its query weight not a DTensor sharded by rows
    (torch_qk_clip_tp_test and torch_titan_layouts_test run those that are): which heads they are is unknown."""
    assert heads_computed(attention, weight, 4, "hf_qk_clip") is None
    with pytest.raises(ValueError, match="hf_qk_clip: attention 'q.weight' computed 2 of its 4 query heads here, and "
                                         "its query weight is not a DTensor sharded by rows"):
        heads_computed(attention, weight, 2, "hf_qk_clip")


@pytest.mark.parametrize("attention, total, rows, heads", [
    # 4 heads of 3 rows: a TP rank's rows are whole heads, or not
    (Attention(q="q", k="k", heads=4, kv_heads=2), 12, range(6, 12), [2, 3]),
    (Attention(q="q", k="k", heads=4, kv_heads=2), 12, range(5, 11), None),
    # grouped fused qkv, 2 key-value groups of 2 query heads, heads of 2 rows: a group is [q q k v], 8 rows
    (FusedAttention(qkv="w", heads=4, kv_heads=2, layout="grouped"), 16, range(8, 16), [2, 3]),
    (FusedAttention(qkv="w", heads=4, kv_heads=2, layout="grouped"), 16, range(0, 4), None),  # half a group
    # stacked fused qkv: a row shard is not some heads' q, k and v
    (FusedAttention(qkv="w", heads=4, kv_heads=2, layout="stacked"), 16, range(0, 8), None),
    # latent attention: heads of nope + rope rows
    (LatentAttention(q="q", kv="kv", heads=2, qk_nope_head_dim=3, qk_rope_head_dim=1, v_head_dim=2), 8, range(4, 8),
     [1])])
def test_heads_of_rows_are_the_query_heads_a_tp_rank_holds(attention, total, rows, heads):
    assert heads_of_rows(attention, list(rows), total) == heads


def qwen2_queries_and_keys(module, h, cos, sin):
    """Qwen2's (grouped-query attention, separate q_proj and k_proj) queries and keys from a layer's input, by hand:
    (B, H, T, d), (B, G, T, d)."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
    shape = h.shape[:-1] + (-1, module.head_dim)
    return apply_rotary_pos_emb(module.q_proj(h).view(shape).transpose(1, 2),
                                module.k_proj(h).view(shape).transpose(1, 2), cos, sin)


def phi3_queries_and_keys(module, h, cos, sin):
    """Phi-3's (one fused qkv_proj: every query head, every key head, every value head), by hand."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb
    shape = h.shape[:-1] + (-1, module.head_dim)
    q_rows, k_rows = module.config.num_attention_heads * module.head_dim, module.num_key_value_heads * module.head_dim
    q, k, _ = module.qkv_proj(h).split([q_rows, k_rows, k_rows], dim=-1)
    return apply_rotary_pos_emb(q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), cos, sin)


def deepseek_v3_queries_and_keys(module, h, cos, sin):
    """DeepSeek-V3's (multi-head latent attention: queries through q_a_proj and q_b_proj, keys through the
    compressed kv_a_proj_with_mqa and kv_b_proj, one rotary key part shared by every head), by hand."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
    c = module.config
    heads, nope, rope = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
    q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(h))).view(*h.shape[:-1], heads, -1).transpose(1, 2)
    latent, k_rot = module.kv_a_proj_with_mqa(h).split([c.kv_lora_rank, rope], dim=-1)
    kv = module.kv_b_proj(module.kv_a_layernorm(latent)).view(*h.shape[:-1], heads, -1).transpose(1, 2)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q[..., nope:], k_rot.unsqueeze(1), cos, sin)
    k = torch.cat([kv[..., :nope], k_rot.expand(-1, heads, -1, -1)], dim=-1)
    return torch.cat([q[..., :nope], q_rot], dim=-1), k


HF_TAU = 0.01  # among these models' maximum logits (0.006-0.025 at their initial weights): heads clip
HF_MODELS = {  # family: (config class, its options, the layer's attention by its prefix, the rule on {projection: W}
    # by its definition (muon_reference) given the layer's maxima, queries and keys by hand)
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2),
              lambda p: Attention(q=f"{p}.q_proj.weight", k=f"{p}.k_proj.weight", heads=4, kv_heads=2,
                                  q_bias=f"{p}.q_proj.bias", k_bias=f"{p}.k_proj.bias"),
              lambda w, m: dict(zip(("q_proj", "k_proj"), qk_clip_ref(w["q_proj"], w["k_proj"], m, HF_TAU, 2))),
              qwen2_queries_and_keys),
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, pad_token_id=0),
             lambda p: FusedAttention(qkv=f"{p}.qkv_proj.weight", heads=4, kv_heads=2),
             lambda w, m: {"qkv_proj": fused_qk_clip_ref(w["qkv_proj"], m, HF_TAU, 2, "stacked")},
             phi3_queries_and_keys),
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
                                             qk_rope_head_dim=2, v_head_dim=4, first_k_dense_replace=2,
                                             rope_interleave=True),
                    lambda p: LatentAttention(q=f"{p}.q_b_proj.weight", kv=f"{p}.kv_b_proj.weight", heads=4,
                                              qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4),
                    lambda w, m: dict(zip(("q_b_proj", "kv_b_proj"),
                                          latent_qk_clip_ref(w["q_b_proj"], w["kv_b_proj"], m, HF_TAU, 4, 2, 4))),
                    deepseek_v3_queries_and_keys),
}


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("family", sorted(HF_MODELS))
def test_the_hugging_face_helper_clips_each_heads_maximum_logit_and_changes_no_output(family, implementation):
    """hf_qk_clip on a tiny model of each family: its attentions named and sized from the config, the reported
    maxima equal to the logits computed by hand from the layer's input, the outputs unchanged, and the step's weights
    those of the same step without the clip (a twin model and optimizer) rescaled by the rule's reference."""
    transformers = pytest.importorskip("transformers")
    config_class, extra, expected_attention, clip_ref, queries_and_keys = HF_MODELS[family]
    config = getattr(transformers, config_class)(vocab_size=32, hidden_size=16, intermediate_size=24,
                                                 num_hidden_layers=2, num_attention_heads=4,
                                                 max_position_embeddings=16, attn_implementation=implementation,
                                                 **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    twin = copy.deepcopy(model)
    tokens = torch.randint(0, 32, (3, 7))
    before = model(tokens).logits.detach()
    expected = []

    def by_hand(module, args, kwargs):  # the logits from the layer's input, K2's definition
        q, k = queries_and_keys(module, kwargs["hidden_states"], *kwargs["position_embeddings"])
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        logits = (q @ k.transpose(-1, -2)) * module.scaling  # (B, H, T, T)
        causal = torch.ones(7, 7, dtype=torch.bool).tril()
        expected.append(logits.masked_fill(~causal, -torch.inf).amax(dim=(0, 2, 3)).detach())

    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(by_hand, with_kwargs=True)
    opt = DMuon(model.named_parameters(), balancer="lpt", ns_dtype="float32")
    clip = hf_qk_clip(model, opt, tau=HF_TAU)
    assert clip.attentions == [expected_attention(f"model.layers.{i}.self_attn") for i in range(2)]
    after = model(tokens).logits
    assert torch.equal(after.detach(), before), "the reporting attention changed the model's output"
    assert torch.allclose(clip._maxima.float(), torch.cat(expected), rtol=1e-5, atol=1e-6)
    after.sum().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = p.grad.clone()
    twin_opt = DMuon(twin.named_parameters(), balancer="lpt", ns_dtype="float32")
    opt.step()
    twin_opt.step()
    assert clip._maxima is None
    assert bool((torch.cat(expected) > HF_TAU).any()), "no head clipped"
    for i, (layer, twin_layer) in enumerate(zip(model.model.layers, twin.model.layers)):
        maxima = expected[i].double()
        clipped = clip_ref({name: m.weight.detach() for name, m in twin_layer.self_attn.named_children()
                            if hasattr(m, "weight")}, maxima)
        for name, want in clipped.items():
            got = getattr(layer.self_attn, name).weight.detach().double()
            assert torch.allclose(got, want, rtol=1e-6, atol=0), f"layer {i}: {name} is not the clip's rescale"


def test_the_hugging_face_helper_refuses_to_clip_an_attention_with_query_and_key_norms():
    """Qwen3's q_norm and k_norm normalize each head after the projection: a rescaled projection changes none of
    its logits, so a finite tau is refused by name; tau=inf records max_logits and changes no weight."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                                      max_position_embeddings=16, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    opt = DMuon(model.named_parameters(), balancer="lpt", ns_dtype="float32")
    with pytest.raises(ValueError, match=r"attention 'model.layers.0.self_attn.q_proj.weight' normalizes its queries "
                                         r"or keys after the projection \(q_norm and k_norm"):
        hf_qk_clip(model, opt, tau=HF_TAU)
    twin = copy.deepcopy(model)
    clip = hf_qk_clip(model, opt, tau=float("inf"))
    model(torch.randint(0, 32, (3, 7))).logits.sum().backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = p.grad.clone()
    opt.step()
    DMuon(twin.named_parameters(), balancer="lpt", ns_dtype="float32").step()
    assert [m.shape for m in clip.max_logits] == [(4,), (4,)] and all(bool(m.isfinite().all()) for m in clip.max_logits)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
