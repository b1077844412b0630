"""libdmuon_c through python/dmuon's ctypes layer, single process (pytest; numpy and torch only).

Newton–Schulz against a float64 reference (DESIGN 2.1), in float32 and bfloat16 storage, AdamW against
torch.optim.AdamW (float32) and the float32 rule rounded once (bfloat16), the errors of the C ABI
(unsupported device, host memory for a GPU, bad names, non-finite input), the planner's owners, model
manifests, and the dim-0 chunk arithmetic of dmuon.torch against torch.chunk.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

import dmuon
from dmuon.torch import chunk_rows

KELLER = (3.4445, -4.7750, 2.0315)
MODELS = pathlib.Path(__file__).resolve().parents[2] / "models"


def newton_schulz_ref(u, steps=5):
    x = u.astype(np.float64)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (np.linalg.norm(x) + 1e-7)
    a, b, c = KELLER
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def run(ns, batch, **kwargs):
    out = np.full_like(batch, np.nan)  # poisoned: every element must be written
    ns.run([m.ctypes.data for m in batch], [m.ctypes.data for m in out], batch.shape[1], batch.shape[2], **kwargs)
    return out


def computes_bf16_on_the_cpu():
    """Whether this libdmuon_c computes Newton–Schulz in bfloat16 on the CPU (a build without oneDNN does not, whatever
    the CPU; dmuon.supports speaks of storage types, which the CPU takes both of)."""
    try:
        run(dmuon.Orthogonalizer(threads=1, tune_cache=None, dtype="bfloat16"), np.ones((1, 2, 2), np.float32))
        return True
    except dmuon.DmuonError:
        return False


@pytest.mark.parametrize("algo", ["standard", "gram", "auto"])
@pytest.mark.parametrize("shape", [(24, 64), (64, 24), (32, 32)])
def test_orthogonalize_matches_float64_reference(algo, shape):
    rng = np.random.default_rng(3)
    batch = rng.standard_normal((3,) + shape).astype(np.float32)
    out = run(dmuon.Orthogonalizer(algo=algo, threads=1, tune_cache=None, dtype="float32"), batch)
    for u, o in zip(batch, out):
        ref = newton_schulz_ref(u)
        # float32 NS: ~1e-6 per step; Gram with its restart within 2e-4 of standard (DESIGN 2.2)
        assert np.linalg.norm(o - ref) / np.linalg.norm(ref) < (2e-4 if algo != "standard" else 1e-5)


def test_in_place_equals_out_of_place():
    batch = np.random.default_rng(4).standard_normal((2, 16, 40)).astype(np.float32)
    ns = dmuon.Orthogonalizer(threads=1, tune_cache=None)
    out = run(ns, batch)
    ns.run([m.ctypes.data for m in batch], [m.ctypes.data for m in batch], 16, 40)
    assert np.array_equal(out, batch)


def cuda_refusal():
    """What a call with device cuda and host pointers raises: no CUDA backend or device here, or, where there
    is one, the error naming the first pointer that is not device memory."""
    if dmuon.supports(dmuon.DEVICE_CUDA, dmuon.DTYPE_F32):
        return pytest.raises(dmuon.DmuonError, match=r"\[0\] is not CUDA device memory|p is not CUDA device")
    return pytest.raises(dmuon.UnsupportedError, match="device cuda")


def test_unsupported_device_and_bad_stream_are_named():
    batch = np.ones((1, 4, 8), np.float32)
    ns = dmuon.Orthogonalizer(threads=1, tune_cache=None)
    assert dmuon.supports(dmuon.DEVICE_CPU, dmuon.DTYPE_F32) and dmuon.supports(dmuon.DEVICE_CPU, dmuon.DTYPE_BF16)
    assert dmuon.supports(dmuon.DEVICE_CUDA, dmuon.DTYPE_F32) == dmuon.supports(dmuon.DEVICE_CUDA, dmuon.DTYPE_BF16)
    assert not dmuon.supports(7, dmuon.DTYPE_F32) and not dmuon.supports(dmuon.DEVICE_CPU, 5)
    with cuda_refusal():
        run(ns, batch, device=dmuon.DEVICE_CUDA, stream=None)
    with pytest.raises(dmuon.DmuonError, match="stream must be NULL"):
        run(ns, batch, stream=1234)
    with pytest.raises(dmuon.DmuonError, match="unknown dtype code 5"):
        run(ns, batch, dtype=5)


def bf16_stack(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def run_bf16_in_place(ns, stack, **kwargs):
    """As dmuon.torch calls it: pointers into one contiguous (k, rows, cols) bfloat16 stack, in place."""
    k, rows, cols = stack.shape
    step = rows * cols * stack.element_size()
    ptrs = [stack.data_ptr() + j * step for j in range(k)]
    ns.run(ptrs, ptrs, rows, cols, dtype=dmuon.DTYPE_BF16, **kwargs)


@pytest.mark.parametrize("algo", ["standard", "gram"])
@pytest.mark.parametrize("shape", [(24, 64), (64, 24), (48, 48)])
def test_bfloat16_orthogonalize_is_within_its_bound_of_float64(algo, shape):
    """bf16 storage on the CPU: widened exactly, float32 Newton–Schulz, rounded once. Against the float64
    recurrence on the same bf16 values (exact in float64), the error is the final rounding, at most 2^-8
    relative per element (8 significant bits), plus the float32 engine's eps (1e-5 standard, 2e-4 Gram, as
    above): ||bf16(y) - ref|| <= 2^-8 ||y|| + eps ||ref|| <= (2^-8 (1 + eps) + eps) ||ref||. And bit for bit
    it is the float32 engine on the widened values, rounded to bf16 as torch rounds (nearest even)."""
    stack = bf16_stack((3,) + shape, 8)
    wide = stack.float().numpy()
    ns = dmuon.Orthogonalizer(algo=algo, threads=1, tune_cache=None, dtype="float32")  # storage is not compute dtype
    out = stack.clone()
    run_bf16_in_place(ns, out, names=["a", "b", "c"])
    f32 = torch.from_numpy(run(ns, wide))
    assert torch.equal(out, f32.bfloat16())
    eps = 1e-5 if algo == "standard" else 2e-4
    bound = 2.0 ** -8 * (1 + eps) + eps
    for u, o in zip(wide, out.double().numpy()):
        ref = newton_schulz_ref(u)
        err = np.linalg.norm(o - ref) / np.linalg.norm(ref)
        assert 0.05 * bound < err <= bound, f"{err:.3e} against the bound {bound:.3e}"


def test_bfloat16_compute_is_asked_for_and_differs_from_float32():
    """dtype="bfloat16" on float32 data: bf16 iterates (float32 accumulation), within the 5-step gross bound 5e-2 of
    float64 (tests/ns/ns_bf16_emulation_test.cpp derives it) and not the float32 result (the iterates' rounding,
    above 1e-3); the C++ tests hold it sharply to the bf16-emulated recurrence."""
    batch = np.random.default_rng(5).standard_normal((2, 24, 64)).astype(np.float32)
    f32 = run(dmuon.Orthogonalizer(algo="standard", threads=1, tune_cache=None, dtype="float32"), batch)
    try:
        bf16 = run(dmuon.Orthogonalizer(algo="standard", threads=1, tune_cache=None, dtype="bfloat16"), batch)
    except dmuon.DmuonError as e:
        if "not supported" not in str(e):
            raise
        pytest.skip(f"this build's CPU computes in float32 only (no oneDNN): {e}")
    for u, a, b in zip(batch, f32, bf16):
        ref = newton_schulz_ref(u)
        assert np.linalg.norm(b - ref) / np.linalg.norm(ref) < 5e-2
        assert np.linalg.norm(b - a) / np.linalg.norm(a) > 1e-3


# A process of its own (the C ABI reads DMUON_NS_DEFAULT_DTYPE once per process): libdmuon_c without torch.
DEFAULT_DTYPE_RUN = """
import sys
import numpy as np
import dmuon
batch = np.load(sys.argv[1])
out = np.full_like(batch, np.nan)
dmuon.Orthogonalizer(algo="standard", threads=1, tune_cache=None).run([m.ctypes.data for m in batch],
                                                                      [m.ctypes.data for m in out], *batch.shape[1:])
