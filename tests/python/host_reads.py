"""no_host_reads(): a block inside which any read of tensor values by the host fails the test (torch_step_sync_test,
torch_owner_held_habits_test: a step that never waits for the device)."""

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    """Records the operators that read a tensor's value on the host: .item(), float(), int(), bool()
    all reach _local_scalar_dense."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_reads():
    """Fails the test on any read of tensor values by the host inside the block: the dispatcher's
    scalar reads, and the Tensor methods that read a CPU tensor's memory directly (they do not go
    through the dispatcher)."""
    mode = HostReads()
    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}

    def refuse(name):
        def method(self, *args, **kwargs):
            mode.reads.append(f"Tensor.{name}")
            return saved[name](self, *args, **kwargs)
        return method

    for name in saved:
        setattr(torch.Tensor, name, refuse(name))
    try:
        with mode:
            yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
    assert mode.reads == [], f"step() read tensors back on the host: {mode.reads}"
