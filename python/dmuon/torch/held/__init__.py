"""The owner-centric mode (DESIGN 7): dmuon.torch.hold_on_owners (hold.py) and what it builds. The package imports
only its placeholder here, so that layout.py can name it without importing the mode."""

from dmuon.torch.held.placeholder import HeldElsewhere, HeldElsewhereError

__all__ = ["HeldElsewhere", "HeldElsewhereError"]
