"""Draft proposers for speculative decoding (see base.Proposer for the interface)."""

from specrl.runtime.engine.proposers.base import DraftContext, Proposal, Proposer
from specrl.runtime.engine.proposers.draft_model import DraftModelProposer
from specrl.runtime.engine.proposers.layer_skip import LayerSkipProposer
from specrl.runtime.engine.proposers.ngram import NgramProposer
from specrl.runtime.engine.proposers.quantized_self import QuantizedSelfProposer

try:  # eagle lands separately
    from specrl.runtime.engine.proposers.eagle import EagleHead, EagleProposer
except ImportError:  # pragma: no cover
    pass

__all__ = ["DraftContext", "DraftModelProposer", "EagleHead", "EagleProposer", "LayerSkipProposer",
           "NgramProposer", "Proposal", "Proposer", "QuantizedSelfProposer"]
