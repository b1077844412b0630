"""The torch engine (python/dmuon/torch/torch_engine.py) against libdmuon_c's, one process, on the CPU:
  Newton–Schulz   the torch recurrences against the C ABI's (every coefficient schedule, standard and Gram, wide,
                  tall and square, a Gaussian and an ill-conditioned input) and both against the float64 run of the
                  same recurrence; bfloat16 iterates (standard) against the engine's bfloat16
  DMuon           engine="torch" against engine="dmuon" step by step: 2-D, expert stacks, a conv filter, a row
                  split, Muon's options, clipping; AdamW's parameters bit for bit; a skipped step leaves every
                  tensor bit for bit
  choice          engine="auto" on a device libdmuon_c lacks (its support stubbed off): the torch engine with one
                  warning naming libdmuon_c; engine="dmuon" there names the parameter
  lazy library    a process whose libdmuon_c cannot be loaded imports dmuon.torch and steps with engine torch/auto;
                  the owners it plans then (LPT over flop costs)

Tolerances. Two float32 runs of one recurrence differ only where their products sum in another order: about
√k·u relative per product (k ≤ 80 the inner dimension, u = 2⁻²⁴; 1e-6), three products a step, five steps: 1e-5 for
the standard recurrence, which does not amplify them on these inputs. The Gram recurrence amplifies rounding on
R's small eigenvalues (about ×12 a step, DESIGN 2.2) until a restart; DESIGN 2.2's float32 bound with its restart
at step 2 is 2e-4. Each float32 run must be within that of the float64 run of the same recurrence, and the two
float32 runs within it of each other (measured: standard ≤ 1.3e-6, Gram ≤ 1.6e-4, the ill-conditioned input's).
bfloat16: the engine and torch both round every stored iterate to bfloat16 (u = 2⁻⁸); the float32 accumulations
of different summation order fall on either side of a rounding boundary here and there, so the two differ by a
fraction of u (measured 1.5e-3 … 2.2e-3 < 2⁻⁸ = 3.9e-3, the bound).

Run: PYTHONPATH=build/python python -m pytest -q tests/python/torch_engine_test.py
"""

import copy
import multiprocessing
import os
import sys
import textwrap
import traceback

import pytest
import torch

import dmuon
from dmuon.torch import DMuon
from dmuon.torch.agreement import lpt_owners
from dmuon.torch.muon_options import muon_scale
from dmuon.torch.torch_engine import TorchNewtonSchulz, cpu_ns_default_dtype, newton_schulz, resolve_algo

FLOAT32_LIMIT = {"standard": 1e-5, "gram": 2e-4}
BF16_LIMIT = 2.0 ** -8


