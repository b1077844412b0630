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
