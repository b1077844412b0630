"""dmuon.torch.DMuon follows torch.optim's conventions (one process; torch_conventions_ranks_test.py
runs the collective parts at several ranks):
  defaults     the hyper-parameters under their keyword names; each group holds its kind's keys only
  tune_cache   DMuon's kernels read the cache it names, none with None, the default path's with ""
               (also in a deep copy)
  muon_scale   the update scale meets the table the C++ engine's muon_scale meets (tests/data/muon_scale.json)
  schedulers   LambdaLR, StepLR, OneCycleLR, CyclicLR (cycle_momentum) set every group's lr exactly as
               they set torch.optim.AdamW's, Muon groups' momentum as AdamW's beta1, AdamW groups'
               betas stay; the parameters follow the float64 reference with those per-step values
  add_param_group   its parameters are updated from the next step (against the reference), their
               owners planned; duplicates and bad values raise and leave the optimizer as it was
  routing      a table of GPT-2, Llama, BERT, T5 and ViT parameter names; DMuon(model) by module type;
               unnamed tensors warn with the fix
  no gradients step() changes nothing; a parameter without a gradient keeps its values and state
  compile      a compiled model with step() outside, and a compiled step function in which step() is a
               graph break: bit-identical to eager with the eager backend, near it with inductor

Run: PYTHONPATH=build/python python -m pytest -q tests/python/torch_conventions_test.py
"""

import copy
import json
import math
import pathlib
import warnings

import pytest
import torch
from torch.optim import lr_scheduler

import dmuon
from dmuon.torch import DMuon
from dmuon.torch.muon_options import muon_scale
from dmuon.torch.params import is_muon_by_default
from muon_reference import KELLER, Reference, hyper_of, newton_schulz_ref
from hand_sharded_model import TOLERANCE

STEPS = 10


def parameters(specs, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.5) for name, shape in specs}


def random_grads(params, step):
    """{name: gradient} for step, the same on every call."""
    out = {}
    for k, (name, p) in enumerate(params.items()):
        gen = torch.Generator().manual_seed(1000 * step + k)
        out[name] = torch.randn(p.shape, generator=gen)
    return out


def set_grads(params, grads):
    for name, p in params.items():
        p.grad = grads[name].clone() if name in grads else None


def relative_errors(params, ref):
    return {n: float((p.detach().double() - ref.w[n]).norm() / ref.w[n].norm()) for n, p in params.items()}


def snapshot(opt, params):
    """What step() may change of params: their values and optimizer state."""
    state = {n: {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
             for n, p in params.items() if p in opt.state}
    return {n: p.detach().clone() for n, p in params.items()}, state


def assert_same_snapshot(a, b):
    (values_a, state_a), (values_b, state_b) = a, b
    assert values_a.keys() == values_b.keys() and state_a.keys() == state_b.keys()
    for n in values_a:
        assert torch.equal(values_a[n], values_b[n]), n
    for n in state_a:
        assert state_a[n].keys() == state_b[n].keys(), n
        for k in state_a[n]:
            same = torch.equal(state_a[n][k], state_b[n][k]) if torch.is_tensor(state_a[n][k]) else \
                state_a[n][k] == state_b[n][k]
            assert same, (n, k)


# ---- defaults and LR schedulers, side by side with torch.optim.AdamW ----

SCHEDULED = [("layers.0.weight", (8, 6)), ("layers.1.weight", (6, 8)), ("embed.weight", (10, 6)), ("norm.weight", (6,))]


def scheduled_optimizer(params):
    """Three groups: two Muon groups with their own lr and momentum, one AdamW group."""
    return DMuon([{"params": [("layers.0.weight", params["layers.0.weight"])], "lr": 0.02},
                  {"params": [("layers.1.weight", params["layers.1.weight"])], "lr": 0.01, "momentum": 0.9,
                   "nesterov": False},
                  {"params": [(n, params[n]) for n in ("embed.weight", "norm.weight")], "use_muon": False,
                   "lr": 1e-3, "betas": (0.8, 0.99), "weight_decay": 0.1}],
                 weight_decay=0.05, balancer="lpt", ns_dtype="float32")


SCHEDULERS = {
    "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
    "StepLR": lambda opt: lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=[4 * g["lr"] for g in opt.param_groups],
                                                      total_steps=STEPS),
    "CyclicLR": lambda opt: lr_scheduler.CyclicLR(opt, base_lr=[g["lr"] for g in opt.param_groups],
                                                  max_lr=[5 * g["lr"] for g in opt.param_groups], step_size_up=3,
                                                  cycle_momentum=True),
}