def relative(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def engine_newton_schulz(u, coeffs, steps, algo, dtype):
    """libdmuon_c's Newton–Schulz of every matrix of u (K, rows, cols), untuned, iterates of `dtype`."""
    storage = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    out = u.to(storage).clone()
    code = {"float32": dmuon.DTYPE_F32, "bfloat16": dmuon.DTYPE_BF16}[dtype]
    ns = dmuon.Orthogonalizer(coeffs=coeffs, algo=algo, steps=steps, threads=1, tune_cache=None, dtype=dtype)
    ns.run(list(out), list(out), u.shape[1], u.shape[2], dtype=code)
    return out


def gaussian(shape, seed=3):
    return torch.randn((3,) + shape, generator=torch.Generator().manual_seed(seed))


def ill_conditioned(shape, rank=8, seed=4):
    """Rank-8 matrices plus 1e-3 noise: R's small eigenvalues are where Gram's rounding grows (DESIGN 2.2)."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = shape
    return (torch.randn(2, rows, rank, generator=gen) @ torch.randn(2, rank, cols, generator=gen)
            + 1e-3 * torch.randn(2, rows, cols, generator=gen))


SCHEDULES = [("keller", 5), ("you", 5), ("polar-express", 6)]
# The ill-conditioned input is the Gram recurrence's (its restarts' test); on it the standard recurrence amplifies
# rounding in the directions of the tiny singular values (×a a step) beyond the Gaussian inputs' bound.
INPUTS = {"wide": lambda: gaussian((24, 64)), "tall": lambda: gaussian((64, 24)), "square": lambda: gaussian((32, 32)),
          "ill-conditioned": lambda: ill_conditioned((64, 256))}


# Every schedule × recurrence × Gaussian input; the ill-conditioned input with the Gram recurrence at 5 steps, the
# setting of DESIGN 2.2's measurement (one more step after the restart amplifies once more).
CASES = [(coeffs, steps, algo, kind) for coeffs, steps in SCHEDULES for algo in ("standard", "gram")
         for kind in INPUTS if kind != "ill-conditioned"]
CASES += [(coeffs, 5, "gram", "ill-conditioned") for coeffs, _ in SCHEDULES]


@pytest.mark.parametrize("coeffs,steps,algo,kind", CASES)
def test_float32_newton_schulz_equals_the_engines(coeffs, steps, algo, kind):
    u = INPUTS[kind]()
    exact = newton_schulz(u, coeffs, steps, algo, torch.float64)
    ours = newton_schulz(u, coeffs, steps, algo, torch.float32)
    engine = engine_newton_schulz(u, coeffs, steps, algo, "float32")
    limit = FLOAT32_LIMIT[algo]
    assert ours.dtype == torch.float32 and ours.shape == u.shape
    assert relative(engine, exact) < limit, "libdmuon_c runs another recurrence than the torch engine's"
    assert relative(ours, exact) < limit, "the torch engine's float32 rounding"
    assert relative(ours, engine) < limit


def test_a_wrong_restart_schedule_would_be_seen():
    # The comparison above is not blind to the Gram recurrence's restarts: without them the float32 result on the
    # ill-conditioned input leaves the engine's by more than the limit (measured 1.7e-3).
    u = ill_conditioned((64, 256))
    engine = engine_newton_schulz(u, "polar-express", 5, "gram", "float32")
    unrestarted = newton_schulz(u, "polar-express", 5, "gram", torch.float32, restarts=())
    assert relative(unrestarted, engine) > FLOAT32_LIMIT["gram"]


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (20, 30)])
def test_auto_resolves_as_the_engine(shape):
    u = gaussian(shape)
    assert resolve_algo("auto", *shape) == ("gram" if max(shape) >= 2 * min(shape) else "standard")
    limit = FLOAT32_LIMIT[resolve_algo("auto", *shape)]
    assert relative(newton_schulz(u, algo="auto"), engine_newton_schulz(u, "keller", 5, "auto", "float32")) < limit


@pytest.mark.skipif(not dmuon.supports(dmuon.DEVICE_CPU, dmuon.DTYPE_BF16), reason="libdmuon_c without oneDNN")
@pytest.mark.parametrize("coeffs,steps", [("keller", 5), ("polar-express", 6)])
def test_bfloat16_newton_schulz_rounds_as_the_engine(coeffs, steps):
    u = gaussian((48, 128))
    ours = newton_schulz(u.to(torch.bfloat16), coeffs, steps, "standard", torch.bfloat16)
    engine = engine_newton_schulz(u, coeffs, steps, "standard", "bfloat16")
    assert ours.dtype == torch.bfloat16
    assert relative(ours, engine) < BF16_LIMIT


@pytest.mark.parametrize("algo", ["standard", "gram"])
def test_bfloat16_products_never_sum_in_bfloat16(monkeypatch, algo):
    # Our CUDA backend forbids cuBLAS's reduced-precision reductions; torch allows them by default: every product of a
    # bf16 Newton–Schulz runs with torch's flag off, and the caller's setting is back afterwards (and after float32).
    matmul = torch.backends.cuda.matmul
    seen = []
    for name in ("bmm", "baddbmm"):
        product = getattr(torch, name)

        def spy(*args, product=product, **kwargs):
            seen.append((args[0].dtype, matmul.allow_bf16_reduced_precision_reduction))
            return product(*args, **kwargs)
        monkeypatch.setattr(torch, name, spy)
    u = gaussian((16, 64))
    before = matmul.allow_bf16_reduced_precision_reduction  # torch's flag object takes no monkeypatch
    matmul.allow_bf16_reduced_precision_reduction = True
    try:
        newton_schulz(u, algo=algo, dtype=torch.bfloat16)
        assert seen and all(dtype == torch.bfloat16 and not allowed for dtype, allowed in seen), seen
        assert matmul.allow_bf16_reduced_precision_reduction
        seen.clear()
        newton_schulz(u, algo=algo, dtype=torch.float32)
        assert seen and matmul.allow_bf16_reduced_precision_reduction
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before


def test_newton_schulz_time_on_cuda_is_the_devices_between_events_read_after_the_step(monkeypatch):
    # P11: on CUDA the engines' calls only enqueue; last_stats["ns_s"] is the time between events recorded on the
    # current stream around them, read (waiting for the last) when asked. Fake events, as this machine has no GPU.
    from dmuon.torch.ns_clock import NsClock
    log = []

    class FakeEvent:
        def __init__(self, enable_timing):
            assert enable_timing
            self.number = len([e for e in log if e[0] == "new"])
            log.append(("new", self.number))

        def record(self, stream):
            log.append(("record", self.number, stream))

        def synchronize(self):
            log.append(("synchronize", self.number))

        def elapsed_time(self, end):
            return 250.0 * (end.number - self.number)  # milliseconds

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    clock = NsClock()
    for _ in range(2):
        clock.stop(clock.start(torch.device("cuda", 0)))
    assert not any(e[0] == "synchronize" for e in log)  # the step never waits for the device
    assert clock.seconds() == pytest.approx(0.5)
    assert ("record", 0, "stream of cuda:0") in log and ("synchronize", 3) in log
    host = NsClock()
    host.stop(host.start(torch.device("cpu")))
    assert 0 <= host.seconds() < 1


def test_the_cpu_default_dtype_follows_the_machine_unless_forced(monkeypatch):
    """ns_dtype=None on the CPU: bfloat16 where torch sees bf16 matrix units (AMX, faked here both ways; AVX-512 BF16
    alone does not count), float32 elsewhere;
    DMUON_NS_DEFAULT_DTYPE forces either (another value is refused, naming it), libdmuon_c's rule
    (backend_conformance_test's NsDefaultDtype)."""
    cpu = torch.device("cpu")
    default = TorchNewtonSchulz("keller", "auto", 5)
    try:
        for units in (True, False):
            monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
            monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda units=units: units)
            machine = torch.bfloat16 if units else torch.float32
            for forced, want in ((None, machine), ("", machine), ("bf16", torch.bfloat16), ("f32", torch.float32)):
                if forced is None:
                    monkeypatch.delenv("DMUON_NS_DEFAULT_DTYPE", raising=False)
                else:
                    monkeypatch.setenv("DMUON_NS_DEFAULT_DTYPE", forced)
                cpu_ns_default_dtype.cache_clear()
                assert default.compute_dtype(cpu, torch.float32) == want, (units, forced)
                assert TorchNewtonSchulz("keller", "auto", 5, "float32").compute_dtype(cpu, torch.bfloat16) == \
                    torch.float32
            monkeypatch.setenv("DMUON_NS_DEFAULT_DTYPE", "bfloat16")
            cpu_ns_default_dtype.cache_clear()
            with pytest.raises(ValueError, match="DMUON_NS_DEFAULT_DTYPE must be bf16 or f32"):
                default.compute_dtype(cpu, torch.float32)
    finally:
        cpu_ns_default_dtype.cache_clear()  # the next caller reads the real machine and environment


# ---- DMuon with each engine ----

SPECS = {"a.weight": (24, 64), "b.weight": (40, 24), "blocks.0.experts": (2, 16, 40), "conv.weight": (8, 4, 3, 3),
         "q.weight": (32, 16), "norm.weight": (16,)}
STEPS = 4
LR, WD = 0.02, 0.1


def parameters():
    gen = torch.Generator().manual_seed(7)
    return {n: torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.5) for n, shape in SPECS.items()}


