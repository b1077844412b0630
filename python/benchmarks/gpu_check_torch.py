"""dmuon.torch on a CUDA machine (the H200 of GPU.md, torch 2.11 with DTensor and FSDP2), one process; run first by
scripts/gpu-check.sh in every mode (--strict), with the libdmuon_c of its build (the lean GPU-only build has the CUDA
backend and maybe no CPU one) or, where nothing was built, the torch engine alone:

  fsdp2-cpu        the project's GPT (examples/torch_train.py) wrapped with fully_shard (FSDP2, gloo, CPU tensors)
                   trains with DMuon: its parameters are DTensors with Shard(0), found from their placements, and the
                   loss falls; and DMuon on the FSDP2 model equals DMuon on a plain copy (same math)
  fsdp2-cuda       the same on the GPU (NCCL, world size 1): CUDA tensors through the C ABI to the CUDA backend, in
                   torch's current stream order
  owner-held-cuda  the same with DMuon's owner-held mode (dmuon.torch.hold_on_owners: matrices held whole, kept out
                   of FSDP2)
  cuda-vs-cpu      5 DMuon steps on CUDA tensors, with each engine (ours through the C ABI, and the torch engine) and
                   Newton–Schulz in float32 and in bf16, against the same steps on CPU tensors in float32 (libdmuon_c's
                   CPU backend, or the torch engine where this libdmuon_c has none): float32 within 1e-4 relative per
                   tensor (the engines' rounding differences), bf16 within 3e-2 (bf16 Newton–Schulz is 1e-2 … 2.2e-2
                   off float64, GPU.md, and 5 steps of it 5e-3 … 1.4e-2 off float32's: a bound of 1e-2 fails correct
                   code; the torch engine's on this CPU: 6.5e-3)
  step-time        one optimizer step on qwen2.5-0.5b's Muon matrices (all 24 layers, muon_step_torch.py's
                   list) on the GPU: dmuon.torch.DMuon against torch.optim.Muon; CUDA events, median
  torch-engine     the torch engine (dmuon/torch/torch_engine.py, DMuon(engine="torch")) against our CUDA engine:
                   Newton–Schulz of random matrices (896x4864, 4864x896, 2048x2048, a batch of 28 x 128x512),
                   standard and Gram, each against the float64 run of the same recurrence (torch_engine_test.py's
                   tolerance scaled to the inner dimension n: 15·√n·u in float32, u = 2^-24, twenty times that for
                   Gram's rounding growth; bf16: within 5e-2, twice GPU.md's 2.2e-2 band of correct bf16 NS, where a
                   wrong coefficient, step or normalisation is off by 1e-1 and more) and each other; its bf16 time
                   beside ours (CUDA events, median of 5); and DMuon's 5 steps with each engine on CUDA tensors
                   (within 1e-2, as cuda-vs-cpu's bf16). Outputs poisoned with NaN first; TF32 off.
  recipe           the 2026 Muon recipe on the GPU (issue 42): per-head Newton–Schulz (split_heads on a q-like and an
                   o-like matrix, split_sizes on a fused qkv), NorMuon, cautious weight decay, the spectral scale and
                   QK-clip with a tau low enough to fire, 5 DMuon steps on CUDA tensors with each engine (ours, torch)
                   and Newton–Schulz in float32 and in bf16 against the same steps on CPU tensors (float32, as
                   cuda-vs-cpu's reference), within cuda-vs-cpu's bounds; fails if the clip never fired (recipe_run runs
                   the same on any device: tested on the CPU)

A check that this build or machine cannot run (dmuon not importable, no CUDA backend in libdmuon_c, no
GPU, no FSDP2) is reported as SKIP with the reason, never as PASS; with --strict (the GPU check's) a SKIP fails the
run. Prints a line per check as it ends and a table last; --results DIR also gets NAME.json (--name, default
gpu_check_torch), rewritten after every check. Exit status 1 when any check FAILs (or, --strict, SKIPs).

    PYTHONPATH=build/python python3 python/benchmarks/gpu_check_torch.py --results results/ [--checks a,b]
"""

import argparse
import importlib.util
import json
import math
import os
import pathlib
import statistics
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
CHECKS = ("fsdp2-cpu", "fsdp2-cuda", "owner-held-cuda", "cuda-vs-cpu", "step-time", "torch-engine", "recipe")
# Newton–Schulz's compute dtype on CUDA -> the largest relative difference of 5 DMuon steps to float32 steps on the CPU.
STEP_LIMITS = {"float32": 1e-4, "bfloat16": 3e-2}


