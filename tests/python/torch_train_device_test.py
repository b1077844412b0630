"""examples/torch_train.py's --device plumbing, on the CPU (pytest; torch only): which process group backend
and device each choice gives, which GPU a rank takes (torchrun's LOCAL_RANK, mpirun's local rank), the refusal
of a rank without a GPU of its own, and the model moved to the device. torch.cuda is stubbed for the cuda
cases; the run itself on a GPU is scripts/gpu-check.sh's (full mode)."""

import importlib.util
import pathlib

import pytest
import torch

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "torch_train.py"
spec = importlib.util.spec_from_file_location("torch_train", EXAMPLE)
torch_train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(torch_train)


def test_cpu_is_gloo_on_the_cpu():
    assert torch_train.setup_device("cpu", {}) == ("gloo", torch.device("cpu"))


def test_cuda_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a GPU"):
        torch_train.setup_device("cuda", {})


@pytest.fixture
def two_gpus(monkeypatch):
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    return current


@pytest.mark.parametrize("environ,gpu", [({}, 0), ({"LOCAL_RANK": "1"}, 1), ({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}, 1)])
def test_cuda_is_nccl_on_the_ranks_own_gpu(two_gpus, environ, gpu):
    assert torch_train.setup_device("cuda", environ) == ("nccl", torch.device("cuda", gpu))
    assert two_gpus == [gpu]


def test_a_rank_without_a_gpu_of_its_own_is_refused(two_gpus):
    with pytest.raises(SystemExit, match="local rank 2 has no GPU of its own"):
        torch_train.setup_device("cuda", {"LOCAL_RANK": "2"})
    assert two_gpus == []


def test_the_model_goes_to_the_device():
    model = torch_train.parallelize(torch_train.Gpt(), "ddp", 1, False, torch.device("meta"))
    assert {p.device.type for p in model.parameters()} == {"meta"}
