"""torchtitan's Trainer on the CPU (gloo), for trying a torchtitan config without a GPU, and for the tests
(docs/integrations.md, "torchtitan's Trainer"). Imports torchtitan; tested with torchtitan 0.3.0.

torchtitan 0.3.0 takes "cuda" as its device when no accelerator is present, and its Trainer then stops at
torch.cuda.set_device. on_cpu(config), called in a config_registry function (the function
`python -m torchtitan.train --module M --config F` calls), makes the Trainer run on the CPU:
  - torchtitan's device is the CPU: its modules' `device_type` is "cpu" (the meshes, the process group's
    backend, gloo, and the model's device) and their `device_module` is CpuDevice (torch.cpu, with the
    memory monitor's calls answered: no peak statistics on the CPU);
  - the model's attention is SDPA (FlexAttention has no backward on the CPU), unless the config picked it;
  - FSDP2 reduces gradients with SUM: torchtitan sets FSDP's gradient divide factor to 1.0, which FSDP2 sends
    as PREMUL_SUM, and gloo has none ("Cannot use ReduceOp.PREMUL_SUM with Gloo").
The first is process-wide (torchtitan reads its device from module globals): call on_cpu only in a process
meant to train on the CPU.
"""

import dataclasses
import importlib
import os

import torch
from torch.distributed.fsdp import FSDPModule
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

# torchtitan 0.3.0's modules that bind the device at import (`from torchtitan.tools.utils import device_type`)
# or read it from torchtitan.tools.utils, with the names each binds
_DEVICE_NAMES = {
    "torchtitan.tools.utils": ("device_type", "device_module"),
    "torchtitan.distributed.utils": ("device_type", "device_module"),
    "torchtitan.distributed.parallel_dims": ("device_type",),
    "torchtitan.components.metrics": ("device_type", "device_module"),
    "torchtitan.models.common.token_dispatcher": ("device_type", "device_module"),
    "torchtitan.tools.profiler": ("device_module",),
}


class CpuDevice:
    """torchtitan's `device_module` on the CPU: torch.cpu, with the device index a GPU module gives, and what
    torchtitan's memory monitor asks (names, capacity, peak statistics: the CPU keeps none, so every statistic
    reads as absent, -1)."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device():
        return 0  # torch.cpu's is "cpu", which torchtitan's barrier(device_ids=[...]) cannot take

    @staticmethod
    def get_device_name(device=None):
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return type("CpuProperties", (), {"name": "cpu", "total_memory": memory})()

    @staticmethod
    def memory_stats(device=None):
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None):
        pass

    @staticmethod
    def empty_cache():
        pass


def use_cpu_device():
    """Points torchtitan's device at the CPU, process-wide (the module's text)."""
    values = {"device_type": "cpu", "device_module": CpuDevice()}
    for module_name, names in _DEVICE_NAMES.items():
        module = importlib.import_module(module_name)
        for name in names:
            setattr(module, name, values[name])


def sum_reduction(parallelize_fn):
    """parallelize_fn with its FSDP2 modules reducing by SUM (gloo has no PREMUL_SUM; the same sum, since
    torchtitan's divide factor is 1.0)."""

    def parallelize(model, **kwargs):
        model = parallelize_fn(model, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize


def on_cpu(config):
    """A torchtitan Trainer.Config (or a subclass's) made to train on the CPU (the module's text): returns it,
    its model spec's FlexAttention as SDPA and its parallelize function reducing by SUM; torchtitan's device
    pointed at the CPU."""
    use_cpu_device()
    spec = config.model_spec
    model = spec.model
    for _, _, parent, attr in list(model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    config.model_spec = dataclasses.replace(spec, model=model, parallelize_fn=sum_reduction(spec.parallelize_fn))
    return config
