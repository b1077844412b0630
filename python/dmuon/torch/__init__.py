"""dmuon for PyTorch: DMuon, a drop-in torch.optim optimizer (docs/pytorch.md)."""

from dmuon.torch.clip import clip_grad_norm_
from dmuon.torch.held import HeldElsewhereError, HeldMatrices, hold_on_owners
from dmuon.torch.layout import Sharded, chunk_rows
from dmuon.torch.optimizer import DMuon

__all__ = ["DMuon", "HeldElsewhereError", "HeldMatrices", "Sharded", "chunk_rows", "clip_grad_norm_", "hold_on_owners"]
