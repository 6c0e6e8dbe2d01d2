"""Draft proposers for speculative decoding (see base.Proposer for the interface)."""

from .base import DraftContext, Proposal, Proposer
from .draft_model import DraftModelProposer
from .layer_skip import LayerSkipProposer
from .ngram import NgramProposer
from .quantized_self import QuantizedSelfProposer

try:  # eagle lands separately
    from .eagle import EagleHead, EagleProposer
except ImportError:  # pragma: no cover
    pass

__all__ = ["DraftContext", "DraftModelProposer", "EagleHead", "EagleProposer", "LayerSkipProposer",
           "NgramProposer", "Proposal", "Proposer", "QuantizedSelfProposer"]