def test_defaults_hold_the_hyper_parameters_and_groups_their_kinds_keys():
    params = parameters(SCHEDULED)
    opt = DMuon(list(params.items()), lr=0.03, momentum=0.9, nesterov=False, weight_decay=0.01, adamw_lr=1e-3,
                adamw_betas=[0.85, 0.99], adamw_eps=1e-7, adamw_weight_decay=0.1, ns_steps=4, scale="spectral")
    options = dict(ns_steps=4, coeffs="keller", algo="auto", scale="spectral", extra_scale_factor=1.0,
                   cautious_wd=False, split_heads=None, split_sizes=None, split_dim=0, variant="muon",
                   normuon_beta2=0.95)
    assert opt.defaults == dict(lr=0.03, momentum=0.9, nesterov=False, weight_decay=0.01, adamw_lr=1e-3,
                                adamw_betas=(0.85, 0.99), adamw_eps=1e-7, adamw_weight_decay=0.1,
                                state_dtype="float32", **options)
    muon, adamw = opt.param_groups
    counters = dict(updates=0, skipped_steps=0)  # the optimizer's counters, in every group for checkpoints
    assert {k: muon[k] for k in muon if k not in ("params", "param_names")} == \
        dict(use_muon=True, lr=0.03, momentum=0.9, nesterov=False, weight_decay=0.01, state_dtype="float32",
             **options, **counters)
    assert {k: adamw[k] for k in adamw if k not in ("params", "param_names")} == \
        dict(use_muon=False, lr=1e-3, betas=(0.85, 0.99), eps=1e-7, weight_decay=0.1, state_dtype="float32",
             **counters)


