"""The C ABI's Muon update calls (dmuon_muon_momentum, dmuon_muon_apply, dmuon_muon_update) through
python/dmuon's ctypes layer, single process (pytest; torch only).

Against float32 torch ops, one rounding per operation in the rule's order (torch.lerp's formula, spelled
out: torch's vectorized lerp may fuse a multiply-add; then W·decay + (−lr)·(O·s), each constant rounded
once to float32): bit for bit. The step values read on the device: keep = 0 leaves
momentum and weights bit for bit (U = M), a clipping factor given by address equals the same factor
applied to the gradient first; a NULL gradient is a zero one; bfloat16 operands are the float32 rule on
their widened values rounded once; the whole update equals momentum → Newton–Schulz → apply called one
by one; errors name the argument.
"""

import pytest
import torch

import dmuon

F32, BF16 = dmuon.DTYPE_F32, dmuon.DTYPE_BF16
CODE = {torch.float32: F32, torch.bfloat16: BF16}


def op(t):
    return (None, F32) if t is None else (t.data_ptr(), CODE[t.dtype])


def randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def f32(x):
    """x rounded once to a float32 constant."""
    return torch.tensor(x, dtype=torch.float32)


def lerp(a, b, w):
    """torch.lerp(a, b, w) for a float32 weight w: a + w·(b − a) for w < 0.5, else b − (b − a)·(1 − w)."""
    return a + w * (b - a) if w < 0.5 else b - (b - a) * (1 - w)


def momentum_ref(m, g, beta, nesterov, scale=None):
    """The rule in float32 torch ops: returns (M', U)."""
    g = torch.zeros_like(m.float()) if g is None else g.float()
    if scale is not None:
        g = g * f32(scale)
    m = lerp(m.float(), g, f32(1.0 - beta))
    return m, (lerp(g, m, f32(beta)) if nesterov else m.clone())


def apply_ref(w, o, lr, wd, s, cautious_wd=False):
    """MuonApply in float32; cautious_wd: the decay only where W·O ≥ 0."""
    w, o = w.float(), o.float()
    decayed = w * f32(1.0 - lr * wd)
    if cautious_wd:
        decayed = torch.where(w * o >= 0, decayed, w)
    return decayed + f32(-lr) * (o * f32(s))


def call_momentum(ms, gs, us, beta, nesterov, keep=None, grad_scale=None):
    dmuon.muon_momentum([m.numel() for m in ms], [op(g) for g in gs], [op(m) for m in ms], [op(u) for u in us],
                        None if keep is None else [k.data_ptr() for k in keep],
                        None if grad_scale is None else grad_scale.data_ptr(), beta, nesterov)


@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_is_torch_lerp_bit_for_bit(nesterov):
    ms = [randn(300, seed=1), randn(7, 5, seed=2), randn(1, seed=3)]
    gs = [randn(300, seed=4), None, randn(1, seed=5)]
    want = [momentum_ref(m, g, 0.95, nesterov) for m, g in zip(ms, gs)]
    us = [torch.full_like(m, float("nan")) for m in ms]  # poisoned: every element must be written
    call_momentum(ms, gs, us, 0.95, nesterov)
    for i, (m, u) in enumerate(zip(ms, us)):
        assert torch.equal(m, want[i][0]), f"M of tensor {i}"
        assert torch.equal(u, want[i][1]), f"U of tensor {i}"


def test_keep_and_the_device_grad_scale():
    ms = [randn(64, seed=6), randn(64, seed=7)]
    before = [m.clone() for m in ms]
    gs = [randn(64, seed=8), torch.full((64,), float("nan"))]  # a kept and a dropped (non-finite) gradient
    keep = [torch.tensor(1.0), torch.tensor(0.0)]
    us = [torch.empty(64), torch.empty(64)]
    call_momentum(ms, gs, us, 0.9, True, keep=keep, grad_scale=torch.tensor(0.25))
    m0, u0 = momentum_ref(before[0], gs[0], 0.9, True, scale=0.25)
    assert torch.equal(ms[0], m0) and torch.equal(us[0], u0)
    assert torch.equal(ms[1], before[1]) and torch.equal(us[1], before[1])  # kept out: M bit for bit, U = M


def test_u_may_be_the_gradient():
    m, g = randn(50, seed=9), randn(50, seed=10)
    want = momentum_ref(m, g, 0.95, True)
    call_momentum([m], [g], [g], 0.95, True)
    assert torch.equal(m, want[0]) and torch.equal(g, want[1])


def test_bfloat16_operands_are_the_float32_rule_rounded_once():
    m, g = randn(1000, seed=11, dtype=torch.bfloat16), randn(1000, seed=12, dtype=torch.bfloat16)
    wide_m, wide_u = momentum_ref(m, g, 0.95, True)
    u = torch.empty(1000, dtype=torch.bfloat16)
    call_momentum([m], [g], [u], 0.95, True)
    assert torch.equal(m, wide_m.bfloat16()) and torch.equal(u, wide_u.bfloat16())