class Skip(Exception):
    """A check this machine or build cannot run; the message says why."""


def engine():
    """(dmuon, DMuon), or Skip saying why dmuon or its libdmuon_c does not load (the GPU-only build has none)."""
    try:
        import dmuon
        from dmuon.torch import DMuon
    except ImportError as e:
        raise Skip(f"import dmuon failed ({e}); PYTHONPATH=BUILD/python after building dmuon_python") from None
    if dmuon.library_error() is not None:
        raise Skip(f"{dmuon.library_error()}; PYTHONPATH=BUILD/python after building dmuon_python")
    return dmuon, DMuon


def load_module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fully_shard_fn():
    reasons = []
    for module in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            return getattr(__import__(module, fromlist=["fully_shard"]), "fully_shard")
        except Exception as e:  # torch 1.13's fsdp package does not even import on Python 3.11
            reasons.append(f"{module}: {type(e).__name__}")
    raise Skip(f"torch {torch.__version__} has no FSDP2 fully_shard ({'; '.join(reasons)})")


def require_cuda_backend():
    if not torch.cuda.is_available():
        raise Skip("no CUDA device")
    dmuon, _ = engine()
    if not (dmuon.supports(dmuon.DEVICE_CUDA, dmuon.DTYPE_BF16) or dmuon.supports(dmuon.DEVICE_CUDA, dmuon.DTYPE_F32)):
        raise Skip("this build of libdmuon_c has no CUDA backend")


def cpu_reference_engine():
    """The engine of the CPU reference steps: libdmuon_c's where it has a CPU backend (the GPU-only build may have
    none), else the torch engine."""
    try:
        dmuon, _ = engine()
    except Skip:
        return "torch"
    return "dmuon" if dmuon.supports(dmuon.DEVICE_CPU, dmuon.DTYPE_F32) else "torch"


def relative_gap(got, want):
    """The largest relative Frobenius difference of two lists of tensors (NaN where got has one)."""
    return max(float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()) for a, b in zip(got, want))


