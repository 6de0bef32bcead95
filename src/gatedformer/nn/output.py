"""A model's output layer: the logits, and their cross-entropy against targets."""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn import functional as F

__all__ = ["OutputLayer"]


class OutputLayer(nn.Linear):
    """``logits = h W^T + b`` over the vocabulary (or the classes): an :class:`torch.nn.Linear` (the same parameters
    and state-dict keys), with the cross-entropy of its logits as a method of its own so that a fused
    implementation can compute that loss without the logits (:mod:`gatedformer.fused.output`)."""

    def loss(self, hidden: Tensor, targets: Tensor, ignore_index: int = -100, reduction: str = "mean",
             label_smoothing: float = 0.0) -> Tensor:
        """The cross-entropy of ``self(hidden)`` ``(..., V)`` against ``targets`` (``hidden``'s leading shape), over
        every position that is not ``ignore_index``; ``reduction`` ``"mean"`` or ``"sum"``."""
        logits = self(hidden)
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index,
                               reduction=reduction, label_smoothing=label_smoothing)
