"""The Python parts of scripts/gpu-check.sh, on the CPU (pytest; torch and dmuon):

muon_step_torch.py (torch.optim.Muon's step, torch only) lists exactly the Muon matrices dmuon's manifest loader
lists, passes them to dmuon_gpu_check as ROWSxCOLS:COUNT, and runs and writes its JSON on the CPU;
gpu_check_torch.py parses its options, reports what this machine cannot run as SKIP with the reason (a failure with
--strict) and writes its results file, and its CPU reference steps agree with the bounds the GPU run holds them to.
scripts/gpu-check.sh itself, as a dry run and with fake tools: in every mode it runs dmuon.torch first, after the build
and before the C++ checks, the anchors and the benchmarks (the anchors never beside the build); its results folder
holds only the archive and report.txt (the device tool brings back 8 files), the report's first screen lists every
step (ran, failed, skipped and why), every FAIL line and every figure; the required steps fit the budget and one
left without time fails; nvcc is found off PATH and cuBLAS in a toolkit with lib64 only; torchtitan's checkpoints stay
out of the archive; and a machine that cannot build fails.
"""

import importlib.util
import json
import pathlib
import shutil
import tarfile
from collections import Counter

import pytest
import torch

import dmuon

REPO = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "python" / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


muon_step_torch = load("muon_step_torch")
gpu_check_torch = load("gpu_check_torch")


@pytest.mark.parametrize("model,layers", [("qwen2.5-0.5b", 2), ("qwen2.5-0.5b", 0), ("qwen2.5-7b", 1)])
def test_muon_matrices_are_the_manifests(model, layers):
    path = REPO / "models" / f"{model}.json"
    ours = muon_step_torch.muon_matrices(path, layers)
    want = [(p["name"], tuple(p["shape"])) for p in dmuon.model_params(str(path), layers) if p["role"] == "matrix"]
    assert ours == want


def test_shapes_argument_counts_every_matrix():
    matrices = muon_step_torch.muon_matrices(REPO / "models" / "qwen2.5-0.5b.json")
    text = muon_step_torch.shapes_argument(matrices)
    counted = Counter()
    for item in text.split(","):
        shape, count = item.split(":")
        rows, cols = shape.split("x")
        counted[(int(rows), int(cols))] += int(count)
    assert counted == Counter(shape for _, shape in matrices)
    assert text.startswith("896x896:48,128x896:48,")  # first-seen order: q, k (v joins k), o, ...


