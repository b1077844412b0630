"""dmuon for PyTorch: DMuon, a drop-in torch.optim optimizer (docs/pytorch.md)."""

from dmuon.torch.layout import Sharded, chunk_rows
from dmuon.torch.optimizer import DMuon

__all__ = ["DMuon", "Sharded", "chunk_rows"]
