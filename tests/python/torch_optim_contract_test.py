"""dmuon.torch.DMuon keeps torch.optim.Optimizer's contract: each test makes the same calls on DMuon and
on torch.optim.AdamW and checks that DMuon does what AdamW does (one process; the state-dict round
trip and deep copies at 2–3 ranks are in torch_conventions_ranks_test.py):
  hooks         all six kinds (step, state_dict and load_state_dict, pre and post) run, in order,
                with prepend and handle.remove(), and what the hooks return is used
  names         named parameters put "param_names" in their groups; a state dict saved from named
                parameters loads into an optimizer of unnamed ones and back, by position; user
                groups keep their indices; mixing named and unnamed raises torch's error; torchtitan's
                groups (tensors with "param_names", "fused" and "foreach") named by those names, the
                kernel keys ignored
  copies        copy.deepcopy and pickle keep every public attribute, and the copy steps as the original
  lr            lr (given to DMuon or in a group) reaches every parameter, adamw_lr only AdamW's; a
                1-element tensor lr (0-D, 1-D, 2-D) steps as the float, also under OneCycleLR; a group key that none of its
                parameters uses, and an option of the whole optimizer in a group, raise at construction
  inputs        a bare tensor, a set, a non-leaf tensor, duplicates within and across groups, an empty list;
                torch's test_state_dict_deterministic re-enacted (param_groups extended by themselves: the same
                parameters in two groups); a bad hyper-parameter written between steps raises before any write
  base          zero_grad(set_to_none=True/False), step(closure), add_param_group with names,
                torch.load(weights_only=True) of a saved state dict
  3-D           a Conv1d and a Conv2d weight are one (out, in·k…) matrix, a stack of experts E matrices
                (by name, or by the experts predicate), each against the float64 Newton–Schulz

Run: PYTHONPATH=build/python:tests/python python -m pytest -q tests/python/torch_optim_contract_test.py
"""

import copy
import io
import pickle

import pytest
import torch

from dmuon.torch import DMuon
from muon_reference import newton_schulz_ref

FLOAT32_EPS = torch.finfo(torch.float32).eps
# DMuon's warning for unnamed matrices (tested in torch_conventions_test) would fill the report.
pytestmark = pytest.mark.filterwarnings("ignore:DMuon. parameters without names")


def make_net(seed=0):
    """Two Linear layers: names and shapes route alike (weights to Muon, biases to AdamW), so
    named_parameters() and parameters() give DMuon the same groups."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


INPUT = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))


def loss_of(net):
    return net(INPUT).pow(2).sum()


def backward(net):
    for p in net.parameters():
        p.grad = None
    loss_of(net).backward()


def train(net, opt, steps):
    for _ in range(steps):
        backward(net)
        opt.step()


def values(net):
    return [p.detach().clone() for p in net.parameters()]


def assert_same(a, b):
    """a equals b: nested dicts, lists and tuples of tensors (equal values) and plain values (==)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{a} != {b}"
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{a} != {b}"
        for x, y in zip(a, b):
            assert_same(x, y)
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and torch.equal(a, b), f"{a} != {b}"
    else:
        assert a == b, f"{a} != {b}"


