"""Every layout torch hands an optimizer (issue 40), one process (pytest; docs/pytorch.md, "Layouts"):

  layouts      parameters that are non-contiguous views (torch's own optimizer tests' [..., 0]), transposed
               matrices, column slices, channels_last and channels_last_3d conv filters, a transposed stack
               of experts, each with gradients laid out as the parameter, contiguous, expanded (stride 0)
               or sliced from a larger tensor, in both halves (Muon and AdamW): 3 steps equal the same
               steps on contiguous copies bit for bit, and no byte of the base tensor outside the
               parameter changes
  properties   random shapes (empty and 1-row included), strides and storage offsets (torch.as_strided
               on a larger base, gradients too), float32 and bfloat16, both halves: the update equals
               the dense reference bit for bit and every byte of the bases outside the tensors is
               unchanged (fixed seeds, a fixed number of cases)
  refused      a parameter whose elements share memory (expanded) at construction, naming it and its
               strides; dmuon.torch.clip_grad_norm_ of such a gradient, before it scales any
  clipping     dmuon.torch.clip_grad_norm_ of strided gradients equals torch's, nothing outside them
               touched
  conv nets    a ConvNet and a ViT-style patch embedding in channels_last train as in contiguous format
               (within float32 rounding of their different convolution orders)
"""

import random

import pytest
import torch

import dmuon.torch
from conv_nets import CONV_TOLERANCE, HYPER, ConvNet, PatchEmbedding
from dmuon.torch import DMuon

STEPS = 3


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def randn(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=seeded(seed)).to(dtype)


def strided_copy(values, make):
    """make(values) → (base, tensor): tensor, a view of base laid out some way, holds values."""
    base, t = make(values)
    t.copy_(values)
    return base, t


def outside(base, t):
    """A bool mask over base's bytes: true where t's elements do not lie."""
    covered = torch.zeros(base.numel(), dtype=torch.bool)
    if t.numel():
        index = torch.arange(base.numel()).as_strided(t.shape, t.stride(), t.storage_offset() - base.storage_offset())
        covered[index.reshape(-1)] = True
    return (~covered).repeat_interleave(base.element_size())


def raw_bytes(t):
    return t.detach().reshape(-1).view(torch.uint8).clone()


# ---- layouts: (base, view) makers for a parameter of shape `shape` ----

def column_view(shape):
    """torch's optimizer tests' non-contiguous parameter: every other element of a larger tensor."""
    def make(values):
        base = torch.randn(*shape, 2, generator=seeded(7))
        return base, base[..., 0]
    return make


def transposed(shape):
    def make(values):
        base = torch.randn(*reversed(shape), generator=seeded(7))
        return base, base.permute(*reversed(range(len(shape))))
    return make


def column_slice(shape):
    def make(values):
        base = torch.randn(*shape[:-1], shape[-1] + 3, generator=seeded(7))
        return base, base[..., 1:shape[-1] + 1]
    return make


def memory_format(fmt):
    def make(values):
        base = torch.randn(values.shape, generator=seeded(7)).contiguous(memory_format=fmt)
        return base, base
    return make


PARAM_LAYOUTS = {
    "column view": ((10, 5), column_view((10, 5))),
    "transposed": ((6, 9), transposed((6, 9))),
    "column slice": ((7, 4), column_slice((7, 4))),
    "channels_last": ((8, 3, 3, 3), memory_format(torch.channels_last)),
    "channels_last_3d": ((4, 2, 3, 2, 2), memory_format(torch.channels_last_3d)),
    "experts transposed": ((3, 4, 5), lambda values: (lambda b: (b, b.transpose(1, 2)))(torch.randn(3, 5, 4))),
}


def grad_in(layout, param, values):
    """A gradient holding `values` laid out as `layout` says, for parameter `param`."""
    if layout == "as the parameter":
        g = torch.empty_strided(param.shape, param.stride())
        return g.copy_(values)
    if layout == "contiguous":
        return values.clone()
    if layout == "expanded":  # every row the same: stride 0 on dim 0
        return values[:1].expand(values.shape)
    if layout == "sliced":  # a view inside a larger tensor, at an offset, its last dim strided
        big = torch.zeros(values.shape[0] + 2, *values.shape[1:-1], 2 * values.shape[-1])
        view = big[1:values.shape[0] + 1, ..., ::2]
        return view.copy_(values)
    raise ValueError(layout)