def synthetic_batch(step, batch, context, device):
    """Byte sequences with structure a small model learns quickly: i, i+k, i+2k, ... (mod 256)."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, 256, (batch, 1), generator=gen)
    stride = torch.randint(1, 4, (batch, 1), generator=gen)
    rows = (start + stride * torch.arange(context + 1)) % 256
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


def train_fsdp2(device, steps=30, owner_held=False):
    """(first 5 mean loss, last 5 mean loss, DTensor parameter count, max relative difference to the
    same DMuon steps on an unwrapped copy); owner_held: DMuon's matrices held whole (examples/torch_train.py's
    --owner-held) and kept out of FSDP2."""
    fully_shard_fn()
    _, DMuon = engine()
    train = load_module(REPO / "examples" / "torch_train.py", "torch_train")
    torch.manual_seed(0)
    model = train.Gpt().to(device)
    plain = train.Gpt().to(device)
    plain.load_state_dict(model.state_dict())
    model = train.parallelize(model, "fsdp2", 1, owner_held, torch.device(device))
    dtensors = sum(1 for p in model.parameters() if type(p).__name__ == "DTensor")
    opt = DMuon(model.named_parameters(), adamw_lr=3e-3)
    opt_plain = DMuon(plain.named_parameters(), adamw_lr=3e-3)
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(step, 16, 64, device)
        for m, o in ((model, opt), (plain, opt_plain)):
            loss = m(x, y)
            o.zero_grad(set_to_none=True)
            loss.backward()
            o.step()
            if m is model:
                losses.append(float(loss))
    worst = 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        worst = max(worst, float((full.double() - q.double()).norm() / q.double().norm().clamp_min(1e-30)))
    return sum(losses[:5]) / 5, sum(losses[-5:]) / 5, dtensors, worst


def check_fsdp2(device, owner_held=False):
    first, last, dtensors, worst = train_fsdp2(device, owner_held=owner_held)
    ok = last < first and dtensors > 0 and worst < 1e-4
    return ok, (f"loss {first:.3f} -> {last:.3f}, {dtensors} DTensor parameters, "
                f"max relative difference to unwrapped {worst:.1e} (limit 1e-4)")


VS_CPU_SHAPES = [(256, 1024), (1024, 256), (512, 512), (7, 300), (300, 7)]


def dmuon_steps(device, engine_name, ns_dtype, steps=5, shapes=VS_CPU_SHAPES):
    """The parameters (CPU float64) of `shapes` after `steps` DMuon steps on `device` with engine `engine_name` and
    Newton–Schulz in `ns_dtype`: the same values and gradients on every device."""
    from dmuon.torch import DMuon  # the torch engine needs no libdmuon_c
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device)) for s in shapes]
    opt = DMuon([(f"m{i}", p) for i, p in enumerate(params)], engine=engine_name, ns_dtype=ns_dtype)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for p, shape in zip(params, shapes):
            p.grad = torch.randn(shape, generator=g).to(device)
        opt.step()
    return [p.detach().cpu().double() for p in params]


def check_cuda_vs_cpu():
    if not torch.cuda.is_available():
        raise Skip("no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    reference_engine = cpu_reference_engine()
    reference = dmuon_steps("cpu", reference_engine, "float32")
    ok, rows = True, []
    for engine_name in ("dmuon", "torch"):
        if engine_name == "dmuon":
            try:
                require_cuda_backend()
            except Skip as e:  # the torch engine's rows still run; the check fails
                ok = False
                rows.append(f"FAIL dmuon: {e}")
                continue
        for ns_dtype, limit in STEP_LIMITS.items():
            gap = relative_gap(dmuon_steps("cuda", engine_name, ns_dtype), reference)
            passed = gap < limit  # NaN fails too
            ok = ok and passed
            rows.append(f"{'' if passed else 'FAIL '}{engine_name} {ns_dtype} {gap:.1e} (limit {limit:.0e})")
    return ok, (f"5 DMuon steps on CUDA vs on the CPU (float32, {reference_engine} engine), max relative "
                f"difference: " + "; ".join(rows))


def time_step(opt, repeats=10):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    opt.step()  # state allocation
    times = []
    for _ in range(repeats):
        start.record()
        opt.step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check_step_time():
    if not torch.cuda.is_available():
        raise Skip("no CUDA device")
    if not hasattr(torch.optim, "Muon"):
        raise Skip(f"torch {torch.__version__} has no torch.optim.Muon")
    bench = load_module(HERE / "muon_step_torch.py", "muon_step_torch")
    specs = bench.muon_matrices(REPO / "models" / "qwen2.5-0.5b.json")

    def params():
        out = []
        for k, (n, s) in enumerate(specs):
            gen = torch.Generator().manual_seed(k)
            p = torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).cuda())
            p.grad = (torch.randn(s, generator=gen) * 1e-3).cuda()  # never zeros (GPU.md)
            out.append((n, p))
        return out

    rows = [("torch.optim.Muon", time_step(torch.optim.Muon([p for _, p in params()], lr=0.02, weight_decay=0.0)))]
    torch.cuda.empty_cache()
    try:
        require_cuda_backend()
        _, DMuon = engine()
        rows.append(("dmuon.torch.DMuon", time_step(DMuon(params()))))
    except Skip as e:
        rows.append((f"dmuon.torch.DMuon: {e}", float("nan")))
    text = f"{len(specs)} matrices: " + "; ".join(f"{n} {ms:.2f} ms" for n, ms in rows)
    if math.isnan(rows[-1][1]):
        raise Skip(text)
    return True, text + f"; DMuon speedup {rows[0][1] / rows[-1][1]:.2f}x"


def gpu_ms(fn, repeats=5):
    """Median milliseconds of fn() on the GPU after one untimed call (CUDA events)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def check_torch_engine():
    require_cuda_backend()
    dmuon, DMuon = engine()
    from dmuon.torch.torch_engine import newton_schulz
    torch.backends.cuda.matmul.allow_tf32 = False
    dtypes = {"float32": (torch.float32, dmuon.DTYPE_F32), "bfloat16": (torch.bfloat16, dmuon.DTYPE_BF16)}
    gen = torch.Generator(device="cuda").manual_seed(5)
    ok, lines, worst, times = True, [], {}, []
    for batch, rows, cols in [(1, 896, 4864), (1, 4864, 896), (1, 2048, 2048), (28, 128, 512)]:
        u = torch.randn((batch, rows, cols), device="cuda", generator=gen)
        for algo in ("standard", "gram"):
            exact = newton_schulz(u, "keller", 5, algo, torch.float64)
            for name, (dtype, code) in dtypes.items():
                ns = dmuon.Orthogonalizer(algo=algo, tune_cache=None, check_finite=False, dtype=name)
                stored = u.to(dtype)
                ours = torch.full_like(stored, float("nan"))  # poisoned: every element must be written

                def run_ours():
                    ns.run(list(stored), list(ours), rows, cols, device=dmuon.DEVICE_CUDA, dtype=code,
                           stream=torch.cuda.current_stream().cuda_stream)

                def run_torch():
                    return newton_schulz(stored, "keller", 5, algo, dtype)

                run_ours()
                theirs = run_torch()
                gaps = [float((a.double() - b.double()).norm() / b.double().norm())
                        for a, b in ((ours, exact), (theirs, exact), (theirs, ours))]
                limit = 15 * max(rows, cols) ** 0.5 * 2.0 ** -24 * (20 if algo == "gram" else 1) \
                    if name == "float32" else 5e-2
                passed = all(g < limit for g in gaps)  # NaN fails too
                ok = ok and passed
                key = (name, algo)
                worst[key] = max(worst.get(key, 0.0), gaps[2])
                line = (f"{batch}x{rows}x{cols} {algo:8} {name:8}: ours-f64 {gaps[0]:.1e}, torch-f64 {gaps[1]:.1e}, "
                        f"torch-ours {gaps[2]:.1e} (limit {limit:.1e})")
                if name == "bfloat16":
                    times.append(f"{batch}x{rows}x{cols} {algo} {gpu_ms(run_ours):.3f}/{gpu_ms(run_torch):.3f}")
                    line += f"; ms ours/torch engine {times[-1].rsplit(' ', 1)[1]}"
                lines.append(("" if passed else "FAIL ") + line)
                print(lines[-1], flush=True)
    shapes = [(256, 1024), (1024, 256), (512, 512)]
    values = [torch.randn(s, device="cuda", generator=gen) * 0.02 for s in shapes]
    models = {e: [torch.nn.Parameter(v.clone()) for v in values] for e in ("torch", "dmuon", "auto")}
    opts = {e: DMuon([(f"m{i}", p) for i, p in enumerate(ps)], engine=e) for e, ps in models.items()}
    ok = ok and opts["auto"].engine.name == "dmuon"
    for _ in range(5):
        grads = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
        for e, ps in models.items():
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opts[e].step()
    steps_gap = max(float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())
                    for a, b in zip(models["torch"], models["dmuon"]))
    ok = ok and steps_gap < 1e-2
    lines.append(f"DMuon 5 steps, engine torch vs dmuon: max relative difference {steps_gap:.1e} (limit 1e-2); "
                 f"auto chose {opts['auto'].engine.name}")
    print(lines[-1], flush=True)
    summary = ", ".join(f"{n} {a} {w:.1e}" for (n, a), w in worst.items())
    return ok, (f"torch engine vs ours, worst relative gap: {summary}; DMuon steps {steps_gap:.1e}; bf16 ms ours/torch "
                f"engine: {', '.join(times)}" + "".join(f"; {line}" for line in lines if line.startswith("FAIL")))


