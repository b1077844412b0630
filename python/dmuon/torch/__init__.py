"""dmuon for PyTorch: DMuon, a drop-in torch.optim optimizer (docs/pytorch.md)."""

from dmuon.torch.layout import Sharded, chunk_rows
from dmuon.torch.optimizer import DMuon
from dmuon.torch.owner_held import HeldMatrices, hold_on_owners

__all__ = ["DMuon", "HeldMatrices", "Sharded", "chunk_rows", "hold_on_owners"]