def steps_on(named, grads_of, use_muon, steps=STEPS):
    """Runs `steps` DMuon steps on named (name, parameter) with gradients grads_of(step, name, param)."""
    opt = DMuon([{"params": named, "use_muon": use_muon}], **HYPER)
    for step in range(steps):
        for name, p in named:
            p.grad = grads_of(step, name, p)
        opt.step()
    return opt


@pytest.mark.parametrize("grad_layout", ["as the parameter", "contiguous", "expanded", "sliced"])
@pytest.mark.parametrize("layout", PARAM_LAYOUTS)
@pytest.mark.parametrize("use_muon", [True, False], ids=["muon", "adamw"])
def test_a_strided_parameter_steps_as_its_contiguous_copy(layout, grad_layout, use_muon):
    shape, make = PARAM_LAYOUTS[layout]
    name = "mlp.experts.w" if layout.startswith("experts") else "layer.weight"
    values = randn(shape, 1)
    base, view = strided_copy(values, make)
    assert not view.is_contiguous()
    before = raw_bytes(base)
    strided = torch.nn.Parameter(view)
    assert strided.data_ptr() == view.data_ptr()  # the parameter is the view: updates land in base
    dense = torch.nn.Parameter(values.clone())

    def gradient(step):
        g = randn(shape, 100 + step)
        return g[:1].expand(shape).clone() if grad_layout == "expanded" else g

    steps_on([(name, strided)], lambda step, n, p: grad_in(grad_layout, p, gradient(step)), use_muon)
    steps_on([(name, dense)], lambda step, n, p: gradient(step), use_muon)
    assert torch.equal(strided.detach(), dense.detach())
    assert not torch.equal(dense.detach(), values)  # the steps did change it
    mask = outside(base, view)
    assert torch.equal(raw_bytes(base)[mask], before[mask])


def test_the_issues_example_keeps_the_other_column():
    base = torch.randn(10, 5, 2, generator=seeded(0))
    other = base[..., 1].clone()
    w = torch.nn.Parameter(base[..., 0])
    twin = torch.nn.Parameter(base[..., 0].clone())
    for p in (w, twin):
        opt = DMuon([("layer.weight", p)], **HYPER)
        for step in range(STEPS):
            p.grad = randn((10, 5), step)
            opt.step()
    assert torch.equal(w.detach(), twin.detach())
    assert torch.equal(base[..., 1], other)


# ---- properties: random as_strided layouts ----

def random_layout(rng, shape):
    """(strides, storage offset, base numel) of a non-overlapping layout of `shape`: dims in a random order,
    each stride past the span of the dims inside it plus a random gap."""
    order = list(range(len(shape)))
    rng.shuffle(order)
    strides, span = [0] * len(shape), 0
    for d in order:
        strides[d] = span + 1 + rng.randrange(3)
        span += (shape[d] - 1) * strides[d] if shape[d] > 0 else 0
    offset = rng.randrange(5)
    return tuple(strides), offset, offset + span + 1 + rng.randrange(4)


def as_strided_on_base(rng, values, seed):
    strides, offset, numel = random_layout(rng, values.shape)
    base = randn((numel,), seed, values.dtype)
    view = base.as_strided(values.shape, strides, offset)
    view.copy_(values)
    return base, view


def random_shape(rng, use_muon):
    dims = rng.choice([2, 2, 3, 4] if use_muon else [1, 2, 3])
    shape = [rng.randint(1, 5) for _ in range(dims)]
    kind = rng.random()
    if kind < 0.15:
        shape[0] = 0  # empty
    elif kind < 0.35:
        shape[0] = 1  # one row
    return tuple(shape)


CASES = 48