def set_grads(params, step, poison=None):
    gen = torch.Generator().manual_seed(100 + step)
    for name, p in params.items():
        p.grad = torch.randn(p.shape, generator=gen)
        if name == poison:
            p.grad[0].fill_(float("nan"))


def build(params, engine, options):
    groups = [{"params": [(n, params[n]) for n in SPECS if n != "q.weight"]},
              {"params": [("q.weight", params["q.weight"])], "split_heads": 4}]  # a row split: 4 heads of 8 rows
    return DMuon(groups, engine=engine, lr=LR, weight_decay=WD, tune_cache=None, balancer="lpt", ns_dtype="float32",
                 **options)


def bound(name, options, step, w):
    """‖W_torch − W_dmuon‖_F after `step` steps of a parameter now `w`: per step lr·s·‖ΔO‖ (‖ΔO‖ ≤ limit·‖O‖_F,
    ‖O‖_F ≤ 1.2·√min(m, n) per matrix: NS leaves singular values in [0.68, 1.13] with Keller's coefficients, near 1
    with the others; a block of a split has its own smaller s) plus a few float32 ulps of W's own arithmetic (the
    rules' lerp and apply, each operation rounded once: 4·eps·‖W‖_F)."""
    shape = SPECS[name]
    experts = name.endswith("experts")
    rows, cols = (shape[1], shape[2]) if experts else (shape[0], torch.Size(shape[1:]).numel())
    count = shape[0] if experts else 1
    s = muon_scale(rows, cols, options.get("scale", "match_rms_adamw")) * options.get("extra_scale_factor", 1.0)
    o_norm = 1.2 * (count * min(rows, cols)) ** 0.5
    return step * (LR * s * FLOAT32_LIMIT["gram"] * o_norm + 4 * torch.finfo(torch.float32).eps * float(w.norm()))


