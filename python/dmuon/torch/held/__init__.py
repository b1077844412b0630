"""The owner-centric mode (DESIGN 7): dmuon.torch.hold_on_owners and what it builds."""

from dmuon.torch.held.hold import HeldMatrices, hold_on_owners
from dmuon.torch.held.placeholder import HeldElsewhere, HeldElsewhereError

__all__ = ["HeldElsewhere", "HeldElsewhereError", "HeldMatrices", "hold_on_owners"]