def test_tune_cache_names_the_cache_the_kernels_read(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    named = str(tmp_path / "named.json")
    default = dmuon.default_tune_cache_path()
    assert default.startswith(str(tmp_path / "xdg"))
    params = parameters([("w", (8, 6)), ("b", (8,))])
    assert DMuon(list(params.items())).ns.tuned_entries == 0            # the default path: no file yet
    dmuon.tune([(8, 6, 1)], threads=torch.get_num_threads(), rounds=1, tune_cache=named)
    opt = DMuon(list(params.items()), tune_cache=named)
    assert opt.ns.tuned_entries == 1 and copy.deepcopy(opt).ns.tuned_entries == 1
    assert DMuon(list(params.items()), tune_cache=None).ns.tuned_entries == 0
    dmuon.tune([(8, 6, 1), (8, 6, 2)], threads=torch.get_num_threads(), rounds=1, tune_cache="")
    assert DMuon(list(params.items())).ns.tuned_entries == 2             # "" (the default): the default path
    assert DMuon(list(params.items()), tune_cache=None).ns.tuned_entries == 0


def _advice_of_a_step(**options):
    """(the DMuon's warnings advising tuning during one step of one 8x6 matrix, its ns_dtypes_ran)."""
    params = parameters([("w", (8, 6))])
    opt = DMuon(list(params.items()), engine="dmuon", **options)
    set_grads(params, random_grads(params, 0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    return [str(w.message) for w in caught if "dmuon tune" in str(w.message)], opt.ns_dtypes_ran


def test_an_untuned_float32_shape_advises_tuning_once_where_bfloat16_would_be_timed(tmp_path, monkeypatch):
    """ns_dtype=None on the CPU: a shape the cache lacks runs untuned in the CPU's default; where that is float32 and
    the machine (faked both ways through dmuon.tuning_chooses_dtype) would time bfloat16 too, the step warns once per
    process naming the shape and how to tune; never where it would not, for an asked dtype or a tuned shape.
    ns_dtypes_ran is what ran."""
    from dmuon.torch import engine
    default = dmuon.Orthogonalizer(threads=1, tune_cache=None).call_dtype(8, 6, 1)[0]
    for chooses in (True, False):
        monkeypatch.setattr(dmuon, "tuning_chooses_dtype", lambda: chooses)
        monkeypatch.setattr(engine, "_advised", False)
        advice, ran = _advice_of_a_step(tune_cache=None)
        assert ran == [default]
        if chooses and default == "float32":
            assert len(advice) == 1 and "8x6 (batch 1)" in advice[0], advice
            assert _advice_of_a_step(tune_cache=None)[0] == []  # once per process
        else:
            assert advice == []
    monkeypatch.setattr(dmuon, "tuning_chooses_dtype", lambda: True)
    monkeypatch.setattr(engine, "_advised", False)
    assert _advice_of_a_step(tune_cache=None, ns_dtype="float32") == ([], ["float32"])
    cache = str(tmp_path / "tune.json")
    dmuon.tune([(8, 6, 1)], threads=torch.get_num_threads(), rounds=1, tune_cache=cache)
    tuned = dmuon.Orthogonalizer(threads=torch.get_num_threads(), tune_cache=cache).call_dtype(8, 6, 1)
    assert tuned[1]
    assert _advice_of_a_step(tune_cache=cache) == ([], [tuned[0]])


def test_muon_scale_meets_the_table_of_the_cpp_engine():
    # The one table of both definitions (tests/optim/optim_test.cpp checks update_rules.cpp's against it).
    table = json.loads((pathlib.Path(__file__).parents[1] / "data" / "muon_scale.json").read_text())
    assert len(table["cases"]) >= 4
    for case in table["cases"]:
        got = muon_scale(case["rows"], case["cols"], case["scale"])
        assert math.isclose(got, case["s"], rel_tol=4 * 2.0 ** -52), case


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_schedulers_set_lrs_as_for_adamw_and_the_steps_use_them(kind):
    params = parameters(SCHEDULED)
    opt = scheduled_optimizer(params)
    twins = [torch.nn.Parameter(torch.zeros(1)) for _ in opt.param_groups]
    adamw = torch.optim.AdamW([{"params": [t], "lr": g["lr"]} for t, g in zip(twins, opt.param_groups)])
    sched, adamw_sched = SCHEDULERS[kind](opt), SCHEDULERS[kind](adamw)
    ref = Reference({n: p.detach() for n, p in params.items()}, {})
    adamw_betas = opt.param_groups[2]["betas"]
    cycles_momentum = kind in ("OneCycleLR", "CyclicLR")
    for step in range(STEPS):
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in adamw.param_groups], step
        if cycles_momentum:  # Muon groups' momentum follows AdamW's beta1; AdamW groups keep their betas
            assert [g["momentum"] for g in opt.param_groups[:2]] == \
                [g["betas"][0] for g in adamw.param_groups[:2]], step
            assert opt.param_groups[2]["betas"] == adamw_betas
        grads = random_grads(params, step)
        ref.hyper = hyper_of(opt)
        ref.step(grads)
        set_grads(params, grads)
        for t in twins:
            t.grad = torch.ones(1)
        opt.step()
        adamw.step()
        sched.step()
        adamw_sched.step()
    assert sched.get_last_lr() == adamw_sched.get_last_lr()
    errors = relative_errors(params, ref)
    assert max(errors.values()) <= TOLERANCE, errors


# ---- add_param_group ----

def test_add_param_group_updates_its_parameters_from_the_next_step():
    first = parameters([("layers.0.weight", (8, 6)), ("norm.weight", (6,))])
    late = parameters([("late.weight", (6, 8)), ("late.bias", (6,))], seed=8)
    everything = {**first, **late}
    opt = DMuon(list(first.items()), balancer="lpt", ns_dtype="float32")
    ref = Reference({n: p.detach() for n, p in everything.items()}, {})
    for step in range(STEPS):
        if step == 3:
            opt.add_param_group({"params": list(late.items()), "lr": 0.01, "adamw_lr": 1e-2})
            assert [g["param_names"] for g in opt.param_groups[2:]] == [["late.weight"], ["late.bias"]]
            assert (opt.param_groups[2]["lr"], opt.param_groups[3]["lr"]) == (0.01, 1e-2)
            assert opt.param_groups[2]["momentum"] == opt.defaults["momentum"]
            assert set(opt.owners) == {"layers.0.weight", "late.weight"}
        live = everything if step >= 3 else first
        grads = random_grads(live, step)
        ref.hyper = hyper_of(opt)
        ref.step(grads)
        set_grads(live, grads)
        opt.step()
    errors = relative_errors(everything, ref)
    assert max(errors.values()) <= TOLERANCE, errors


def test_add_param_group_names_unnamed_tensors_after_the_existing_groups():
    opt = DMuon([torch.nn.Parameter(torch.randn(4, 4))])
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4, 4))], "use_muon": True})
    assert opt.param_groups_names == ["group0.param0", "group1.param0"]
    assert not any("param_names" in g for g in opt.param_groups)  # names made up here are not the user's