def assert_equal_lists(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ---- hooks: all six kinds ----

def record_hooks(opt, log):
    """Registers one hook of each kind (and a second load_state_dict pre-hook, prepended) that append to log."""
    opt.register_step_pre_hook(lambda o, args, kwargs: log.append("step_pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: log.append("step_post"))
    opt.register_state_dict_pre_hook(lambda o: log.append("state_dict_pre"))

    def state_dict_post(o, state_dict):
        log.append("state_dict_post")
        state_dict["marked"] = True  # what a post hook returns or changes is the state dict
        return state_dict

    opt.register_state_dict_post_hook(state_dict_post)

    def load_pre(o, state_dict):
        log.append(("load_pre", state_dict.pop("marked", None)))
        state_dict["param_groups"][0]["lr"] = 0.125  # a pre hook may rewrite what is loaded
        return state_dict

    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_pre_hook(lambda o, state_dict: log.append("load_pre_first"), prepend=True)
    return opt.register_load_state_dict_post_hook(lambda o: log.append(("load_post", o.param_groups[0]["lr"])))


def test_all_six_hook_kinds_run_as_for_adamw():
    logs = {}
    for kind in ("dmuon", "adamw"):
        net = make_net()
        opt = DMuon(net.named_parameters()) if kind == "dmuon" else torch.optim.AdamW(net.named_parameters())
        log = logs[kind] = []
        handle = record_hooks(opt, log)
        train(net, opt, 1)
        saved = opt.state_dict()
        assert saved["marked"] is True
        opt.load_state_dict(saved)
        assert opt.param_groups[0]["lr"] == 0.125
        handle.remove()
        opt.load_state_dict(opt.state_dict())
    assert logs["dmuon"] == logs["adamw"] == [
        "step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_pre_first", ("load_pre", True),
        ("load_post", 0.125), "state_dict_pre", "state_dict_post", "load_pre_first", ("load_pre", True)]


# ---- named and unnamed parameters ----

def test_param_names_hold_the_given_names_per_group():
    net = make_net()
    adamw = torch.optim.AdamW(net.named_parameters())
    assert adamw.param_groups[0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    opt = DMuon(net.named_parameters())  # one user group of both kinds: its Muon half, then its AdamW half
    assert [(g["use_muon"], g["param_names"]) for g in opt.param_groups] == \
        [(True, ["0.weight", "2.weight"]), (False, ["0.bias", "2.bias"])]
    for unnamed in (DMuon(net.parameters()), torch.optim.AdamW(net.parameters())):
        assert not any("param_names" in g for g in unnamed.param_groups)


def torchtitan_groups(net, implementation_kwargs):
    """The param groups torchtitan 0.3.0's OptimizersContainer._build_param_groups makes (read from its
    components/optimizer/optimizer.py; torchtitan itself is not installed): per pattern, the matching tensors,
    their names in "param_names", the implementation's "fused" and "foreach", then the pattern's kwargs."""
    groups = []
    for pattern, kwargs in (("weight", {"use_muon": True}), ("bias", {"lr": 0.01})):
        named = [(n, p) for n, p in net.named_parameters() if pattern in n]
        groups.append({"params": [p for _, p in named], "param_names": [n for n, _ in named], **implementation_kwargs,
                       **kwargs})
    return groups


@pytest.mark.parametrize("implementation", [dict(fused=True, foreach=False), dict(fused=False, foreach=True),
                                            dict(fused=False, foreach=False)])
def test_torchtitans_groups_are_named_by_their_param_names_and_their_kernel_keys_ignored(implementation):
    net, twin = make_net(), make_net()
    opt = DMuon(torchtitan_groups(net, implementation))
    assert [(g["use_muon"], g["param_names"]) for g in opt.param_groups] == \
        [(True, ["0.weight", "2.weight"]), (False, ["0.bias", "2.bias"])]
    assert not any(k in g for g in opt.param_groups for k in ("fused", "foreach"))
    assert opt.state_dict()["param_groups"][0]["param_names"] == ["0.weight", "2.weight"]  # torchtitan's FQN keys
    reference = DMuon([{"params": [(n, p) for n, p in twin.named_parameters() if "weight" in n], "use_muon": True},
                       {"params": [(n, p) for n, p in twin.named_parameters() if "bias" in n], "lr": 0.01}])
    train(net, opt, 3)
    train(twin, reference, 3)
    assert_equal_lists(values(net), values(twin))
    bad = torchtitan_groups(make_net(), implementation)
    bad[0]["param_names"] = bad[0]["param_names"][:1]
    with pytest.raises(ValueError, match="param group 0 has 'param_names' \\(1\\) that do not name its 2 tensors"):
        DMuon(bad)


def test_user_groups_keep_their_indices():
    net = make_net()
    w0, b0, w2, b2 = net.parameters()
    groups = [{"params": [b0, b2], "lr": 0.1}, {"params": [w0]}, {"params": [w2], "lr": 0.03}]
    adamw = torch.optim.AdamW((copy.copy(g) for g in groups), lr=0.02)
    opt = DMuon((copy.copy(g) for g in groups), lr=0.02)
    for g, a in zip(opt.param_groups, adamw.param_groups, strict=True):
        assert [id(p) for p in g["params"]] == [id(p) for p in a["params"]] and g["lr"] == a["lr"]
    assert [g["use_muon"] for g in opt.param_groups] == [False, True, True]


@pytest.mark.parametrize("saved_named", [True, False])
def test_a_state_dict_loads_between_named_and_unnamed_parameters(saved_named):
    def build(net, named):
        return DMuon(net.named_parameters()) if named else DMuon(net.parameters())

    net, twin = make_net(), make_net()
    opt = build(net, saved_named)
    train(net, opt, 3)
    saved = copy.deepcopy(opt.state_dict())
    loaded = build(twin, not saved_named)
    twin.load_state_dict(net.state_dict())
    loaded.load_state_dict(saved)
    train(net, opt, 3)
    train(twin, loaded, 3)
    assert_equal_lists(values(net), values(twin))
    # The saved param_names replace the groups' own; without saved ones a group keeps its own (torch's
    # rule): either way the loaded groups have the named side's.
    assert [g.get("param_names") for g in loaded.param_groups] == [["0.weight", "2.weight"], ["0.bias", "2.bias"]]
    adamw_saved = torch.optim.AdamW(make_net().named_parameters() if saved_named else make_net().parameters())
    adamw = torch.optim.AdamW(make_net().parameters() if saved_named else make_net().named_parameters())
    adamw.load_state_dict(adamw_saved.state_dict())
    assert "param_names" in adamw.param_groups[0]


def test_mixing_named_and_unnamed_raises_torchs_error():
    net = make_net()
    w0, b0, w2, b2 = net.parameters()
    cases = {
        "in a group": lambda cls: cls([("0.weight", w0), b0]),
        "across groups": lambda cls: cls([{"params": [("0.weight", w0)]}, {"params": [w2]}]),
    }
    for label, build in cases.items():
        with pytest.raises(ValueError) as torch_error:
            build(torch.optim.AdamW)
        with pytest.raises(ValueError) as ours:
            build(DMuon)
        assert str(torch_error.value) in str(ours.value), label
    for first, added in (([("0.weight", w0)], [w2]), ([w0], [("2.weight", w2)])):
        adamw, opt = torch.optim.AdamW(list(first)), DMuon(list(first))
        with pytest.raises(ValueError) as torch_error:
            adamw.add_param_group({"params": list(added)})
        with pytest.raises(ValueError) as ours:
            opt.add_param_group({"params": list(added)})
        assert str(torch_error.value) in str(ours.value)


# ---- copies ----

def public_attributes(opt):
    return {k for k in vars(opt) if not k.startswith("_")}


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_keeps_every_public_attribute_and_steps_as_the_original(how):
    def duplicate(obj):
        return copy.deepcopy(obj) if how == "deepcopy" else pickle.loads(pickle.dumps(obj))

    for cls in (DMuon, torch.optim.AdamW):
        net = make_net()
        opt = cls(net.named_parameters())
        train(net, opt, 3)
        net_copy, opt_copy = duplicate((net, opt))
        assert public_attributes(opt_copy) == public_attributes(opt), cls
        train(net, opt, 3)
        train(net_copy, opt_copy, 3)
        assert_equal_lists(values(net), values(net_copy))


def test_a_deep_copy_of_the_optimizer_alone_steps_its_own_copies_of_the_parameters():
    for cls in (DMuon, torch.optim.AdamW):
        net = make_net()
        opt = cls(net.named_parameters())
        train(net, opt, 2)
        before = values(net)
        opt_copy = copy.deepcopy(opt)
        copies = [p for g in opt_copy.param_groups for p in g["params"]]
        for p in copies:
            p.grad = torch.ones_like(p)
        opt_copy.step()
        assert_equal_lists(values(net), before)  # the originals are not the copy's
        assert all(p in opt_copy.state for p in copies)


# ---- lr and the other hyper-parameters ----

def test_lr_given_to_dmuon_reaches_every_parameter_and_adamw_lr_only_adamws():
    net = make_net()
    assert [g["lr"] for g in DMuon(net.named_parameters(), lr=0.01).param_groups] == \
        [g["lr"] for g in torch.optim.AdamW(net.named_parameters(), lr=0.01).param_groups] * 2
    opt = DMuon(net.named_parameters(), lr=0.01, weight_decay=0.1, adamw_lr=1e-3)
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(0.01, 0.1), (1e-3, 0.1)]


def test_a_groups_own_lr_reaches_every_parameter_of_the_group():
    net = make_net()
    w0, b0, w2, b2 = net.parameters()
    groups = [{"params": [w0, b0], "lr": 0.05, "weight_decay": 0.2}, {"params": [w2, b2]}]
    adamw = torch.optim.AdamW(copy.copy(g) for g in groups)
    opt = DMuon((copy.copy(g) for g in groups), lr=0.01, adamw_lr=1e-3, adamw_weight_decay=0.0)
    assert adamw.param_groups[0]["lr"] == 0.05
    # user group 0 → Muon half and AdamW half, both at the group's lr; group 1 → the optimizer's
    assert [(g["use_muon"], g["lr"], g["weight_decay"]) for g in opt.param_groups] == \
        [(True, 0.05, 0.2), (False, 0.05, 0.2), (True, 0.01, 0.0), (False, 1e-3, 0.0)]
    opt = DMuon([{"params": [w0, b0], "lr": 0.05, "adamw_lr": 2e-3}])
    assert [g["lr"] for g in opt.param_groups] == [0.05, 2e-3]


@pytest.mark.parametrize("group, key", [
    (lambda w, b: {"params": [w], "betas": (0.9, 0.99)}, "betas"),
    (lambda w, b: {"params": [w], "use_muon": True, "adamw_lr": 1e-3}, "adamw_lr"),
    (lambda w, b: {"params": [b], "momentum": 0.9}, "momentum"),
    (lambda w, b: {"params": [w, b], "use_muon": False, "nesterov": False}, "nesterov"),
])
def test_a_group_key_none_of_its_parameters_uses_raises_at_construction(group, key):
    w, b = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match=f"sets \\['{key}'\\], which none of its parameters uses"):
        DMuon([group(w, b)])
    DMuon([{"params": [w, b], "momentum": 0.9, "betas": (0.8, 0.9)}])  # a group of both kinds uses both


@pytest.mark.parametrize("option, value", [("balancer", "lpt"), ("clip_grad_norm", 1.0)])
def test_an_option_of_the_whole_optimizer_in_a_group_is_refused(option, value):
    w = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=f"sets \\['{option}'\\], options of the whole optimizer"):
        DMuon([{"params": [w], option: value}])
    DMuon([w], **{option: value})


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_a_one_element_tensor_lr_steps_as_the_float(shape):
    results = []
    for lr in (torch.full(shape, 0.01, dtype=torch.float64), 0.01):  # float64: the float's own value
        net = make_net()
        opt = DMuon(net.named_parameters(), lr=lr, adamw_lr=lr)
        train(net, opt, 3)
        results.append(values(net))
    assert_equal_lists(*results)
    torch.optim.AdamW(make_net().parameters(), lr=torch.full(shape, 0.01), foreach=False)  # torch takes it too


def test_one_cycle_lr_schedules_a_tensor_lr_as_a_float_and_as_for_adamw():
    results, lrs = [], []
    for lr in (torch.tensor(0.01, dtype=torch.float64), 0.01):  # a scheduler fill_s the tensor: float64 holds
        net, adamw_net = make_net(), make_net()                   # the float's values exactly
        opt = DMuon(net.named_parameters(), lr=lr)
        adamw = torch.optim.AdamW(adamw_net.parameters(), lr=lr, foreach=False)
        scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.04, total_steps=6) for o in (opt, adamw)]
        for _ in range(5):
            backward(net)
            backward(adamw_net)
            opt.step()
            adamw.step()
            for sched in scheds:
                sched.step()
            assert [float(g["lr"]) for g in opt.param_groups] == [float(adamw.param_groups[0]["lr"])] * 2
            lrs.append(float(opt.param_groups[0]["lr"]))
        results.append(values(net))
    assert_equal_lists(*results)
    assert lrs[:5] == lrs[5:]