@pytest.mark.parametrize("cautious_wd", [False, True])
def test_apply_bit_for_bit_with_keep_and_bfloat16_weights(cautious_wd):
    ws = [randn(40, seed=13), randn(40, seed=14), randn(40, seed=15, dtype=torch.bfloat16)]
    os_ = [randn(40, seed=16), randn(40, seed=17), randn(40, seed=18)]
    before = [w.clone() for w in ws]
    keep = [torch.tensor(1.0), torch.tensor(0.0), torch.tensor(1.0)]
    scales = [0.2 * 64 ** 0.5, 1.5, 0.7]
    dmuon.muon_apply([40] * 3, [op(w) for w in ws], [op(o) for o in os_], [k.data_ptr() for k in keep], 0.02, 0.1,
                     scales, cautious_wd)
    assert torch.equal(ws[0], apply_ref(before[0], os_[0], 0.02, 0.1, scales[0], cautious_wd))
    assert torch.equal(ws[1], before[1])
    assert torch.equal(ws[2], apply_ref(before[2], os_[2], 0.02, 0.1, scales[2], cautious_wd).bfloat16())
    assert not torch.equal(ws[0], apply_ref(before[0], os_[0], 0.02, 0.1, scales[0], not cautious_wd))


# (gradient, momentum, weight) dtypes: float32; bfloat16 state of float32 parameters (the momentum's staging slot
# alone); bfloat16 parameters with float32 state; bfloat16 everything
DTYPES = [(torch.float32,) * 3, (torch.float32, torch.bfloat16, torch.float32),
          (torch.bfloat16, torch.float32, torch.bfloat16), (torch.bfloat16,) * 3]


@pytest.mark.parametrize("cautious_wd", [False, True])
@pytest.mark.parametrize("dtypes", DTYPES)
def test_whole_update_equals_its_three_parts(cautious_wd, dtypes):
    g_dtype, m_dtype, w_dtype = dtypes
    rows, cols, beta, lr, wd, s = 24, 40, 0.95, 0.02, 0.1, 0.2 * 40 ** 0.5
    ws = [randn(rows, cols, seed=20 + i, dtype=w_dtype) for i in range(3)]
    ms = [randn(rows, cols, seed=30 + i, dtype=m_dtype) for i in range(3)]
    gs = [randn(rows, cols, seed=40, dtype=g_dtype), None, randn(rows, cols, seed=42, dtype=g_dtype)]
    keep = [torch.tensor(1.0), torch.tensor(1.0), torch.tensor(0.0)]
    scale = torch.tensor(0.5)
    ns = dmuon.Orthogonalizer(algo="gram", threads=1, tune_cache=None, check_finite=False)
    # the parts, one by one
    ws2, ms2 = [w.clone() for w in ws], [m.clone() for m in ms]
    us = [torch.empty(rows, cols) for _ in range(3)]
    call_momentum(ms2, gs, us, beta, True, keep=keep, grad_scale=scale)
    ns.run([u.data_ptr() for u in us], [u.data_ptr() for u in us], rows, cols)
    dmuon.muon_apply([rows * cols] * 3, [op(w) for w in ws2], [op(u) for u in us], [k.data_ptr() for k in keep],
                     lr, wd, [s] * 3, cautious_wd)
    # the whole, one call
    ns.muon_update([op(g) for g in gs], [op(m) for m in ms], [op(w) for w in ws], rows, cols,
                   [k.data_ptr() for k in keep], scale.data_ptr(), beta, True, lr, wd, s, cautious_wd)
    for i in range(3):
        assert torch.equal(ws[i], ws2[i]), f"W of matrix {i}"
        assert torch.equal(ms[i], ms2[i]), f"M of matrix {i}"
    assert not torch.equal(ws[0], randn(rows, cols, seed=20, dtype=w_dtype))  # it did update


def test_whole_update_with_the_finite_check_names_the_matrix():
    ns = dmuon.Orthogonalizer(threads=1, tune_cache=None)  # check_finite on
    w, m, g = torch.zeros(8, 8), torch.zeros(8, 8), torch.full((8, 8), float("inf"))
    with pytest.raises(dmuon.DmuonError, match="layers.0.w"):
        ns.muon_update([op(g)], [op(m)], [op(w)], 8, 8, None, None, 0.95, True, 0.02, 0.0, 1.0,
                       names=["layers.0.w"])


def test_bad_arguments_are_named():
    m = torch.zeros(4)
    with pytest.raises(dmuon.DmuonError, match=r"keep\[0\] is NULL"):
        dmuon.muon_momentum([4], [op(None)], [op(m)], [op(m)], [None], None, 0.9, True)
    with pytest.raises(dmuon.DmuonError, match=r"sizes\[0\] is -1"):
        dmuon.muon_apply([-1], [op(m)], [op(m)], None, 0.1, 0.0, [1.0])
    with pytest.raises(dmuon.DmuonError, match="unknown dtype code 7"):
        dmuon.muon_apply([4], [(m.data_ptr(), 7)], [op(m)], None, 0.1, 0.0, [1.0])
    with pytest.raises(dmuon.DmuonError, match=r"momenta\[0\] is NULL"):
        dmuon.muon_momentum([4], [op(None)], [op(None)], [op(m)], None, None, 0.9, True)
    with pytest.raises(dmuon.DmuonError, match=r"beta must be in \[0, 1\)"):
        dmuon.muon_momentum([4], [op(None)], [op(m)], [op(m)], None, None, 1.0, True)
    with pytest.raises(dmuon.UnsupportedError, match="cuda"):
        dmuon.muon_apply([4], [op(m)], [op(m)], None, 0.1, 0.0, [1.0], device=dmuon.DEVICE_CUDA, stream=None)