BAD_GROUPS = {  # a group to add, given the optimizer's parameter a → what the error says
    "duplicate": (lambda a: {"params": [("again", a)]},
                  "some parameters appear in more than one parameter group: 'again' (also 'a.weight')"),
    "lr": (lambda a: {"params": [("b.weight", torch.randn(4, 4))], "lr": -1.0}, "Invalid learning rate: -1.0"),
    "key": (lambda a: {"params": [("b.weight", torch.randn(4, 4))], "momentun": 0.9}, "unknown keys ['momentun']"),
    "vector": (lambda a: {"params": [("b.bias", torch.randn(4))], "use_muon": True}, "Muon needs a matrix"),
}


@pytest.mark.parametrize("bad", BAD_GROUPS)
def test_add_param_group_rejects_bad_groups_and_keeps_the_optimizer(bad):
    make_group, message = BAD_GROUPS[bad]
    a = torch.nn.Parameter(torch.randn(4, 4))
    opt = DMuon([("a.weight", a)])
    with pytest.raises(ValueError) as error:
        opt.add_param_group(make_group(a))
    assert message in str(error.value)
    assert opt.param_groups_names == ["a.weight"] and len(opt.param_groups) == 1 and list(opt.owners) == ["a.weight"]
    a.grad = torch.ones_like(a)
    opt.step()
    assert opt.updates == 1


# ---- routing ----