OPTIONS = [dict(), dict(coeffs="you", algo="standard"), dict(coeffs="polar-express", ns_steps=6, algo="gram"),
           dict(scale="unit_rms", extra_scale_factor=0.5, cautious_wd=True), dict(nesterov=False, clip_grad_norm=1.0),
           dict(state_dtype=torch.bfloat16)]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_the_torch_engine_steps_as_libdmuon_c(options):
    ours, theirs = parameters(), parameters()
    opts = build(ours, "torch", options), build(theirs, "dmuon", options)
    assert [o.engine.name for o in opts] == ["torch", "dmuon"]
    for t in range(1, STEPS + 1):
        set_grads(ours, t)
        set_grads(theirs, t)
        for o in opts:
            o.step()
        for n in SPECS:
            if n == "norm.weight":  # AdamW: torch's fused step either way
                assert torch.equal(ours[n], theirs[n])
                continue
            gap = float((ours[n].detach() - theirs[n].detach()).norm())
            assert gap <= bound(n, options, t, theirs[n].detach()), f"{n} at step {t}: {gap:.2e} apart"
    assert not torch.equal(ours["a.weight"], parameters()["a.weight"])
    for n in SPECS:  # the momenta agree too (the same rule, float32)
        m_ours, m_theirs = opts[0].state[ours[n]], opts[1].state[theirs[n]]
        for key in m_ours:
            assert torch.allclose(m_ours[key].float(), m_theirs[key].float(), rtol=1e-5, atol=1e-6), (n, key)


def test_a_skipped_step_leaves_every_tensor_bit_for_bit():
    params = parameters()
    opt = build(params, "torch", dict(nonfinite="skip"))
    set_grads(params, 1)
    opt.step()
    before = {n: p.detach().clone() for n, p in params.items()}
    state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in params.items()}
    set_grads(params, 2, poison="b.weight")
    opt.step()
    assert opt.skipped_steps == 1
    for n, p in params.items():
        assert torch.equal(p.detach(), before[n]), n
        for k, v in opt.state[p].items():
            assert torch.equal(v, state[n][k]), (n, k)


def test_a_copy_of_a_torch_engine_optimizer_steps_as_it():
    params = parameters()
    opt = build(params, "torch", {})
    set_grads(params, 1)
    opt.step()
    twin = copy.deepcopy({"params": params, "opt": opt})
    for t in (2, 3):
        set_grads(params, t)
        set_grads(twin["params"], t)
        opt.step()
        twin["opt"].step()
    assert twin["opt"].engine.name == "torch"
    assert all(torch.equal(params[n], twin["params"][n]) for n in SPECS)