def test_a_tensor_lr_of_more_elements_raises_as_torch():
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        torch.optim.AdamW(make_net().parameters(), lr=torch.ones(2), foreach=False)
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        DMuon(make_net().named_parameters(), lr=torch.ones(2))


# ---- error inputs, each as torch.optim.AdamW ----

def same_error(build, kind):
    with pytest.raises(kind) as torch_error:
        build(torch.optim.AdamW)
    with pytest.raises(kind) as ours:
        build(DMuon)
    assert str(torch_error.value) in str(ours.value)


def test_a_bare_tensor_raises_a_type_error():
    same_error(lambda cls: cls(torch.nn.Parameter(torch.randn(4, 4))), TypeError)


def test_a_non_leaf_tensor_raises_a_value_error():
    w = torch.nn.Parameter(torch.randn(4, 4))
    same_error(lambda cls: cls([w * 2]), ValueError)


def test_an_empty_list_raises_a_value_error():
    same_error(lambda cls: cls([]), ValueError)


def test_a_parameter_in_two_groups_raises_a_value_error():
    w = torch.nn.Parameter(torch.randn(4, 4))
    same_error(lambda cls: cls([{"params": [w]}, {"params": [w]}]), ValueError)


# A bad hyper-parameter → (torch's optimizer and its keywords, DMuon's keywords): the same mistake.
HYPER_MISTAKES = {
    "tensor lr": ((torch.optim.AdamW, dict(lr=torch.ones(2), foreach=False)), dict(lr=torch.ones(2))),
    "lr": ((torch.optim.AdamW, dict(lr=-0.1)), dict(lr=-0.1)),
    "adamw lr": ((torch.optim.AdamW, dict(lr=-0.1)), dict(adamw_lr=-0.1)),
    "beta 0": ((torch.optim.AdamW, dict(betas=(1.0, 0.9))), dict(adamw_betas=(1.0, 0.9))),
    "beta 1": ((torch.optim.AdamW, dict(betas=(0.9, -0.5))), dict(adamw_betas=(0.9, -0.5))),
    "eps": ((torch.optim.AdamW, dict(eps=-1e-8)), dict(adamw_eps=-1e-8)),
    "weight decay": ((torch.optim.AdamW, dict(weight_decay=-0.1)), dict(weight_decay=-0.1)),
    "adamw weight decay": ((torch.optim.AdamW, dict(weight_decay=-0.1)), dict(adamw_weight_decay=-0.1)),
    "momentum": ((torch.optim.SGD, dict(lr=0.1, momentum=-0.5)), dict(momentum=-0.5)),
}
BAD_PARAMS = {"empty": lambda: [], "bare tensor": lambda: torch.nn.Parameter(torch.randn(4, 4)),
              "not tensors": lambda: [1.0, 2.0]}