def test_torch_muon_step_runs_on_the_cpu(tmp_path):
    manifest = tmp_path / "tiny.json"
    manifest.write_text(json.dumps({"name": "tiny", "components": [{"config": {
        "model_type": "qwen2", "hidden_size": 16, "intermediate_size": 40, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}}]}))
    out = tmp_path / "step.json"
    assert muon_step_torch.main(["--model", str(manifest), "--device", "cpu", "--repeats", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["optimizer"] == "torch.optim.Muon" and result["matrices"] == 7
    assert result["parameters"] == 16 * 16 * 2 + 8 * 16 * 2 + 40 * 16 * 3
    assert len(result["step_s"]) == 2 and all(t > 0 for t in result["step_s"])
    assert result["shapes"] == "16x16:2,8x16:2,40x16:2,16x40:1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU these checks run instead of skipping")
def test_gpu_check_torch_skips_what_this_machine_lacks_and_writes_its_results(tmp_path):
    assert gpu_check_torch.main(["--checks", "cuda-vs-cpu,step-time", "--results", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "gpu_check_torch.json").read_text())
    assert [(r["check"], r["status"]) for r in results] == [("cuda-vs-cpu", "SKIP"), ("step-time", "SKIP")]
    assert gpu_check_torch.main(["--checks", "torch-engine,recipe", "--name", "engine", "--results",
                                 str(tmp_path)]) == 0
    results += json.loads((tmp_path / "engine.json").read_text())
    assert [(r["check"], r["status"]) for r in results[2:]] == [("torch-engine", "SKIP"), ("recipe", "SKIP")]
    assert all("no CUDA device" in r["detail"] for r in results)
    assert gpu_check_torch.main(["--checks", "step-time", "--strict", "--results", str(tmp_path)]) == 1
    with pytest.raises(SystemExit):
        gpu_check_torch.main(["--checks", "fsdp2-gpu"])


def test_the_cpu_reference_steps_agree_within_the_bounds_the_gpu_run_holds_them_to():
    # What cuda-vs-cpu compares, rehearsed on the CPU on smaller shapes: float32 DMuon steps of either engine within
    # the float32 bound of each other (tight: 1e-4), bf16 Newton–Schulz's steps within the bf16 bound of float32's.
    shapes = [(64, 256), (256, 64), (7, 300)]
    reference = gpu_check_torch.dmuon_steps("cpu", "torch", "float32", shapes=shapes)
    ours = gpu_check_torch.dmuon_steps("cpu", "dmuon", "float32", shapes=shapes)
    bf16 = gpu_check_torch.dmuon_steps("cpu", "torch", "bfloat16", shapes=shapes)
    assert gpu_check_torch.relative_gap(ours, reference) < gpu_check_torch.STEP_LIMITS["float32"]
    gap = gpu_check_torch.relative_gap(bf16, reference)
    assert 1e-3 < gap < gpu_check_torch.STEP_LIMITS["bfloat16"], gap  # bf16 rounding shows, within its bound


def test_the_recipe_check_runs_the_same_steps_with_either_engine_and_its_clip_fires():
    # What the GPU's recipe check compares, rehearsed on the CPU: each engine's float32 steps of the same recipe agree
    # (the GPU run holds CUDA's to 1e-2 of these), and QK-clip's rescale is part of them.
    ours, fired = gpu_check_torch.recipe_run("cpu", "dmuon")
    theirs, _ = gpu_check_torch.recipe_run("cpu", "torch")
    unclipped, _ = gpu_check_torch.recipe_run("cpu", "dmuon", tau=1e9)
    assert fired > 0
    for name in ours:
        assert float((theirs[name] - ours[name]).norm() / ours[name].norm()) < 1e-5, name
    assert not torch.equal(unclipped["q.weight"], ours["q.weight"])  # the clip changed q
    assert torch.equal(unclipped["o.weight"], ours["o.weight"])      # and nothing it does not touch


# ---- scripts/gpu-check.sh itself, without a GPU ----

SCRIPT = REPO / "scripts" / "gpu-check.sh"


def run_script(results, env=None, fake_bin=None, without=None):
    """Runs the script with this interpreter's folder first on PATH (its python3 has torch), and fake_bin before
    it, with no folder that holds the program `without`; returns (exit status, standard output, standard error)."""
    import os
    import subprocess
    import sys
    path = [str(pathlib.Path(sys.executable).parent)] + [
        p for p in os.environ["PATH"].split(os.pathsep) if not (without and (pathlib.Path(p) / without).exists())]
    if fake_bin:
        path.insert(0, str(fake_bin))
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DMUON_GPU")}
    full_env.update({"PATH": os.pathsep.join(path), **(env or {})})
    p = subprocess.run(["bash", str(SCRIPT), str(results)], env=full_env, capture_output=True, text=True, timeout=240)
    return p.returncode, p.stdout, p.stderr


def results_of(results):
    """The results folder as the device tool brings it back: exactly report.txt and gpu-check.tar.gz; returns the
    report and {name: text} of the archive's files."""
    assert sorted(p.name for p in results.iterdir()) == ["gpu-check.tar.gz", "report.txt"]
    with tarfile.open(results / "gpu-check.tar.gz") as tar:
        files = {m.name.removeprefix("./"): tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    return (results / "report.txt").read_text(), files


SCREEN = 60  # lines: the report's first screen


def rows(report):
    """{step: (kind, status)} of the report's step table (ran / FAILED / skipped / dry-run, and why)."""
    out = {}
    for line in report.splitlines()[1:]:
        if line.startswith("-- "):
            break
        name, kind, *why = line.split(maxsplit=2)
        out[name] = (kind, why[0] if why else "")
    return out


DMUON_TORCH_CHECKS = "--checks cuda-vs-cpu,torch-engine,recipe,fsdp2-cuda,owner-held-cuda,step-time"


def test_dry_run_probes_first_runs_dmuon_torch_first_and_lists_every_step_on_the_first_screen(tmp_path):
    rc, out, err = run_script(tmp_path, {"DMUON_GPU_CHECK_DRY_RUN": "1"})
    assert rc == 0, out + err
    assert out.startswith("== gpu-check probe")
    for item in ("gpu:", "nvcc:", "cmake:", "python:", "torch:", "cuBLAS:", "NCCL:", "mode:", "budget:"):
        assert f"\n{item}" in out, item
    assert "\nmode:      gpu-only (the default; " in out  # one 10-minute command with time to run it again
    assert "\nbudget:    420 s; the required steps' limits: 420 s (" in out
    report, files = results_of(tmp_path)
    assert files["probe.txt"] in out
    assert {"probe.txt", "progress.log", "summary.txt", "report.txt"} <= set(files)
    # The lean build (libdmuon_c and python/dmuon with it), then dmuon.torch before anything else; the anchors after
    # the build (never timed beside it: P5) and before the benchmarks that compare to them.
    order = [err.index(f"would run ({name}, ") for name in ("configure_gpu_only", "build_gpu_only", "dmuon_torch",
                                                            "gpu_check", "torch_anchor", "torch_muon_step", "bench_ns")]
    assert order == sorted(order), err
    assert "--target dmuon_gpu_check dmuon_python" in err
    dmuon_torch = next(line for line in err.splitlines() if "would run (dmuon_torch, 105s)" in line)
    assert "-only/python " in dmuon_torch and "gpu_check_torch.py --strict" in dmuon_torch
    assert DMUON_TORCH_CHECKS in dmuon_torch
    assert report.startswith("== gpu-check: gpu-only mode") and "of a 420 s budget, dry run, 0 step(s) failed" in report
    assert report == files["report.txt"] and out.endswith(files["summary.txt"])
    table = rows(report)
    assert list(table)[:4] == ["configure_gpu_only", "build_gpu_only", "dmuon_torch", "gpu_check"]
    assert table["dmuon_torch"] == ("dry-run", "")
    assert table["bench_optimizer"] == ("skipped", "(full mode only: DMUON_GPU_CHECK_MODE=full)")


def test_the_full_mode_runs_dmuon_torch_first_and_keeps_titans_checkpoints_out_of_the_archive(tmp_path):
    logs = tmp_path / "logs"
    rc, out, err = run_script(tmp_path / "results", {"DMUON_GPU_CHECK_DRY_RUN": "1", "DMUON_GPU_CHECK_MODE": "full",
                                                     "DMUON_GPU_CHECK_LOGS": str(logs)})
    if "\nmode:      full" not in out:
        pytest.skip("this machine lacks a library of the full build: " + out)
    assert rc == 0, out + err
    assert "\nbudget:    570 s; the required steps' limits: 570 s (" in out
    order = [err.index(f"would run ({name}, ") for name in ("configure", "build", "dmuon_torch", "gpu_check",
                                                            "gpu_suites", "torch_anchor", "bench_ns")]
    assert order == sorted(order), err
    assert DMUON_TORCH_CHECKS in err
    titan = [line for line in err.splitlines() if "would run (titan_train_cuda" in line]
    if titan:  # torchtitan's recipe, both modes: this interpreter has torchtitan (issue 43)
        assert len(titan) == 2 and all("examples/titan_train.py --steps 10" in line for line in titan), titan
        assert "--owner-held" in titan[1] and "--owner-held" not in titan[0], titan
        # P7: its DCP checkpoints (far over the 16 MiB a returned file may hold) are written outside the archive's logs
        folders = [line.split("--folder ")[1].split()[0] for line in titan]
        assert all(not f.startswith(str(logs)) for f in folders), folders


def test_without_nvcc_anywhere_the_torch_mode_runs_the_torch_engine_and_fails_every_step_that_needs_a_build(tmp_path):
    rc, out, err = run_script(tmp_path, {"DMUON_GPU_CHECK_DRY_RUN": "1", "DMUON_GPU_CHECK_CUDA_DIRS": ""},
                              without="nvcc")
    assert rc == 1, out + err  # M4: a machine that cannot build never reports green
    assert "\nnvcc:      missing" in out
    assert "\nmode:      torch (cannot build, missing: nvcc), dry run" in out
    report, _ = results_of(tmp_path)
    assert report.startswith("== gpu-check: torch mode")
    table = rows(report)
    for name in ("build", "gpu_check", "bench_ns", "bench_muon"):
        assert table[name] == ("FAILED", "failed: cannot run (cannot build, missing: nvcc)"), name
    # dmuon.torch's torch engine needs no build: it runs from the sources (the C ABI's checks fail there)
    dmuon_torch = next(line for line in err.splitlines() if "would run (dmuon_torch, " in line)
    assert f"PYTHONPATH={REPO}/python " in dmuon_torch and DMUON_TORCH_CHECKS in dmuon_torch


def test_nvcc_off_path_is_found_in_the_cuda_folders(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no CUDA toolkit on this machine")
    toolkit = pathlib.Path(nvcc).resolve().parents[1]
    rc, out, err = run_script(tmp_path, {"DMUON_GPU_CHECK_DRY_RUN": "1",
                                         "DMUON_GPU_CHECK_CUDA_DIRS": f"/nonexistent {toolkit}"}, without="nvcc")
    assert f"\nnvcc:      {toolkit}/bin/nvcc, release " in out, out
    assert "(not on PATH: found at" in out
    assert "\nmode:      torch" not in out
    assert f"-DCMAKE_CUDA_COMPILER={toolkit}/bin/nvcc" in err


def test_cublas_and_nccl_are_found_in_a_toolkit_with_lib64_only_and_a_budget_too_small_is_refused(tmp_path):
    # NVIDIA's standard layout (P4): include/ and lib64/, no lib/ and no targets/.
    toolkit = tmp_path / "cuda"
    for path in ("include/cublas_v2.h", "include/nccl.h", "lib64/libcublas.so", "lib64/libnccl.so"):
        (toolkit / path).parent.mkdir(parents=True, exist_ok=True)
        (toolkit / path).write_text("")
    (toolkit / "bin").mkdir()
    (toolkit / "bin" / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    (toolkit / "bin" / "nvcc").chmod(0o755)
    rc, out, err = run_script(tmp_path / "results", {"DMUON_GPU_CHECK_DRY_RUN": "1", "DMUON_GPU_CHECK_BUDGET_S": "300",
                                                     "DMUON_GPU_CHECK_CUDA_DIRS": str(toolkit)}, without="nvcc")
    assert f"\ncuBLAS:    toolkit {toolkit} " in out, out
    assert f"\nNCCL:      toolkit {toolkit} " in out, out
    # P3: the required steps' limits must fit the budget; 300 s cannot hold the gpu-only mode's 420
    assert rc == 2, out + err
    assert "the budget of 300 s cannot hold the gpu-only mode's required steps (420 s:" in err
    assert "would run" not in err


FAKE_CMAKE = """#!/bin/bash
# Configures anything; builds only the GPU subset's folder (name ending in -only), where it leaves a fake
# dmuon_gpu_check (FAKE_GPU_CHECK).
echo "$*" >> "$FAKE_CMAKE_LOG"
[ "$1" = --version ] && { echo "cmake version 3.25.1"; exit 0; }
if [ "$1" = --build ] && [[ "$2" != *-only ]]; then echo "fake: the full build fails"; exit 2; fi
[ "$1" = --build ] && cp "$FAKE_GPU_CHECK" "$2/dmuon_gpu_check"
exit 0
"""

# `test`: 200 verdicts, one FAIL among them, the failure count; `bench ns`: one shape timed and one that threw
# (M5); `bench muon`: a step time.
FAKE_GPU_CHECK = """#!/bin/bash
if [ "$1" = test ]; then
  for i in $(seq 1 200); do
    [ $i = 20 ] && echo "FAIL newton_schulz gram bf16 96x512 1 steps, device norms vs emulated bf16   0.5 (limit 0.001)"
    echo "ok   check $i"
  done
  echo "1 failure(s)"; exit 1
fi
if [ "$2" = ns ]; then
  echo '{"batch": 1, "shapes": [{"rows": 896, "cols": 4864, "paths": [{"path": "auto", "seconds_per_matrix": 0.00123,'
  echo '"useful_gflops": 456000}]}, {"rows": 4096, "cols": 4096, "error": "cuda: fake capture failure", "paths": []}]}'
  echo "FAIL bench ns 4096x4096: cuda: fake capture failure" >&2; exit 1
fi
echo '{"matrices": 3, "parameters": 300, "step_s_median": 0.00789, "buckets": []}'
"""


def fake_tools(tmp_path, **scripts):
    """A folder of executable fake tools (name: text) and the fake dmuon_gpu_check."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name, text in {"fake_gpu_check": FAKE_GPU_CHECK, **scripts}.items():
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    return fake_bin


def test_a_failing_full_build_falls_back_to_the_gpu_subset_and_the_report_shows_every_fail_and_figure(tmp_path):
    fake_bin = fake_tools(tmp_path, cmake=FAKE_CMAKE)
    log, build = tmp_path / "cmake.log", tmp_path / "b"
    (tmp_path / "b-only").mkdir()
    rc, out, err = run_script(tmp_path / "results", {"FAKE_CMAKE_LOG": str(log), "DMUON_GPU_BUILD": str(build),
                                                     "FAKE_GPU_CHECK": str(fake_bin / "fake_gpu_check"),
                                                     "DMUON_GPU_CHECK_MODE": "full"}, fake_bin)
    if "\nmode:      full" not in out:
        pytest.skip("this machine lacks a library of the full build: " + out)
    calls = [line.split()[:3] for line in log.read_text().splitlines() if line != "--version"]
    assert calls == [["-S", ".", "-B"], ["--build", str(build), "-j"], ["-S", ".", "-B"],
                     ["--build", f"{build}-only", "-j"]], log.read_text()
    assert "-DDMUON_GPU_ONLY=ON" in log.read_text().splitlines()[-2]
    assert log.read_text().splitlines()[-1].endswith("--target dmuon_gpu_check dmuon_python")
    assert rc == 1
    report, files = results_of(tmp_path / "results")
    assert "gpu-only mode" in report.splitlines()[0]
    table = rows(report)
    assert table["build"] == ("FAILED", "failed (exit 2)")
    assert table["build_gpu_only"] == ("ran", "")
    assert table["gpu_suites"] == ("FAILED", "failed: cannot run (the full build failed)")
    # dmuon.torch ran on the GPU subset's python/dmuon: on this CPU its checks SKIP, which --strict fails
    assert table["dmuon_torch"] == ("FAILED", "failed (exit 1)")
    assert f"PYTHONPATH={build}-only/python " in err
    # M1: the first screen holds every step, every FAIL line of the logs and every figure, and so do the last
    # characters of the output (the device tool keeps 12,000).
    first_screen = "\n".join(report.splitlines()[:SCREEN])
    for line in ("gpu_check                    FAILED   failed (exit 1)",
                 "bench_ns                     FAILED   failed (exit 1)",
                 "gpu_check.log:FAIL newton_schulz gram bf16 96x512 1 steps, device norms",
                 "bench_ns.log:FAIL bench ns 4096x4096: cuda: fake capture failure",
                 "FAIL   1x4096x4096 cuda: fake capture failure",
                 "  1x896x4864       auto      1.230    456.0",
                 "dmuon device step      7.890 ms",
                 "dmuon.torch     cuda-vs-cpu: SKIP no CUDA device"):
        assert line in first_screen, line
        assert line in out[-12000:], line
    assert "fake: the full build fails" in report and "== gpu_check: failed (exit 1); the end of gpu_check.log" in report
    # Every log is in the archive, whole.
    assert files["gpu_check.log"].count("\nok   check ") == 199 and "fake: the full build fails" in files["build.log"]
    assert json.loads(files["bench_muon.json"])["step_s_median"] == 0.00789


# A clock that jumps FAKE_SKEW_S seconds ahead once the skew file holds them (written by the fake build).
FAKE_DATE = """#!/bin/bash
if [ "$1" = +%s ]; then echo $(( $(/bin/date +%s) + $(cat "$FAKE_SKEW" 2>/dev/null || echo 0) )); else exec /bin/date "$@"; fi
"""
FAKE_SLOW_CMAKE = """#!/bin/bash
[ "$1" = --version ] && { echo "cmake version 3.25.1"; exit 0; }
[ "$1" = --build ] && { cp "$FAKE_GPU_CHECK" "$2/dmuon_gpu_check"; echo 1000 > "$FAKE_SKEW"; }
exit 0
"""


def test_a_required_step_left_without_time_fails_and_an_extra_one_is_skipped(tmp_path):
    # P3: the build takes (by the fake clock) more than the 420 s: dmuon.torch and the C++ checks cannot run, and the run
    # must not be green; the benchmarks are extras, skipped for time.
    fake_bin = fake_tools(tmp_path, cmake=FAKE_SLOW_CMAKE, date=FAKE_DATE)
    build = tmp_path / "b"
    (tmp_path / "b-only").mkdir()
    rc, out, err = run_script(tmp_path / "results", {"DMUON_GPU_BUILD": str(build), "FAKE_SKEW": str(tmp_path / "skew"),
                                                     "FAKE_GPU_CHECK": str(fake_bin / "fake_gpu_check")}, fake_bin)
    if "\nmode:      torch" in out:
        pytest.skip("no CUDA toolkit on this machine: " + out)
    assert rc == 1, out + err
    table = rows(results_of(tmp_path / "results")[0])
    assert table["build_gpu_only"] == ("ran", "")
    for name in ("dmuon_torch", "gpu_check"):
        assert table[name] == ("FAILED", "failed: not run, time budget spent"), name
    for name in ("torch_anchor", "bench_ns", "bench_muon"):
        assert table[name][0] == "skipped", name
    assert table["bench_ns"][1] == "(time budget spent)"