# (name, shape, "muon" or "adamw"): how named_parameters() spells the models' parameters (Hugging
# Face transformers, nanoGPT, Meta's llama, timm), with their shapes.
ROUTING = [
    # GPT-2 (transformer.h.N.* are Conv1D: (in, out) weights)
    ("transformer.wte.weight", (50257, 768), "adamw"),
    ("transformer.wpe.weight", (1024, 768), "adamw"),
    ("transformer.h.0.ln_1.weight", (768,), "adamw"),
    ("transformer.h.0.attn.c_attn.weight", (768, 2304), "muon"),
    ("transformer.h.0.attn.c_attn.bias", (2304,), "adamw"),
    ("transformer.h.0.attn.c_proj.weight", (768, 768), "muon"),
    ("transformer.h.0.ln_2.bias", (768,), "adamw"),
    ("transformer.h.11.mlp.c_fc.weight", (768, 3072), "muon"),
    ("transformer.h.11.mlp.c_proj.weight", (3072, 768), "muon"),
    ("transformer.ln_f.weight", (768,), "adamw"),
    ("lm_head.weight", (50257, 768), "adamw"),
    ("score.weight", (2, 768), "adamw"),                                    # GPT2ForSequenceClassification
    # Llama (Hugging Face), then Meta's own names
    ("model.embed_tokens.weight", (32000, 4096), "adamw"),
    ("model.layers.0.self_attn.q_proj.weight", (4096, 4096), "muon"),
    ("model.layers.0.self_attn.k_proj.weight", (1024, 4096), "muon"),
    ("model.layers.0.self_attn.v_proj.weight", (1024, 4096), "muon"),
    ("model.layers.0.self_attn.o_proj.weight", (4096, 4096), "muon"),
    ("model.layers.31.mlp.gate_proj.weight", (11008, 4096), "muon"),
    ("model.layers.31.mlp.up_proj.weight", (11008, 4096), "muon"),
    ("model.layers.31.mlp.down_proj.weight", (4096, 11008), "muon"),
    ("model.layers.0.input_layernorm.weight", (4096,), "adamw"),
    ("model.layers.0.post_attention_layernorm.weight", (4096,), "adamw"),
    ("model.norm.weight", (4096,), "adamw"),
    ("lm_head.weight", (32000, 4096), "adamw"),
    ("tok_embeddings.weight", (32000, 4096), "adamw"),
    ("layers.0.attention.wq.weight", (4096, 4096), "muon"),
    ("layers.0.feed_forward.w1.weight", (11008, 4096), "muon"),
    ("output.weight", (32000, 4096), "adamw"),
    # BERT (BertModel, then BertForPreTraining's heads and BertForSequenceClassification's)
    ("embeddings.word_embeddings.weight", (30522, 768), "adamw"),
    ("embeddings.position_embeddings.weight", (512, 768), "adamw"),
    ("embeddings.token_type_embeddings.weight", (2, 768), "adamw"),
    ("embeddings.LayerNorm.weight", (768,), "adamw"),
    ("encoder.layer.0.attention.self.query.weight", (768, 768), "muon"),
    ("encoder.layer.0.attention.self.key.weight", (768, 768), "muon"),
    ("encoder.layer.0.attention.self.value.bias", (768,), "adamw"),
    ("encoder.layer.0.attention.output.dense.weight", (768, 768), "muon"),
    ("encoder.layer.0.attention.output.LayerNorm.weight", (768,), "adamw"),
    ("encoder.layer.0.intermediate.dense.weight", (3072, 768), "muon"),
    ("encoder.layer.0.output.dense.weight", (768, 3072), "muon"),
    ("encoder.layer.0.output.LayerNorm.bias", (768,), "adamw"),
    ("pooler.dense.weight", (768, 768), "muon"),
    ("bert.encoder.layer.11.attention.output.dense.weight", (768, 768), "muon"),
    ("cls.predictions.bias", (30522,), "adamw"),
    ("cls.predictions.transform.dense.weight", (768, 768), "adamw"),       # part of the MLM head
    ("cls.predictions.decoder.weight", (30522, 768), "adamw"),
    ("cls.seq_relationship.weight", (2, 768), "adamw"),
    ("classifier.weight", (2, 768), "adamw"),
    # T5 (encoder.embed_tokens and decoder.embed_tokens are `shared`, tied)
    ("shared.weight", (32128, 512), "adamw"),
    ("encoder.embed_tokens.weight", (32128, 512), "adamw"),
    ("encoder.block.0.layer.0.SelfAttention.q.weight", (512, 512), "muon"),
    ("encoder.block.0.layer.0.SelfAttention.o.weight", (512, 512), "muon"),
    ("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", (32, 8), "adamw"),
    ("encoder.block.0.layer.0.layer_norm.weight", (512,), "adamw"),
    ("encoder.block.0.layer.1.DenseReluDense.wi.weight", (2048, 512), "muon"),
    ("encoder.block.0.layer.1.DenseReluDense.wo.weight", (512, 2048), "muon"),
    ("decoder.block.0.layer.1.EncDecAttention.k.weight", (512, 512), "muon"),
    ("decoder.block.5.layer.2.DenseReluDense.wi_0.weight", (1024, 512), "muon"),
    ("decoder.final_layer_norm.weight", (512,), "adamw"),
    ("lm_head.weight", (32128, 512), "adamw"),
    # ViT (timm's VisionTransformer, then Hugging Face's ViTForImageClassification)
    ("cls_token", (1, 1, 768), "adamw"),
    ("pos_embed", (1, 197, 768), "adamw"),
    ("patch_embed.proj.weight", (768, 3, 16, 16), "adamw"),                # the input layer, as an embedding
    ("patch_embed.proj.bias", (768,), "adamw"),
    ("blocks.0.norm1.weight", (768,), "adamw"),
    ("blocks.0.attn.qkv.weight", (2304, 768), "muon"),
    ("blocks.0.attn.proj.weight", (768, 768), "muon"),
    ("blocks.11.mlp.fc1.weight", (3072, 768), "muon"),
    ("blocks.11.mlp.fc2.weight", (768, 3072), "muon"),
    ("norm.weight", (768,), "adamw"),
    ("head.weight", (1000, 768), "adamw"),
    ("vit.embeddings.cls_token", (1, 1, 768), "adamw"),
    ("vit.embeddings.position_embeddings", (1, 197, 768), "adamw"),
    ("vit.embeddings.patch_embeddings.projection.weight", (768, 3, 16, 16), "adamw"),
    ("vit.encoder.layer.0.attention.attention.query.weight", (768, 768), "muon"),
    ("vit.encoder.layer.0.attention.output.dense.weight", (768, 768), "muon"),
    # beyond the five: MoE expert stacks and conv filters are Muon's; wrappers' prefixes change nothing
    ("layers.0.mlp.experts.w1", (8, 1024, 256), "muon"),
    ("layer1.0.conv1.weight", (64, 64, 3, 3), "muon"),
    ("module._orig_mod.lm_head.weight", (50257, 768), "adamw"),
    ("module._orig_mod.transformer.h.0.attn.c_attn.weight", (768, 2304), "muon"),
]


@pytest.mark.parametrize("name, shape, kind", ROUTING, ids=[f"{n}-{k}" for n, _, k in ROUTING])
def test_routing_table(name, shape, kind):
    assert ("muon" if is_muon_by_default(name, shape) else "adamw") == kind