@pytest.mark.parametrize("params", BAD_PARAMS)
@pytest.mark.parametrize("mistake", HYPER_MISTAKES)
def test_hyper_parameters_are_checked_before_parameters_as_torch(mistake, params):
    (torch_class, torch_keywords), ours = HYPER_MISTAKES[mistake]
    with pytest.raises(ValueError) as torch_error:
        torch_class(BAD_PARAMS[params](), **torch_keywords)
    with pytest.raises(ValueError) as our_error:
        DMuon(BAD_PARAMS[params](), **ours)
    assert str(torch_error.value) in str(our_error.value)


def test_a_group_hyper_parameter_is_named_with_torchs_message():
    w = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"param group of 'w': Invalid beta parameter at index 1: 1\.0"):
        DMuon([{"params": [("w", w)], "use_muon": False, "betas": (0.9, 1.0)}])


def test_a_muon_parameter_on_a_device_the_engine_lacks_is_named():
    # A meta-device model whose optimizer is built before to_empty(): the parameters have no storage yet.
    with torch.device("meta"):
        net = make_net()
    with pytest.raises(ValueError, match=r"parameter '0\.weight': device meta: libdmuon_c runs on cpu and cuda only"):
        DMuon(net.named_parameters())


def test_a_set_warns_as_torch():
    params = set(make_net().parameters())
    for cls in (torch.optim.AdamW, DMuon):
        with pytest.warns(FutureWarning, match="ordering of tensors in sets will change between runs"):
            cls(params)


