"""The Muon variants, by the name a param group's `variant` option gives (muon_options.py): each a module with one
Variant (base.py states the protocol). A new variant is one module here and its name in VARIANTS
(docs/ARCHITECTURE.md, "Where things plug in (Python)")."""

from dmuon.torch.variants.base import Muon
from dmuon.torch.variants.normuon import NorMuon

VARIANTS = {"muon": Muon(), "normuon": NorMuon()}


def variant_of(options):
    """The Variant of a MuonOptions (its `variant` name)."""
    return VARIANTS[options.variant]
