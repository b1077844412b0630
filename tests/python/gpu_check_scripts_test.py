"""The Python parts of scripts/gpu-check.sh, on the CPU (pytest; torch and dmuon):

muon_step_torch.py (torch.optim.Muon's step, torch only) lists exactly the Muon matrices dmuon's manifest loader
lists, passes them to dmuon_gpu_check as ROWSxCOLS:COUNT, and runs and writes its JSON on the CPU;
gpu_check_torch.py parses its options, reports what this machine cannot run as SKIP with the reason and writes
its results file.
"""

import importlib.util
import json
import pathlib
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
    assert all("no CUDA device" in r["detail"] for r in results)
    with pytest.raises(SystemExit):
        gpu_check_torch.main(["--checks", "fsdp2-gpu"])


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


def test_dry_run_probes_first_waits_for_the_anchors_before_the_gpu_tests_and_prints_the_summary(tmp_path):
    rc, out, err = run_script(tmp_path, {"DMUON_GPU_CHECK_DRY_RUN": "1"})
    assert rc == 0, out + err
    assert out.startswith("== gpu-check probe")
    for item in ("gpu:", "nvcc:", "cmake:", "python:", "torch:", "cuBLAS:", "NCCL:", "mode:"):
        assert f"\n{item}" in out, item
    assert (tmp_path / "probe.txt").read_text() in out
    # The anchors time the GPU alone (N2): the wait comes before the first GPU test.
    wait = err.index("would wait for torch_anchor and torch_muon_step")
    assert wait < err.index("would run (gpu_check")
    assert err.index("would run (build") < wait
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("== gpu-check: ") and "of a 300 s budget, dry run" in summary
    assert (tmp_path / "report.txt").read_text().startswith(summary)
    assert "gpu_check                dry-run" in summary


def test_without_nvcc_the_probe_picks_the_torch_mode_and_skips_what_needs_a_build(tmp_path):
    rc, out, err = run_script(tmp_path, {"DMUON_GPU_CHECK_DRY_RUN": "1"}, without="nvcc")
    assert rc == 0, out + err
    assert "\nnvcc:      missing" in out
    assert "\nmode:      torch (cannot build, missing: nvcc), dry run" in out
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("== gpu-check: torch mode")
    for step in ("build", "gpu_check", "bench_ns", "bench_muon"):
        assert f"\n{step:<24} skipped (cannot build, missing: nvcc)" in summary, step


FAKE_CMAKE = """#!/bin/bash
# Configures anything; builds only the GPU subset's folder (name ending in -only).
echo "$*" >> "$FAKE_CMAKE_LOG"
[ "$1" = --version ] && { echo "cmake version 3.25.1"; exit 0; }
if [ "$1" = --build ] && [[ "$2" != *-only ]]; then echo "fake: the full build fails"; exit 2; fi
exit 0
"""


def test_a_failing_full_build_falls_back_to_the_gpu_subset(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "cmake").write_text(FAKE_CMAKE)
    (fake_bin / "cmake").chmod(0o755)
    log, build = tmp_path / "cmake.log", tmp_path / "b"
    rc, out, err = run_script(tmp_path / "results", {"FAKE_CMAKE_LOG": str(log), "DMUON_GPU_BUILD": str(build),
                                                     "DMUON_GPU_CHECK_BUDGET_S": "120"}, fake_bin)
    if "\nmode:      full" not in out:
        pytest.skip("this machine lacks a library of the full build: " + out)
    calls = [line.split()[:3] for line in log.read_text().splitlines() if line != "--version"]
    assert calls == [["-S", ".", "-B"], ["--build", str(build), "-j"], ["-S", ".", "-B"],
                     ["--build", f"{build}-only", "-j"]], log.read_text()
    assert "-DDMUON_GPU_ONLY=ON" in log.read_text().splitlines()[-2]
    summary = (tmp_path / "results" / "summary.txt").read_text()
    assert "gpu-only mode" in summary.splitlines()[0]
    assert "\nbuild                    failed (exit 2)" in summary
    assert "\nbuild_gpu_only           ok" in summary
    # No GPU tool was built: every later step fails on its own, and the script still writes its report.
    assert rc == 1
    report = (tmp_path / "results" / "report.txt").read_text()
    assert "fake: the full build fails" in report and "== gpu_check: failed" in report