class TinyLM(torch.nn.Module):
    """Names the name rule does not recognise, so only module types can route them: a token table
    (an nn.Embedding), a hidden Linear to the vocabulary size and back, and an untied output head (the
    last Linear to the vocabulary size) or a head tied to the table."""

    def __init__(self, vocab=12, width=8, tied=False):
        super().__init__()
        self.table = torch.nn.Embedding(vocab, width)
        self.up = torch.nn.Linear(width, vocab)
        self.down = torch.nn.Linear(vocab, width)
        self.norm = torch.nn.LayerNorm(width)
        self.project = torch.nn.Linear(width, vocab, bias=False)
        if tied:
            self.project.weight = self.table.weight


def routes(opt):
    return {n: g["use_muon"] for g in opt.param_groups for n in g["param_names"]}


@pytest.mark.parametrize("tied", [False, True])
def test_a_model_is_routed_by_module_type(tied):
    model = TinyLM(tied=tied)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = DMuon(model)
    expected = {"table.weight": False, "up.weight": True, "up.bias": False, "down.weight": True, "down.bias": False,
                "norm.weight": False, "norm.bias": False}
    if not tied:
        expected["project.weight"] = False
    assert routes(opt) == expected
    by_names = routes(DMuon(model.named_parameters()))  # names alone do not see the table and the head
    assert by_names["table.weight"] and by_names.get("project.weight", True)


def test_unnamed_tensors_warn_with_the_fix():
    model = TinyLM()
    with pytest.warns(UserWarning, match=r"pass model\.named_parameters\(\) or the model itself"):
        DMuon(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DMuon(model.named_parameters())
        DMuon([{"params": list(model.parameters()), "use_muon": False}])


# ---- step() without gradients ----

NO_GRAD = [("a.weight", (6, 4)), ("b.weight", (6, 4)), ("norm.weight", (4,))]


def test_step_without_gradients_changes_nothing():
    params = parameters(NO_GRAD)
    opt = DMuon(list(params.items()))
    before = snapshot(opt, params)
    assert opt.step(lambda: 1.5) == 1.5
    assert_same_snapshot(before, snapshot(opt, params))
    assert opt.updates == 0
    for entry in opt.state.values():  # the state DMuon creates at construction, still untouched
        assert all(not v.any() for v in entry.values()), entry
    set_grads(params, random_grads(params, 0))
    opt.step()
    opt.zero_grad()
    before = snapshot(opt, params)
    opt.step()
    assert_same_snapshot(before, snapshot(opt, params))
    assert opt.updates == 1 and opt.skipped_steps == 0


def test_a_parameter_without_a_gradient_keeps_its_values_and_state():
    params = parameters(NO_GRAD)
    opt = DMuon(list(params.items()), ns_dtype="float32")
    ref = Reference({n: p.detach() for n, p in params.items()}, {})
    for step in range(STEPS):
        grads = random_grads(params, step)
        if step >= 4:  # b.weight (in a bucket with a.weight) and norm.weight stop getting gradients
            grads = {"a.weight": grads["a.weight"]}
        ref.hyper = hyper_of(opt)
        ref.step(grads)
        if step == 4:
            frozen = snapshot(opt, {n: params[n] for n in ("b.weight", "norm.weight")})
        set_grads(params, grads)
        opt.step()
    assert opt.updates == STEPS
    assert_same_snapshot(frozen, snapshot(opt, {n: params[n] for n in ("b.weight", "norm.weight")}))
    errors = relative_errors(params, ref)
    assert max(errors.values()) <= TOLERANCE, errors


# ---- torch.compile ----

class CompiledLM(torch.nn.Module):
    def __init__(self, vocab=16, width=8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.up = torch.nn.Linear(width, 3 * width)
        self.down = torch.nn.Linear(3 * width, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens):  # tokens (B, T) → mean cross-entropy of predicting each token itself
        h = self.embed(tokens)
        h = h + self.down(torch.relu(self.up(h)))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), tokens.flatten())


COMPILE_STEPS = 4


