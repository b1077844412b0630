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
  errors             a bad option in a group names the group and the key
  scales             muon_scale's four kinds against their definitions; an unknown kind raises
  split              split Newton–Schulz against the matrix split by hand; a split that does not fit is named
  NorMuon            against the float64 formula (unsplit, column and row blocks), its v's shape, a resume bit
                     for bit, a skipped step that keeps v, v's packing into another dtype's message
  QK-clip            against Kimi K2's rule in float64 (grouped queries, biases, two reports a step); the
                     Hugging Face helper's maxima against logits computed by hand (eager and sdpa), outputs kept

Run: PYTHONPATH=build/python python -m pytest -q tests/python/torch_muon_options_test.py
"""

import io

import pytest
import torch
from torch.optim import lr_scheduler

from dmuon.torch import Attention, DMuon, QKClip, hf_qk_clip
from dmuon.torch.muon_options import SCALES, muon_scale
from dmuon.torch.normuon import pack, packed_numel, unpack
from muon_reference import KELLER, newton_schulz_ref, qk_clip_ref, update_scale
from torch_dmuon_mpi_test import Reference, hyper_of

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
    ("extra_scale_factor", -1.0, "extra_scale_factor must be a number > 0"),
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


def test_qk_clip_equals_kimi_k2s_rule_with_grouped_queries_on_weights_and_biases():
    gen = torch.Generator().manual_seed(9)
    shapes = {"q.weight": (12, 8), "k.weight": (6, 8), "q.bias": (12,), "k.bias": (6,), "o.weight": (8, 12)}
    params = {n: torch.nn.Parameter(torch.randn(s, generator=gen) * 0.5) for n, s in shapes.items()}
    opt = DMuon([(n, p) for n, p in params.items()], lr=LR, momentum=MOMENTUM, weight_decay=WD, algo="standard",
                balancer="lpt", ns_dtype="float32")
    clip = QKClip(opt, TAU, [Attention(q="q.weight", k="k.weight", heads=QK_HEADS, kv_heads=QK_GROUPS,
                                       q_bias="q.bias", k_bias="k.bias")])
    ref = Reference({n: p.detach() for n, p in params.items()}, hyper_of(opt))
    fired = 0
    for t in range(1, STEPS + 1):
        grads = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
        micro = [torch.rand(QK_HEADS, generator=gen) * 2 * TAU for _ in range(2)]  # two micro-batches' maxima
        for m in micro:
            clip.report(0, m)
        maxima = torch.maximum(*micro).double()
        ref.step(grads)
        ref.w["q.weight"], ref.w["k.weight"] = qk_clip_ref(ref.w["q.weight"], ref.w["k.weight"], maxima, TAU, QK_GROUPS)
        biases = qk_clip_ref(ref.w["q.bias"][:, None], ref.w["k.bias"][:, None], maxima, TAU, QK_GROUPS)
        ref.w["q.bias"], ref.w["k.bias"] = biases[0][:, 0], biases[1][:, 0]
        fired += int((maxima.view(QK_GROUPS, -1).max(dim=1).values > TAU).sum())
        set_grads(params, grads)
        opt.step()
        for n in shapes:
            # the Muon bound of the tests above (s ≤ 0.2·√12); the rescale's factors ≤ 1 round once more
            bound = t * LR * 0.7 * 2e-6 + 6 * t * FLOAT32_EPS * ref.w[n].abs()
            excess = float(((params[n].detach().double() - ref.w[n]).abs() - bound).max())
            assert excess <= 0, f"{n} at step {t}: {excess:.2e} beyond the QK-clip reference's bound"
    assert 0 < fired < STEPS * QK_GROUPS, f"the clip fired for {fired} of {STEPS * QK_GROUPS} groups"
    assert clip._maxima is None  # the step forgot its reports


@pytest.mark.parametrize("attention, needle", [
    (Attention(q="q.weight", k="nope", heads=4), "no parameter 'nope'"),
    (Attention(q="q.weight", k="q.weight", heads=5), "'q.weight' has 12 rows, not a multiple of its 5 heads"),
    (Attention(q="q.weight", k="q.weight", heads=4, kv_heads=3), "4 query heads do not split into 3")])
def test_a_qk_clip_that_does_not_fit_names_the_attention(attention, needle):
    opt = DMuon([("q.weight", torch.nn.Parameter(torch.randn(12, 8)))])
    with pytest.raises(ValueError, match=needle):
        QKClip(opt, TAU, [attention])


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_the_hugging_face_helper_reports_each_heads_maximum_logit_and_changes_no_output(implementation):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    config = transformers.Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      attn_implementation=implementation)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    tokens = torch.randint(0, 32, (3, 7))
    before = model(tokens).logits.detach()
    expected = []

    def by_hand(module, args, kwargs):  # the logits from the layer's input, K2's definition
        h = kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"]
        shape = h.shape[:-1] + (-1, module.head_dim)
        q = module.q_proj(h).view(shape).transpose(1, 2)
        k = module.k_proj(h).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(module.num_key_value_groups, dim=1)
        logits = (q @ k.transpose(-1, -2)) * module.scaling  # (B, H, T, T)
        causal = torch.ones(7, 7, dtype=torch.bool).tril()
        expected.append(logits.masked_fill(~causal, -torch.inf).amax(dim=(0, 2, 3)).detach())

    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(by_hand, with_kwargs=True)
    opt = DMuon(model.named_parameters(), balancer="lpt")
    clip = hf_qk_clip(model, opt, tau=0.05)
    assert [a.q for a in clip.attentions] == [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(2)]
    assert clip.attentions[0].q_bias == "model.layers.0.self_attn.q_proj.bias" and clip.attentions[0].kv_heads == 2
    after = model(tokens).logits
    assert torch.equal(after.detach(), before), "the reporting attention changed the model's output"
    assert torch.allclose(clip._maxima.float(), torch.cat(expected), rtol=1e-5, atol=1e-6)
    after.sum().backward()
    q_before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    opt.step()
    assert clip._maxima is None and not torch.equal(model.model.layers[0].self_attn.q_proj.weight, q_before)
