"""dmuon for PyTorch: DMuon, a drop-in torch.optim optimizer (docs/pytorch.md)."""

from dmuon.torch.clip import clip_grad_norm_
from dmuon.torch.held.hold import HeldMatrices, hold_on_owners
from dmuon.torch.held.placeholder import HeldElsewhereError
from dmuon.torch.layout import Sharded, chunk_rows
from dmuon.torch.optimizer import DMuon
from dmuon.torch.qk_clip import Attention, FusedAttention, LatentAttention, QKClip
from dmuon.torch.qk_clip_hf import hf_qk_clip

__all__ = ["Attention", "DMuon", "FusedAttention", "HeldElsewhereError", "HeldMatrices", "LatentAttention", "QKClip",
           "Sharded", "chunk_rows", "clip_grad_norm_", "hf_qk_clip", "hold_on_owners"]