@pytest.mark.parametrize("case", range(CASES))
def test_random_strided_layouts_step_as_dense_and_touch_nothing_else(case):
    rng = random.Random(4000 + case)
    use_muon = case % 2 == 0
    dtype = (torch.float32, torch.bfloat16)[(case // 2) % 2]
    shape = random_shape(rng, use_muon)
    values = randn(shape, case, dtype)
    base, view = as_strided_on_base(rng, values, 10_000 + case)
    strided, dense = torch.nn.Parameter(view), torch.nn.Parameter(values.clone())
    bases = [base]
    before = [raw_bytes(base)]
    views = [view]
    grads = []
    for step in range(2):
        g = randn(shape, 50_000 + 10 * case + step, dtype)
        g_base, g_view = as_strided_on_base(rng, g, 60_000 + 10 * case + step)
        bases.append(g_base)
        before.append(raw_bytes(g_base))
        views.append(g_view)
        grads.append((g, g_view))
    for p, pick in ((strided, 1), (dense, 0)):
        opt = DMuon([{"params": [("layer.weight", p)], "use_muon": use_muon}], **HYPER)
        for step in range(2):
            p.grad = grads[step][pick]
            opt.step()
    assert torch.equal(strided.detach(), dense.detach()), (shape, view.stride(), dtype)
    for b, v, old in zip(bases, views, before):
        mask = outside(b, v)
        assert torch.equal(raw_bytes(b)[mask], old[mask]), (shape, v.stride(), dtype)


# ---- refused ----

def test_an_expanded_parameter_is_refused_naming_it_and_its_strides():
    w = torch.nn.Parameter(torch.randn(1, 5).expand(4, 5))
    for use_muon in (True, False):
        with pytest.raises(ValueError, match=r"parameter 'layer\.weight' of shape \(4, 5\) has strides \(0, 1\)"):
            DMuon([{"params": [("layer.weight", w)], "use_muon": use_muon}])


def test_clip_grad_norm_refuses_an_expanded_gradient_before_scaling_any():
    a, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(4, 5))
    a.grad = torch.full((3, 4), 10.0)
    b.grad = torch.ones(1, 5).expand(4, 5)
    with pytest.raises(ValueError, match=r"gradient of parameter 1 .*strides \(0, 1\)"):
        dmuon.torch.clip_grad_norm_([a, b], 1.0)
    assert torch.equal(a.grad, torch.full((3, 4), 10.0))


# ---- clipping ----

@pytest.mark.parametrize("layout", ["column view", "transposed", "channels_last"])
def test_clip_grad_norm_of_strided_gradients_equals_torchs(layout):
    shape, make = PARAM_LAYOUTS[layout]
    grads = []
    for seed in range(2):
        base, view = strided_copy(5 * randn(shape, seed), make)
        grads.append((base, view, raw_bytes(base)))
    params = [torch.nn.Parameter(torch.zeros(shape)) for _ in grads]
    twins = [torch.nn.Parameter(torch.zeros(shape)) for _ in grads]
    for p, t, (_, view, _) in zip(params, twins, grads):
        p.grad, t.grad = view, view.clone()
    ours = dmuon.torch.clip_grad_norm_(params, 1.0)
    theirs = torch.nn.utils.clip_grad_norm_(twins, 1.0)
    assert torch.allclose(ours.float(), theirs, rtol=1e-6)
    for p, t, (base, view, before) in zip(params, twins, grads):
        assert p.grad is view and torch.allclose(p.grad, t.grad, rtol=1e-6, atol=0)
        mask = outside(base, view)
        assert torch.equal(raw_bytes(base)[mask], before[mask])


# ---- channels_last conv nets (conv_nets.py) ----


@pytest.mark.parametrize("net_class", [ConvNet, PatchEmbedding])
def test_a_channels_last_net_trains_as_the_contiguous_one(net_class):
    weights = []
    for fmt in (torch.contiguous_format, torch.channels_last):
        torch.manual_seed(0)
        net = net_class().to(memory_format=fmt)
        conv = next(m for m in net.modules() if isinstance(m, torch.nn.Conv2d))
        assert conv.weight.is_contiguous(memory_format=fmt) and (fmt is torch.contiguous_format
                                                                 or not conv.weight.is_contiguous())
        initial = [p.detach().clone() for p in net.parameters()]
        opt = DMuon(net, **HYPER)
        for step in range(5):
            x = torch.randn(4, 3, 16, 16, generator=seeded(step)).contiguous(memory_format=fmt)
            y = torch.randint(0, 4, (4,), generator=seeded(100 + step))
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            opt.zero_grad()
        assert conv.weight.is_contiguous(memory_format=fmt)  # the step kept the layout
        assert all(not torch.equal(p, p0) for p, p0 in zip(net.parameters(), initial))  # every parameter trained
        weights.append({n: p.detach().contiguous() for n, p in net.named_parameters()})
    for name, w in weights[0].items():
        assert torch.allclose(weights[1][name], w, rtol=0, atol=CONV_TOLERANCE), name
