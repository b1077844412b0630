"""torchtitan's Trainer for owner-held matrices (docs/integrations.md, "torchtitan's Trainer"). Imports
torchtitan.trainer, whose imports (torchdata, tensorboard, datasets) python/requirements-titan-trainer.txt pins;
tested with torchtitan 0.3.0.

Trainer.train_step measures and clips the gradients with torchtitan's clip_grad_norm_ (torch's total norm),
which cannot read an owner-held gradient beside FSDP2's DTensors: the held ones are plain tensors on their
owner and placeholders elsewhere ("aten._foreach_norm.Scalar got mixed torch.Tensor and DTensor" at step 1).
DMuonTrainer is the Trainer whose train_step, on a model with owner-held matrices, clips with
dmuon.torch.clip_grad_norm_ instead: the single-process norm on every rank (the stages' sums added over
torchtitan's "pp" mesh under pipeline parallelism), clipping to training.max_norm as torchtitan's. It is
Trainer.train_step itself, run with the one name `dist_utils` it reads clip_grad_norm_ from resolved to
_DmuonClipping (everything else in it is torchtitan's code, unchanged); a model without held matrices takes
Trainer.train_step as it is. Use DMuonTrainer.Config where a config_registry function returns Trainer.Config;
dmuon.torch.titan.owner_held refuses the plain Trainer at build time.
"""

import dataclasses
import types

from torchtitan.distributed import utils as dist_utils
from torchtitan.trainer import Trainer

from dmuon.torch.clip import clip_grad_norm_
from dmuon.torch.titan import held_parameters


class _DmuonClipping:
    """torchtitan.distributed.utils as DMuonTrainer's train_step reads it: the module, with its clip_grad_norm_
    dmuon.torch.clip_grad_norm_ under torchtitan's signature."""

    def __getattr__(self, name):
        return getattr(dist_utils, name)

    @staticmethod
    def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None, pp_mesh=None,
                        ep_enabled=False):
        # foreach: torch's kernel choice; ep_enabled: torchtitan's split of the expert parameters' norm, which
        # dmuon's takes by mesh (each mesh's DTensors summed on their own)
        return clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite,
                               pipeline_group=None if pp_mesh is None else pp_mesh.get_group())


def _with_dmuon_clipping(train_step):
    """train_step (Trainer.train_step) with its global `dist_utils` resolved to _DmuonClipping."""
    if "dist_utils" not in train_step.__code__.co_names or train_step.__closure__:
        raise ImportError("dmuon.torch.titan_trainer: this torchtitan's Trainer.train_step does not clip through "
                          "the module global dist_utils (torchtitan 0.3.0's); DMuonTrainer needs that version")
    return types.FunctionType(train_step.__code__, {**train_step.__globals__, "dist_utils": _DmuonClipping()},
                              train_step.__name__, train_step.__defaults__)


_held_train_step = _with_dmuon_clipping(Trainer.train_step)


class DMuonTrainer(Trainer):
    """torchtitan's Trainer that clips owner-held gradients (the module's text)."""

    clips_held_matrices = True  # read by dmuon.torch.titan.owner_held, which refuses any other Trainer

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        """Trainer.Config, built as DMuonTrainer (torchtitan wires build() to the declaring class)."""

    def __init__(self, config):
        super().__init__(config)
        self.has_held_matrices = any(held_parameters(m) for m in self.model_parts)

    def train_step(self, data_iterator):
        if self.has_held_matrices:
            return _held_train_step(self, data_iterator)
        return super().train_step(data_iterator)