def train(mode, backend):
    """The model after COMPILE_STEPS steps, eager ("eager"), with torch.compile(model) ("model") or
    torch.compile of the whole step ("step")."""
    torch.manual_seed(0)
    model = CompiledLM()
    tokens = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(1))
    opt = DMuon(model.named_parameters(), adamw_lr=1e-2)
    forward = torch.compile(model, backend=backend) if mode == "model" else model

    def train_step(tokens):
        loss = forward(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    if mode == "step":
        train_step = torch.compile(train_step, backend=backend)
    for _ in range(COMPILE_STEPS):
        train_step(tokens)
    assert opt.updates == COMPILE_STEPS
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def eager_result():
    return train("eager", None)


@pytest.mark.parametrize("mode", ["model", "step"])
def test_compiled_with_the_eager_backend_equals_eager_bit_for_bit(mode, eager_result):
    torch._dynamo.reset()
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    result = train(mode, recording_backend)
    for n in eager_result:
        assert torch.equal(result[n], eager_result[n]), n
    # step() ran outside every graph: none holds an in-place tensor method (momentum lerp_, weight add_)
    in_place = [n.target for gm in graphs for n in gm.graph.nodes if n.op == "call_method" and n.target.endswith("_")]
    assert graphs and not in_place, in_place


@pytest.mark.parametrize("given", ["model", "named_parameters"])
def test_a_compiled_model_names_its_parameters_as_the_model_and_their_state_loads_across(given):
    torch.manual_seed(0)
    model = CompiledLM()
    compiled = torch.compile(model)
    optimizers = [DMuon(m if given == "model" else m.named_parameters()) for m in (model, compiled)]
    names = [[n for g in opt.param_groups for n in g["param_names"]] for opt in optimizers]
    assert names[0] == names[1] and not any("_orig_mod" in n for n in names[1]), names
    optimizers[1].load_state_dict(optimizers[0].state_dict())


@pytest.mark.parametrize("mode", ["model", "step"])
def test_compiled_with_inductor_is_near_eager(mode, eager_result):
    # Inductor fuses and reorders the float32 forward and backward, so gradients differ from eager
    # by rounding (~1e-7 relative for these sizes); four steps of DMuon, continuous in the gradient,
    # keep the parameters within the 1e-5 the project allows float32 against float64.
    torch._dynamo.reset()
    result = train(mode, "inductor")
    errors = {n: float((result[n] - eager_result[n]).norm() / eager_result[n].norm()) for n in eager_result}
    assert max(errors.values()) <= TOLERANCE, errors


# ---- the single-process definition against torch.optim.AdamW and torch.optim.Muon ----
# torch.optim.AdamW's definition is ours (bias-corrected, decoupled decay p ← p·(1 − lr·wd)), so DMuon's
# AdamW groups are compared with it as torch runs it. torch.optim.Muon (torch >= 2.9) has our lerp
# momentum M ← β·M + (1−β)·g, Nesterov look-ahead U = (1−β)·g + β·M (off: U = M), decoupled decay with
# the unscaled lr, W ← W·(1 − lr·wd) − lr·s·O, and adjust_lr_fn "original" / "match_rms_adamw" are our
# scales of those names. It differs in Newton–Schulz, run in bfloat16 on X/max(‖X‖_F, eps) (ours:
# float32 on the CPU on X/(‖X‖_F + 1e-7), DESIGN 2.1), takes 2-D parameters only (ours: a conv weight
# as (out, in·kh·kw), an (E, m, n) stack as E matrices) and has other defaults (lr 1e-3, weight_decay
# 0.1, adjust_lr_fn "original"; DMuon: 0.02, 0, "match_rms_adamw"). So Muon is compared with
# torch.optim.Muon in float64 with its Newton–Schulz replaced by the reference's (newton_schulz_ref).
# Both against the float64 Reference of torch_dmuon_mpi_test.py (written from DESIGN 1), over 6 steps
# whose gradient scale changes (so the step count, bias correction and momentum all matter).

DEFINITION_SPECS = [("layers.0.tall", (12, 5)), ("layers.0.wide", (4, 10)), ("embed.weight", (7, 3)),
                    ("norm.bias", (6,))]
STEP_SCALES = (1.0, 0.3, 2.0, 0.5, 1.5, 0.1)
FLOAT32_EPS = torch.finfo(torch.float32).eps


def scaled_grads(params, step):
    return {n: g * STEP_SCALES[step] for n, g in random_grads(params, step).items()}


def largest_adam_ratio(state, t, betas, eps):
    """max |m̂/(√v̂ + ε)| of a Reference's AdamW state after update t."""
    m_hat, v_hat = state["m"] / (1 - betas[0] ** t), state["v"] / (1 - betas[1] ** t)
    return float((m_hat / (v_hat.sqrt() + eps)).abs().max())


def test_adamw_equals_torch_optim_adamw_and_the_float64_reference():
    lr, betas, eps, wd = 1e-2, (0.9, 0.95), 1e-8, 0.05
    params = parameters(DEFINITION_SPECS)
    twins = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}
    opt = DMuon(list(params.items()), adamw_lr=lr, adamw_betas=betas, adamw_eps=eps, adamw_weight_decay=wd,
                balancer="lpt")
    names = [n for g in opt.param_groups if not g["use_muon"] for n in g["param_names"]]
    assert names == ["embed.weight", "norm.bias"]
    adamw = torch.optim.AdamW([twins[n] for n in names], lr=lr, betas=betas, eps=eps, weight_decay=wd)
    ref = Reference({n: p.detach() for n, p in params.items()}, hyper_of(opt))
    ratio = 0.0
    for t in range(1, len(STEP_SCALES) + 1):
        grads = scaled_grads(params, t - 1)
        ref.step(grads)
        set_grads(params, grads)
        set_grads(twins, grads)
        opt.step()
        adamw.step()
        for n in names:
            ratio = max(ratio, largest_adam_ratio(ref.state[n], t, betas, eps))
            # Each float32 step rounds W and its update lr·r (|r| ≤ ratio) to a few ulps, in torch as in ours.
            bound = 4 * t * FLOAT32_EPS * (ref.w[n].abs() + lr * ratio)
            for label, x in (("DMuon", params[n]), ("torch.optim.AdamW", twins[n])):
                excess = float(((x.detach().double() - ref.w[n]).abs() - bound).max())
                assert excess <= 0, f"{label} {n} at step {t}: {excess:.2e} beyond the float64 reference's bound"
            excess = float(((params[n].detach() - twins[n].detach()).double().abs() - 2 * bound).max())
            assert excess <= 0, f"{n} at step {t}: DMuon and torch.optim.AdamW differ by {excess:.2e} beyond the bound"
    assert opt.updates == len(STEP_SCALES)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("scale", ["original", "match_rms_adamw"])