np.save(sys.argv[2], out)
"""


def test_the_default_compute_dtype_is_the_cpus_and_the_environment_forces_it(tmp_path):
    """dtype=None: libdmuon_c's CPU default (bfloat16 with bf16 matrix units, float32 elsewhere: the rule, with the machine
    faked, is backend_conformance_test's), which DMUON_NS_DEFAULT_DTYPE forces either way: each forced process's
    output is the forced dtype's bit for bit; this process's is the one its environment forces, else one of them."""
    if not computes_bf16_on_the_cpu():
        pytest.skip("this build's CPU computes in float32 only (no oneDNN)")
    batch = np.random.default_rng(6).standard_normal((2, 24, 64)).astype(np.float32)
    np.save(tmp_path / "in.npy", batch)
    explicit = {dtype: run(dmuon.Orthogonalizer(algo="standard", threads=1, tune_cache=None, dtype=dtype), batch)
                for dtype in ("float32", "bfloat16")}
    assert not np.array_equal(explicit["float32"], explicit["bfloat16"])
    names = {"f32": "float32", "bf16": "bfloat16"}
    for forced, dtype in names.items():
        env = dict(os.environ, DMUON_NS_DEFAULT_DTYPE=forced)
        subprocess.run([sys.executable, "-c", DEFAULT_DTYPE_RUN, tmp_path / "in.npy", tmp_path / "out.npy"], env=env,
                       check=True)
        assert np.array_equal(np.load(tmp_path / "out.npy"), explicit[dtype]), forced
    own = run(dmuon.Orthogonalizer(algo="standard", threads=1, tune_cache=None), batch)
    forced = os.environ.get("DMUON_NS_DEFAULT_DTYPE")
    assert any(np.array_equal(own, explicit[names[f]]) for f in ([forced] if forced else names))


def test_compute_dtype_must_be_named():
    with pytest.raises(ValueError, match="dtype"):
        dmuon.Orthogonalizer(dtype="float16")


def test_bfloat16_non_finite_input_is_named():
    stack = bf16_stack((2, 8, 16), 9)
    stack[1, 3, 4] = float("nan")
    with pytest.raises(dmuon.DmuonError, match="'w1'.*row 3, column 4"):
        run_bf16_in_place(dmuon.Orthogonalizer(threads=1, tune_cache=None), stack, names=["w0", "w1"])


def test_bad_arguments_and_non_finite_input():
    with pytest.raises(dmuon.DmuonError, match="steps"):
        dmuon.Orthogonalizer(steps=0)
    with pytest.raises(dmuon.DmuonError, match="coeffs|keller"):
        dmuon.Orthogonalizer(coeffs="nope")
    batch = np.ones((1, 4, 8), np.float32)
    batch[0, 1, 2] = np.inf
    with pytest.raises(dmuon.DmuonError, match="layer7"):
        run(dmuon.Orthogonalizer(threads=1, tune_cache=None), batch, names=["layer7"])


def test_without_the_finite_check_a_non_finite_input_gives_non_finite_outputs_and_finite_ones_are_unchanged():
    batch = np.random.default_rng(4).standard_normal((2, 8, 16)).astype(np.float32)
    checked = run(dmuon.Orthogonalizer(threads=1, tune_cache=None), batch)
    unchecked_ns = dmuon.Orthogonalizer(threads=1, tune_cache=None, check_finite=False)
    assert np.array_equal(run(unchecked_ns, batch), checked)
    batch[1, 3, 4] = np.nan
    out = run(unchecked_ns, batch, names=["w0", "w1"])
    assert np.array_equal(out[0], checked[0]) and np.isnan(out[1]).all()


@pytest.mark.parametrize("weight_decay,grad_scale", [(0.0, 1.0), (0.1, 0.5)])
def test_adamw_step_matches_torch_adamw(weight_decay, grad_scale):
    gen = torch.Generator().manual_seed(6)
    p0 = torch.randn(1000, generator=gen)
    ours, theirs = p0.clone(), torch.nn.Parameter(p0.clone())
    m, v = torch.zeros(1000), torch.zeros(1000)
    opt = torch.optim.AdamW([theirs], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    for step in range(1, 6):
        g = torch.randn(1000, generator=gen)
        dmuon.adamw_step(ours.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 1000, step, 1e-2, (0.9, 0.95),
                         1e-8, weight_decay, grad_scale)
        theirs.grad = g * grad_scale
        opt.step()
    # the same float32 rule, rounded as torch does: equal to a few ulps
    torch.testing.assert_close(ours, theirs.detach(), rtol=4e-7, atol=1e-8)
    with cuda_refusal():
        dmuon.adamw_step(ours.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 1000, 6, 1e-2, (0.9, 0.95),
                         1e-8, 0.0, device=dmuon.DEVICE_CUDA)


def test_bfloat16_adamw_step_is_the_float32_step_rounded_once():
    """bf16 p, grad, exp_avg, exp_avg_sq: widened, the float32 step (above: torch.optim.AdamW's), and p and
    both moments rounded back once; 3 steps, so the moments start from rounded values too."""
    n = 70000  # more than one of the CPU's staged passes (2^16 values)
    gen = torch.Generator().manual_seed(10)
    p = torch.randn(n, generator=gen).bfloat16()
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    for step in range(1, 4):
        g = (torch.randn(n, generator=gen) * 1e-2).bfloat16()
        want = [x.float() for x in (p, g, m, v)]
        dmuon.adamw_step(*[x.data_ptr() for x in want], n, step, 1e-2, (0.9, 0.95), 1e-8, 0.1, 0.5)
        dmuon.adamw_step(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), n, step, 1e-2, (0.9, 0.95), 1e-8,
                         0.1, 0.5, dtype=dmuon.DTYPE_BF16)
        for name, got, w in (("p", p, want[0]), ("exp_avg", m, want[2]), ("exp_avg_sq", v, want[3])):
            assert torch.equal(got, w.bfloat16()), f"step {step}: {name}"
    with pytest.raises(dmuon.DmuonError, match="step must be >= 1"):
        dmuon.adamw_step(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), n, 0, 1e-2, (0.9, 0.95), 1e-8,
                         0.1, dtype=dmuon.DTYPE_BF16)


def test_plan_owners():
    shapes = [(896, 4864)] * 4 + [(128, 896)] * 2
    rr, tuned = dmuon.plan_owners(shapes, 3, balancer="rr", costs="flop")
    assert not tuned and len(rr) == 6 and set(rr) <= {0, 1, 2}
    for balancer in ("lpt", "milp"):
        owners, _ = dmuon.plan_owners(shapes, 2, balancer=balancer, costs="flop")
        big = [owners[i] for i in range(4)]
        assert big.count(0) == 2 and big.count(1) == 2  # the four equal big matrices split evenly
    assert dmuon.plan_owners([], 4, costs="flop")[0] == []
    with pytest.raises(dmuon.DmuonError, match="balancer|rr"):
        dmuon.plan_owners(shapes, 2, balancer="greedy")
    with pytest.raises(dmuon.DmuonError, match="tuned"):
        dmuon.plan_owners(shapes, 2, costs="tuned", tune_cache=None)


def test_plan_owners_costs_split_matrices_as_their_blocks():
    # lpt over flops on 2 ranks, one 896×896 and ten 128×896: whole, the big one (896³) outweighs the ten
    # (128²·896 each) together, so it is alone on rank 0; split in 14 heads of 64×896 (14·64²·896) it is worth 3.5
    # small ones, so ranks 0 and 1 take the small ones in turn from the fifth on
    shapes = [(896, 896)] + [(128, 896)] * 10
    heads = [[(64, 896)] * 14] + [None] * 10
    assert dmuon.plan_owners(shapes, 2, balancer="lpt", costs="flop")[0] == [0] + [1] * 10
    assert dmuon.plan_owners(shapes, 2, balancer="lpt", costs="flop", blocks=heads)[0] == [0, 1, 1, 1, 1, 0, 1, 0, 1,
                                                                                            0, 1]
    assert dmuon.plan_owners(shapes, 2, balancer="lpt", costs="flop", blocks=[None] * 11)[0] == [0] + [1] * 10
    with pytest.raises(dmuon.DmuonError, match=r"dmuon_plan_owners_blocks: matrix 0 \(896x896, 802816 elements\) "
                                               r"has blocks of 57344 elements"):
        dmuon.plan_owners(shapes, 2, costs="flop", blocks=[[(64, 896)]] + [None] * 10)
    with pytest.raises(ValueError, match="blocks has 1 entries for 11 matrices"):
        dmuon.plan_owners(shapes, 2, costs="flop", blocks=[None])


def test_a_file_that_is_not_a_tuning_cache_is_refused_and_kept(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a cache\n")
    with pytest.raises(dmuon.DmuonError, match=r"not a dmuon tuning cache; refusing to replace it \(name another "
                                               r"file with tune_cache\)"):
        dmuon.tune([(16, 40, 1)], threads=1, rounds=1, tune_cache=str(notes))
    assert notes.read_text() == "not a cache\n"


def test_tuned_cache_is_used_by_ns_and_planner(tmp_path):
    """dmuon.tune, a handle that asks for no dtype and the planner all use one setting: where the CPU has bf16
    instructions that oneDNN uses (dmuon.tuning_chooses_dtype) bfloat16 and float32 both timed and each shape's faster
    kept, else float32 alone (a build without oneDNN: float32). The tuned kernel is within the bound of the dtype the
    cache names for the shape (float32: 2e-4, the Gram restart's; bfloat16: 5e-2 after 5 steps,
    ns_bf16_emulation_test)."""
    cache = str(tmp_path / "tune.json")
    dmuon.tune([(16, 40, 2)], threads=1, rounds=1, tune_cache=cache)
    setting, = json.loads(pathlib.Path(cache).read_text())["settings"]
    auto = dmuon.tuning_chooses_dtype()
    assert not auto or computes_bf16_on_the_cpu()
    assert setting["key"]["dtype"] == ("bfloat16 or float32" if auto else "float32")
    entry, = setting["entries"]
    assert entry["dtype"] in (("bfloat16", "float32") if auto else ("float32",))
    bound = 5e-2 if entry["dtype"] == "bfloat16" else 2e-4
    ns = dmuon.Orthogonalizer(threads=1, tune_cache=cache)
    assert ns.tuned_entries == 1 and ns.warning == ""
    batch = np.random.default_rng(5).standard_normal((2, 16, 40)).astype(np.float32)
    for u, o in zip(batch, run(ns, batch)):
        ref = newton_schulz_ref(u)
        assert np.linalg.norm(o - ref) / np.linalg.norm(ref) < bound
    owners, tuned = dmuon.plan_owners([(16, 40)] * 4, 2, balancer="lpt", costs="tuned", tune_cache=cache)
    assert tuned and sorted(owners) == [0, 0, 1, 1]
    with pytest.raises(dmuon.DmuonError, match="64"):  # a shape the cache lacks
        dmuon.plan_owners([(64, 64)], 2, costs="tuned", tune_cache=cache)
    with pytest.raises(dmuon.DmuonError, match="no tuned time for shape 8x40 batch 4"):  # a block shape it lacks
        dmuon.plan_owners([(16, 40)] * 4, 2, costs="tuned", tune_cache=cache, blocks=[[(8, 40)] * 2] * 4)
    assert dmuon.plan_owners([(64, 64)], 2, costs="auto", tune_cache=cache) == ([0], False)


def test_the_cache_chooses_the_dtype_of_a_handle_that_asks_for_none(tmp_path):
    """Deterministic given the cache: the entry dmuon.tune wrote, rewritten to name each dtype its setting was timed in
    (bfloat16 and float32 with bf16 matrix units, else float32 alone), makes a handle that asks for no dtype run bit for bit
    as that dtype chosen explicitly with the same kernel (Gram, restarts [1, 3] in bfloat16 and [2] in float32, 8
    tiles); a handle that asks for the other dtype keeps it, cache or not. call_dtype says so beforehand: the entry's
    dtype, tuned, for the cached shape; the untuned default's for a shape the cache lacks; an asked dtype always."""
    cache = tmp_path / "tune.json"
    dmuon.tune([(16, 40, 2)], threads=1, rounds=1, tune_cache=str(cache))
    text = json.loads(cache.read_text())
    setting, = text["settings"]
    dtypes = setting["key"]["dtype"].split(" or ")
    batch = np.random.default_rng(8).standard_normal((2, 16, 40)).astype(np.float32)
    results = {}
    for dtype in dtypes:
        setting["entries"][0].update(algo="gram", restarts=[1, 3] if dtype == "bfloat16" else [2], symmetric=True,
                                     tiles=8, batch_mode="sequential", threads=1, dtype=dtype)
        cache.write_text(json.dumps(text))
        unasked = dmuon.Orthogonalizer(threads=1, tune_cache=str(cache))
        assert unasked.call_dtype(16, 40, 2) == (dtype, True)
        assert unasked.call_dtype(16, 40, 3) == (dtype, True)  # the nearest batch's entry
        assert unasked.call_dtype(8, 40, 2) == (dmuon.Orthogonalizer(threads=1, tune_cache=None).call_dtype(8, 40, 2)[0],
                                                 False)
        results[dtype] = run(unasked, batch)
        explicit = run(dmuon.Orthogonalizer(algo="gram", threads=1, tune_cache=None, dtype=dtype), batch)
        assert np.array_equal(results[dtype], explicit), dtype
        for other in set(dtypes) - {dtype}:
            asking = dmuon.Orthogonalizer(threads=1, tune_cache=str(cache), dtype=other)
            assert asking.call_dtype(16, 40, 2)[0] == other
            asked = run(asking, batch)
            assert np.array_equal(asked, run(dmuon.Orthogonalizer(threads=1, tune_cache=None, dtype=other), batch))
    if len(dtypes) == 2:
        assert not np.array_equal(results["float32"], results["bfloat16"])  # the dtype really changed what ran


def test_model_params():
    params = dmuon.model_params(str(MODELS / "qwen2.5-0.5b.json"), layers=1)
    by_name = {p["name"]: p for p in params}
    assert by_name["model.layers.0.mlp.up_proj.weight"]["shape"] == [4864, 896]
    assert by_name["model.layers.0.mlp.up_proj.weight"]["role"] == "matrix"
    assert by_name["model.embed_tokens.weight"]["role"] == "elementwise"
    with pytest.raises(dmuon.DmuonError, match="no-such-model"):
        dmuon.model_params("no-such-model")


@pytest.mark.parametrize("rows", [0, 1, 3, 7, 8, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_chunk_rows_is_torch_chunk(rows, world):
    chunks = torch.chunk(torch.arange(rows), world) if rows else ()
    expected = [(int(c[0]), len(c)) if len(c) else None for c in chunks]
    got = chunk_rows(rows, world)
    assert len(got) == world
    for r, (start, count) in enumerate(got):
        if r < len(expected):
            assert (start, count) == expected[r]
        else:
            assert count == 0  # torch.chunk made fewer chunks: the rest of the ranks hold nothing


def test_openblas_runs_the_cpus_kernels_unless_the_environment_names_a_core():
    """Loading libdmuon_c on a CPU with AVX-512 makes OpenBLAS run its SkylakeX kernels (on a model it does not know
    it would fall back to its generic ones); a core the environment names is kept. In a fresh process each: OpenBLAS
    chooses when it loads."""
    script = ("import ctypes, dmuon._capi as c; c.library(); blas = ctypes.CDLL('libopenblas.so.0'); "
              "blas.openblas_get_corename.restype = ctypes.c_char_p; print(blas.openblas_get_corename().decode())")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}

    def core(extra):
        run = subprocess.run([sys.executable, "-c", script], env={**env, **extra}, capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip().lower()

    from dmuon._capi import _cpu_has_avx512
    if _cpu_has_avx512():
        assert core({}) in ("skylakex", "cooperlake", "sapphirerapids")
    assert core({"OPENBLAS_CORETYPE": "Prescott"}) == "prescott"
