"""DMuon.step() reads nothing back from its tensors: the gradient norm, the clipping factor and the
non-finite check stay tensors until the optimizer settles them (dmuon/torch/gradient_check.py).

A CPU step settles at its own end (the data is already on the host). A GPU step settles later: at a
step() that finds its check arrived on the host, or when updates, skipped_steps, last_grad_norm or
state_dict() are read; these tests give a CPU step a GPU's timing, with checks that never arrive by
themselves (GradientCheck.arrived patched to False), and run step()
under a guard that fails on any read of a tensor's values by the host (.item(), float(), int(), bool(),
.tolist(), .numpy(), .cpu()): on a GPU each is a device-to-host copy that makes the host wait for the
queue. (A GPU tensor's .to("cpu") would be one too; on a CPU it is no operation, so only a GPU run
could see it.) Checked with the settling deferred:
  no reads      a step of Muon and AdamW parameters, clipping active, reads nothing; it gives the same
                parameters, bit for bit, as steps that settle at once, and counts its update when settled
  error         a non-finite gradient: step() returns, nothing changes (parameters and state bit for
                bit); the next read of updates raises FloatingPointError naming the parameter, and
                the next finite step updates
  skip          nonfinite="skip": the same step is skipped and counted when settled
  state_dict    state_dict() settles first, so a checkpoint carries the counters of every step taken

Run: PYTHONPATH=build/python:tests/python python -m pytest -q tests/python/torch_step_sync_test.py
"""

import copy

import pytest
import torch

from dmuon.torch import DMuon
from dmuon.torch.gradient_check import GradientCheck
from host_reads import no_host_reads


class Model(torch.nn.Module):
    """An embedding, a norm and an output head (AdamW's) around two hidden matrices (Muon's)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.hidden = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, 8))
        self.norm = torch.nn.RMSNorm(8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, tokens):
        return self.head(self.norm(self.hidden(self.embed(tokens))))


TOKENS = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(1))


def backward(model, scale=1.0):
    model.zero_grad(set_to_none=True)
    (model(TOKENS).pow(2).mean() * scale).backward()


@pytest.fixture
def deferred(monkeypatch):
    """Steps settle as a GPU's do: later, not at their own end."""
    monkeypatch.setattr(GradientCheck, "arrived", lambda self: False)


def make(**options):
    model = Model()
    return model, DMuon(model, lr=0.02, clip_grad_norm=0.05, **options)


def snapshot(model, opt):
    return copy.deepcopy(([p.detach().clone() for p in model.parameters()], opt.state_dict()["state"]))


def assert_identical(a, b):
    params_a, state_a = a
    params_b, state_b = b
    for x, y in zip(params_a, params_b):
        assert torch.equal(x, y)
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        for name in state_a[key]:
            assert torch.equal(state_a[key][name], state_b[key][name]), (key, name)


def test_step_reads_nothing_back_and_equals_settling_at_once(monkeypatch):
    at_once_model, at_once = make()
    for _ in range(3):
        backward(at_once_model)
        at_once.step()
    assert at_once.last_grad_norm > 0.05, "clipping never active: the test would not see the clipping factor"

    monkeypatch.setattr(GradientCheck, "arrived", lambda self: False)
    model, opt = make()
    for _ in range(3):
        backward(model)
        with no_host_reads():
            opt.step()
    assert opt.updates == 3 and opt.skipped_steps == 0
    assert opt.last_grad_norm == at_once.last_grad_norm
    assert_identical(snapshot(model, opt), snapshot(at_once_model, at_once))


def test_nonfinite_gradient_changes_nothing_and_the_next_settle_raises(deferred):
    model, opt = make()
    backward(model)
    opt.step()
    before = snapshot(model, opt)
    backward(model)
    model.hidden[0].weight.grad[1, 2] = float("nan")
    with no_host_reads():
        opt.step()
    with pytest.raises(FloatingPointError,
                       match=r"'hidden\.0\.weight' on rank 0 at update 2 \(that step was skipped: nothing changed\)"):
        opt.updates
    assert_identical(snapshot(model, opt), before)
    assert opt.updates == 1
    backward(model)
    opt.step()
    assert opt.updates == 2


def test_nonfinite_skip_is_counted_when_settled(deferred):
    model, opt = make(nonfinite="skip")
    backward(model)
    opt.step()
    before = snapshot(model, opt)
    backward(model)
    model.embed.weight.grad[0, 0] = float("inf")
    opt.step()
    assert_identical(snapshot(model, opt), before)
    assert (opt.updates, opt.skipped_steps) == (1, 1)


def test_state_dict_settles_first(deferred):
    model, opt = make()
    for _ in range(2):
        backward(model)
        opt.step()
    saved = opt.state_dict()
    assert [g["updates"] for g in saved["param_groups"]] == [2] * len(saved["param_groups"])


@pytest.mark.parametrize("max_norm", [0.05, 1e6])  # clipping, and a factor of 1
def test_clip_grad_norm_reads_nothing_back(max_norm):
    """dmuon.torch.clip_grad_norm_ (here on plain tensors, one process) keeps its norm and clipping factor as
    tensors, as torch.nn.utils.clip_grad_norm_ does (M8: no float() of the norm on every call): the norm is the
    float64 one, within float32 rounding of torch's, and every gradient is scaled by min(1, max_norm / (norm +
    1e-6)), bit for bit."""
    import dmuon.torch

    model = Model()
    backward(model)
    before = [p.grad.clone() for p in model.parameters()]
    with no_host_reads():
        norm = dmuon.torch.clip_grad_norm_(model.parameters(), max_norm)
    want = sum(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2 for g in before) ** 0.5
    assert norm.dtype == torch.float64 and norm.device == before[0].device
    assert torch.allclose(norm, want, rtol=1e-12, atol=0)
    reference = Model()
    backward(reference)
    assert abs(float(norm) - float(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm))) <= 1e-6 * float(norm)
    scale = min(1.0, max_norm / (float(norm) + 1e-6))
    assert (scale < 1.0) == (max_norm == 0.05), "the first case must clip, the second must not"
    for p, g in zip(model.parameters(), before):
        assert torch.equal(p.grad, g * scale)