def test_a_parameter_repeated_in_a_group_warns_and_is_updated_once():
    net, twin = make_net(), make_net()
    w0, b0, w2, b2 = net.parameters()
    for cls in (torch.optim.AdamW, DMuon):
        with pytest.warns(UserWarning, match="duplicate parameters"):
            cls([("0.weight", w0), ("again", w0), ("0.bias", b0), ("2.weight", w2), ("2.bias", b2)])
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = DMuon([("0.weight", w0), ("again", w0), ("0.bias", b0), ("2.weight", w2), ("2.bias", b2)])
    assert opt.param_groups[0]["param_names"] == ["0.weight", "2.weight"]
    train(net, opt, 2)
    train(twin, DMuon(twin.named_parameters()), 2)
    assert_equal_lists(values(net), values(twin))


@pytest.mark.parametrize("named_copy", [True, False])
@pytest.mark.parametrize("named", [True, False])
def test_torchs_state_dict_deterministic_passes_repeated_groups_included(named, named_copy):
    """PyTorch's test_state_dict_deterministic (test/test_optim.py, which torch's wheel does not ship), its steps on
    DMuon: 10 steps; a second optimizer over clones loads the first's state dict; both step 10 times alike; their
    state dicts are equal without param names; then the copy's param_groups extended by themselves (the same
    parameters in two groups each, as torch.optim allows) give the last group as the first's, the repeated
    parameters under their first indices, and it steps as before (each parameter once)."""
    weight, bias = torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(2))
    x = torch.randn(3)

    def of(params, named):
        return [(f"name{i}", p) for i, p in enumerate(params)] if named else params

    def without_names(state_dict):
        state_dict = copy.deepcopy(state_dict)
        for group in state_dict["param_groups"]:
            group.pop("param_names", None)
        return state_dict

    def closure(opt, w, b):
        opt.zero_grad()
        loss = (w.mv(x) + b).pow(2).sum()
        loss.backward()
        return loss

    opt = DMuon(of([weight, bias], named))
    for _ in range(10):
        opt.step(lambda: closure(opt, weight, bias))
    with torch.no_grad():
        weight_c, bias_c = torch.nn.Parameter(weight.clone()), torch.nn.Parameter(bias.clone())
    opt_c = DMuon(of([weight_c, bias_c], named_copy))
    opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(10):
        opt.step(lambda: closure(opt, weight, bias))
        opt_c.step(lambda: closure(opt_c, weight_c, bias_c))
        assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c)
    assert_same(without_names(opt.state_dict()), without_names(opt_c.state_dict()))
    opt_c.param_groups.extend(opt_c.param_groups)
    assert_same(without_names(opt.state_dict())["param_groups"][-1],
                without_names(opt_c.state_dict())["param_groups"][-1])
    opt.step(lambda: closure(opt, weight, bias))
    opt_c.step(lambda: closure(opt_c, weight_c, bias_c))
    assert torch.equal(weight, weight_c) and torch.equal(bias, bias_c)
    opt_c.load_state_dict(opt_c.state_dict())  # its own, the repeated groups' included