RECIPE_SHAPES = {"q.weight": (256, 128), "k.weight": (64, 128), "o.weight": (128, 256), "qkv.weight": (384, 128),
                 "up.weight": (512, 128), "q.bias": (256,)}
RECIPE_HEADS, RECIPE_KV_HEADS, RECIPE_TAU = 8, 2, 0.5


def recipe_run(device, engine_name, steps=5, tau=RECIPE_TAU, ns_dtype="float32"):
    """(parameters after `steps` DMuon steps of the recipe's param groups on `device` with engine `engine_name`,
    how many key-value groups QK-clip with threshold tau rescaled): the same seeds, gradients and reported maxima
    on every device."""
    from dmuon.torch import Attention, DMuon, QKClip
    gen = torch.Generator().manual_seed(11)
    params = {n: torch.nn.Parameter((torch.randn(s, generator=gen) * 0.05).to(device))
              for n, s in RECIPE_SHAPES.items()}
    groups = [
        {"params": [("q.weight", params["q.weight"])], "split_heads": RECIPE_HEADS, "variant": "normuon"},
        {"params": [("k.weight", params["k.weight"])], "split_heads": RECIPE_KV_HEADS, "variant": "normuon"},
        {"params": [("o.weight", params["o.weight"])], "split_heads": RECIPE_HEADS, "split_dim": 1,
         "cautious_wd": True, "scale": "spectral"},
        {"params": [("qkv.weight", params["qkv.weight"])], "split_sizes": [256, 64, 64]},
        {"params": [("up.weight", params["up.weight"]), ("q.bias", params["q.bias"])]},
    ]
    opt = DMuon(groups, weight_decay=0.1, ns_dtype=ns_dtype, engine=engine_name)
    clip = QKClip(opt, tau, [Attention(q="q.weight", k="k.weight", heads=RECIPE_HEADS,
                                              kv_heads=RECIPE_KV_HEADS, q_bias="q.bias")])
    fired = 0
    for _ in range(steps):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen).to(device)
        maxima = torch.rand(RECIPE_HEADS, generator=gen) * 2 * RECIPE_TAU
        fired += int((maxima.view(RECIPE_KV_HEADS, -1).max(dim=1).values > tau).sum())
        clip.report(0, maxima.to(device))
        opt.step()
    return {n: p.detach().cpu().double() for n, p in params.items()}, fired


