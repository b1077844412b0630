"""What dmuon.torch knows about devices beyond the CPU, in one place (the engines' own choices are engine.py's):
any accelerator torch has (CUDA, ROCm, XPU, MPS, ...) through torch's device-generic APIs, never CUDA's by name."""

import torch


def wide_dtype(device):
    """The dtype of sums that want more than float32 (gradient norms, Newton–Schulz's input norms): float64, or
    float32 on MPS, which has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def accelerator_device():
    """The current accelerator's current device (a collective backend's that refuses CPU tensors: NCCL's and RCCL's
    cuda, XCCL's xpu)."""
    return torch.device(torch.accelerator.current_accelerator().type, torch.accelerator.current_device_index())


def ready_event(device):
    """An event recorded now on the current stream of accelerator `device`: query() says whether the work queued
    before it has run, synchronize() waits for it."""
    event = torch.Event(device=device)
    event.record()
    return event