@pytest.mark.parametrize("key, value, needle", [
    ("lr", float("nan"), "Invalid learning rate: nan"), ("lr", -1.0, "Invalid learning rate: -1.0"),
    ("momentum", 1.0, r"Invalid momentum value: 1.0"), ("weight_decay", -0.5, "Invalid weight_decay value: -0.5"),
    ("betas", (0.9, 1.0), "Invalid beta parameter at index 1: 1.0"), ("eps", 0.0, "Invalid epsilon value: 0.0")])
def test_a_bad_hyper_parameter_set_between_steps_raises_before_anything_changes(key, value, needle):
    """A scheduler or the user may write a group's values after construction: step() checks them as the
    constructor does, before its first write."""
    net = make_net()
    opt = DMuon(net.named_parameters())
    train(net, opt, 1)
    group = next(g for g in opt.param_groups if key in g)
    group[key] = value
    backward(net)
    before = values(net) + [t.clone() for st in opt.state.values() for t in st.values()]
    with pytest.raises(ValueError, match=rf"param group of '\w+\.\w+': {needle}"):
        opt.step()
    assert_equal_lists(before, values(net) + [t for st in opt.state.values() for t in st.values()])


# ---- the rest of the base-class contract ----

@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_as_adamw(set_to_none):
    grads = {}
    for cls in (DMuon, torch.optim.AdamW):
        net = make_net()
        opt = cls(net.named_parameters())
        backward(net)
        opt.zero_grad(set_to_none=set_to_none)
        grads[cls] = [p.grad for p in net.parameters()]
    for ours, theirs in zip(grads[DMuon], grads[torch.optim.AdamW]):
        assert (ours is None) == (theirs is None) == set_to_none
        assert set_to_none or (torch.equal(ours, theirs) and not ours.any())


def test_step_with_a_closure_returns_its_loss_and_uses_its_gradients():
    for cls in (DMuon, torch.optim.AdamW):
        net = make_net()
        opt = cls(net.named_parameters())
        computed = []

        def closure():
            opt.zero_grad()
            loss = loss_of(net)
            loss.backward()  # step() runs the closure with gradients enabled
            computed.append(loss)
            return loss

        returned = [opt.step(closure) for _ in range(3)]
        assert len(computed) == 3 and all(r is c for r, c in zip(returned, computed)), cls
    twin = make_net()
    train(twin, DMuon(twin.named_parameters()), 3)  # the closure's gradients are the ones used
    assert_equal_lists(values(net if cls is DMuon else twin), values(twin))


