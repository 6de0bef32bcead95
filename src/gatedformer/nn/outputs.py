"""What every model's ``forward`` returns: its outputs by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = ["ModelOutput"]


@dataclass
class ModelOutput:
    """A model's outputs by name.

    ``logits``: the scores over the vocabulary (or the classes), ``(..., V)``; ``None`` when the model was given
    ``targets``, whose loss is then computed from the hidden states without keeping the logits (they are the largest
    tensor of a small language model's step). ``loss``: the cross-entropy against ``targets`` (with the reduction
    asked for), ``None`` without targets. ``state``: what a language model carries to the next window of the same
    batch (Transformer-XL's memories, an SRU's cells), ``None`` for the others.
    """

    logits: Tensor | None = None
    loss: Tensor | None = None
    state: Any = None