def test_muon_equals_torch_optim_muon_with_the_reference_newton_schulz(monkeypatch, nesterov, scale):
    lr, momentum, wd = 0.02, 0.9, 0.1
    params = parameters(DEFINITION_SPECS)
    matrices = ["layers.0.tall", "layers.0.wide"]
    twins = {n: torch.nn.Parameter(params[n].detach().double().clone()) for n in matrices}
    opt = DMuon(list(params.items()), lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=wd, scale=scale,
                algo="standard", balancer="lpt", ns_dtype="float32")
    assert [n for g in opt.param_groups if g["use_muon"] for n in g["param_names"]] == matrices

    def reference_newton_schulz(grad, ns_coefficients, ns_steps, eps):
        assert tuple(ns_coefficients) == KELLER and ns_steps == 5
        return newton_schulz_ref(grad, ns_steps)

    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", reference_newton_schulz)
    muon = torch.optim.Muon([twins[n] for n in matrices], lr=lr, weight_decay=wd, momentum=momentum,
                            nesterov=nesterov, adjust_lr_fn=scale)
    ref = Reference({n: p.detach() for n, p in params.items()}, hyper_of(opt), scale=scale)
    for t in range(1, len(STEP_SCALES) + 1):
        grads = scaled_grads(params, t - 1)
        ref.step(grads)
        set_grads(params, grads)
        set_grads(twins, {n: grads[n].double() for n in matrices})
        opt.step()
        muon.step()
        for n in matrices:
            rows, cols = dict(DEFINITION_SPECS)[n]
            s = max(1.0, rows / cols) ** 0.5 if scale == "original" else 0.2 * max(rows, cols) ** 0.5
            # torch's float64 step and ours differ by float64 rounding only: about 30 roundings a step,
            # amplified up to a^5 ≈ 490 by Newton–Schulz along small singular values.
            err = float((twins[n].detach() - ref.w[n]).abs().max())
            assert err <= t * 490 * 30 * 2.0 ** -53 * float(ref.w[n].abs().max()), \
                f"torch.optim.Muon {n} at step {t}: {err:.2e} from the float64 reference"
            # DMuon in float32: each step moves W by lr·s·O with the engine's float32 standard NS within
            # 2e-6 per element of float64 NS (optim_test's analysis), plus a few ulps of W per step.
            bound = t * lr * s * 2e-6 + 4 * t * FLOAT32_EPS * ref.w[n].abs()
            excess = float(((params[n].detach().double() - ref.w[n]).abs() - bound).max())
            assert excess <= 0, f"DMuon {n} at step {t}: {excess:.2e} beyond the float64 reference's bound"