def test_add_param_group_with_names_as_adamw():
    net = make_net()
    w0, b0, w2, b2 = net.parameters()
    for cls in (DMuon, torch.optim.AdamW):
        opt = cls([("0.weight", w0)])
        opt.add_param_group({"params": [("2.weight", w2)], "lr": 0.5})
        assert opt.param_groups[-1]["param_names"] == ["2.weight"] and opt.param_groups[-1]["lr"] == 0.5


def test_add_param_group_takes_a_dict_only_as_adamw():
    w0, b0, w2, b2 = make_net().parameters()
    for group in ([w2], w2):
        same_error(lambda cls: cls([w0]).add_param_group(group), TypeError)


def test_a_saved_state_dict_loads_with_weights_only_and_resumes_bit_for_bit():
    net, twin = make_net(), make_net()
    opt = DMuon(net.named_parameters(), lr=torch.tensor(0.02))
    train(net, opt, 3)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = DMuon(twin.named_parameters(), lr=torch.tensor(0.02))
    twin.load_state_dict(net.state_dict())
    resumed.load_state_dict(saved)
    train(net, opt, 3)
    train(twin, resumed, 3)
    assert_equal_lists(values(net), values(twin))


# ---- 3-D parameters: convolution filters and stacks of experts, against the float64 reference ----

def one_muon_step(named, **options):
    """Each parameter after one DMuon step from zero momentum with gradient g (lr 0.02, momentum 0.95,
    Nesterov): W − lr·s·O, O the float32 Newton–Schulz of U = (1 − β²)·g per matrix."""
    opt = DMuon([{"params": named, "use_muon": True}], algo="standard", balancer="lpt", ns_dtype="float32", **options)
    opt.step()
    return opt


def expected_after_one_step(w0, g, matrices):
    """The float64 reference: w0 − lr·s·NS(U) for each (rows, cols) matrix of `matrices(t)`, which
    views a tensor as its (count, rows, cols) stack of Muon matrices."""
    lr, beta = 0.02, 0.95
    u = matrices((1 - beta * beta) * g.double())
    rows, cols = u.shape[1], u.shape[2]
    o = torch.stack([newton_schulz_ref(m) for m in u]).reshape(w0.shape)
    s = 0.2 * max(rows, cols) ** 0.5
    return w0.double() - lr * s * o, lr * s


@pytest.mark.parametrize("name, shape, experts, as_matrices", [
    ("conv1d.weight", (16, 8, 3), None, lambda t: t.reshape(1, 16, 24)),
    ("conv2d.weight", (6, 3, 2, 2), None, lambda t: t.reshape(1, 6, 12)),
    ("moe.experts.w1", (4, 12, 8), None, lambda t: t),
    ("moe.w1", (4, 12, 8), lambda name, shape: name == "moe.w1", lambda t: t),
])
def test_a_3d_parameter_is_a_conv_matrix_unless_it_is_a_stack_of_experts(name, shape, experts, as_matrices):
    gen = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(shape, generator=gen))
    w.grad = torch.randn(shape, generator=gen)
    w0 = w.detach().clone()
    opt = one_muon_step([(name, w)], **({} if experts is None else {"experts": experts}))
    expected, lr_s = expected_after_one_step(w0, w.grad, as_matrices)
    # The engine's float32 standard Newton–Schulz is within 2e-6 per element of float64's (optim_test's
    # analysis, as in torch_conventions_test), plus a few ulps of W.
    bound = lr_s * 2e-6 + 4 * FLOAT32_EPS * expected.abs()
    excess = float(((w.detach().double() - expected).abs() - bound).max())
    assert excess <= 0, f"{name}: {excess:.2e} beyond the bound"
    count = as_matrices(w0).shape[0]
    assert sorted(opt.owners) == ([name] if count == 1 else [f"{name}[{e}]" for e in range(count)])


def test_conv_modules_weights_are_one_matrix_each_when_given_the_model():
    model = torch.nn.Sequential(torch.nn.Conv1d(8, 16, 3), torch.nn.Conv2d(16, 6, 2))
    opt = DMuon(model)
    assert sorted(opt.owners) == ["0.weight", "1.weight"]


def test_the_experts_predicate_marks_only_3d_parameters():
    w = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="marked a stack of experts"):
        DMuon([("w", w)], experts=lambda name, shape: True)