# ---- the choice of engine ----

def test_auto_takes_the_torch_engine_with_one_warning_where_libdmuon_c_lacks_the_device(monkeypatch):
    # As a CUDA machine whose libdmuon_c has no CUDA backend: the library says it supports nothing.
    monkeypatch.setattr(dmuon, "supports", lambda device, dtype: False)
    params = parameters()
    with pytest.warns(UserWarning) as warned:
        opt = build(params, "auto", {})
        opt.add_param_group({"params": [("extra.weight", torch.nn.Parameter(torch.randn(8, 8)))]})
        set_grads(params, 1)
        opt.step()
    messages = [str(w.message) for w in warned if "engine=" in str(w.message)]
    assert len(messages) == 1 and "engine='dmuon'" in messages[0] and "no Newton-Schulz backend" in messages[0]
    assert opt.engine.name == "torch"
    with pytest.raises(ValueError, match=r"parameter 'a\.weight': device cpu: .*no Newton-Schulz backend"):
        build(parameters(), "dmuon", {})


def test_without_libdmuon_c_owners_are_planned_longest_first():
    # costs m²n: 64·64·256 = 1048576 (matrices 1, 3), 32·32·64 = 65536 (0, 4, 5), 16·16·16 = 4096 (2); costliest
    # first, ties in order, each to the least loaded rank (ties: the lower): 1→0, 3→1, 0→0, 4→1, 5→0, 2→1
    shapes = [(32, 64), (64, 256), (16, 16), (256, 64), (64, 32), (32, 64)]
    assert lpt_owners(shapes, 2) == [0, 0, 1, 1, 1, 0]
    assert lpt_owners(shapes, 1) == [0] * 6 and lpt_owners([], 3) == []
    # matrix 1 split in 4 row blocks of 16×256 costs 4·16·16·256 = 262144: 3→0, then every other one to rank 1
    assert lpt_owners(shapes, 2, [None, [(16, 256)] * 4, None, None, None, None]) == [1, 1, 1, 0, 1, 1]


def test_an_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="engine must be one of auto, dmuon, torch; got 'cuda'"):
        build(parameters(), "cuda", {})


def test_without_libdmuon_c_dmuon_torch_imports_and_steps(tmp_path):
    script = textwrap.dedent("""
        import warnings
        import torch
        import dmuon
        import dmuon.torch
        assert "not found" in dmuon.library_error()
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16),
                                  torch.nn.Linear(16, 4))
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            opts = [dmuon.torch.DMuon(net, engine=engine) for engine in ("auto", "torch")]
        assert [o.engine.name for o in opts] == ["torch", "torch"], [o.engine.name for o in opts]
        about = [str(w.message) for w in warned if "engine=" in str(w.message)]
        assert len(about) == 1 and "libdmuon_c" in about[0] and "not found" in about[0], about
        before = net[2].weight.detach().clone()
        for opt in opts:
            net(torch.randn(8, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert not torch.equal(before, net[2].weight) and torch.isfinite(net[2].weight).all()
        try:
            dmuon.torch.DMuon(net, engine="dmuon")
        except ValueError as e:
            assert "engine='dmuon' needs libdmuon_c" in str(e), e
        else:
            raise AssertionError("engine='dmuon' without libdmuon_c")
    """)
    # A forked process (torch stays imported: a fresh interpreter would spend 20 s here importing it) that imports
    # dmuon afresh with DMUON_C_LIBRARY naming no file.
    child = multiprocessing.get_context("fork").Process(target=_run_without_libdmuon_c,
                                                         args=(script, str(tmp_path / "libdmuon_c.so")))
    child.start()
    child.join(240)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0, "the process without libdmuon_c failed (its traceback is above)"


def _run_without_libdmuon_c(script, missing_library):
    os.environ["DMUON_C_LIBRARY"] = missing_library
    for name in [m for m in sys.modules if m == "dmuon" or m.startswith("dmuon.")]:
        del sys.modules[name]
    try:
        exec(script, {})
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)