def check_recipe():
    require_cuda_backend()
    ref, fired = recipe_run("cpu", cpu_reference_engine())
    ok, rows = fired > 0, []
    for engine_name in ("dmuon", "torch"):
        for ns_dtype, limit in STEP_LIMITS.items():
            got, _ = recipe_run("cuda", engine_name, ns_dtype=ns_dtype)
            gap = max(float((got[n] - ref[n]).norm() / ref[n].norm()) for n in ref)
            passed = gap < limit  # NaN fails too
            ok = ok and passed
            rows.append(f"{'' if passed else 'FAIL '}{engine_name} {ns_dtype} {gap:.1e} (limit {limit:.0e})")
    return ok, (f"5 recipe steps on CUDA vs CPU float32, max relative difference: {'; '.join(rows)}; QK-clip "
                f"rescaled {fired} key-value groups")


def init_single_process(backend):
    store = os.path.join(tempfile.mkdtemp(prefix="dmuon_gpu_check_"), "store")
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)


def run_check(name, fn, results, write):
    try:
        ok, detail = fn()
        status = "PASS" if ok else "FAIL"
    except Skip as e:
        status, detail = "SKIP", str(e)
    except Exception as e:  # a crash is a failure with its message, and the other checks still run
        status, detail = "FAIL", f"{type(e).__name__}: {e}"
        traceback.print_exc()
    results.append({"check": name, "status": status, "detail": detail})
    print(f"[{status}] {name}: {detail}", flush=True)
    write(results)  # a kill of the process later loses nothing of this check


def describe_engine():
    try:
        dmuon, _ = engine()
    except Skip as e:
        return str(e)
    return (f"libdmuon_c cuda bf16/f32: {dmuon.supports(dmuon.DEVICE_CUDA, dmuon.DTYPE_BF16)}/"
            f"{dmuon.supports(dmuon.DEVICE_CUDA, dmuon.DTYPE_F32)}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=os.environ.get("DMUON_GPU_RESULTS"), help="folder for the JSON")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated, of {', '.join(CHECKS)}")
    parser.add_argument("--name", default="gpu_check_torch", help="the results file's name, without .json")
    parser.add_argument("--strict", action="store_true",
                        help="a check that cannot run (SKIP) fails the run (the GPU check's, where each must run)")
    args = parser.parse_args(argv)
    chosen = args.checks.split(",")
    unknown = sorted(set(chosen) - set(CHECKS))
    if unknown:
        parser.error(f"--checks: unknown {', '.join(unknown)} (known: {', '.join(CHECKS)})")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}, {describe_engine()}",
          flush=True)

    def write(results):
        if args.results:
            pathlib.Path(args.results).mkdir(parents=True, exist_ok=True)
            (pathlib.Path(args.results) / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    results = []
    if "fsdp2-cpu" in chosen:
        init_single_process("gloo")
        run_check("fsdp2-cpu", lambda: check_fsdp2("cpu"), results, write)
        dist.destroy_process_group()
    if torch.cuda.is_available():
        init_single_process("nccl")

    def fsdp2_cuda(owner_held):
        require_cuda_backend()
        return check_fsdp2("cuda", owner_held)
    for name, fn in (("cuda-vs-cpu", check_cuda_vs_cpu), ("torch-engine", check_torch_engine),
                     ("recipe", check_recipe), ("fsdp2-cuda", lambda: fsdp2_cuda(False)),
                     ("owner-held-cuda", lambda: fsdp2_cuda(True)), ("step-time", check_step_time)):
        if name in chosen:
            run_check(name, fn, results, write)
    if dist.is_initialized():
        dist.destroy_process_group()
    print("\n| check | status | detail |\n|---|---|---|")
    for r in results:
        print(f"| {r['check']} | {r['status']} | {r['detail']} |")
    write(results)
    failing = ("FAIL", "SKIP") if args.strict else ("FAIL",)
    return 1 if any(r["status"] in failing for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
