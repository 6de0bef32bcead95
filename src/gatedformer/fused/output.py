"""The fused output loss: :class:`~gatedformer.nn.output.OutputLayer`'s cross-entropy without the logits tensor and
its copies (:func:`gatedformer.ops.output_loss.linear_cross_entropy`)."""

from __future__ import annotations

from torch import Tensor

from gatedformer.fused.registry import implements
from gatedformer.nn.output import OutputLayer
from gatedformer.ops.output_loss import linear_cross_entropy, logits_cross_entropy

__all__ = ["output_loss"]


@implements(OutputLayer, "loss")
def output_loss(self: OutputLayer, hidden: Tensor, targets: Tensor, ignore_index: int = -100,
                reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """The loss by :func:`~gatedformer.ops.output_loss.linear_cross_entropy`; a layer with hooks of its own is called
    as a module (its hooks see the logits)."""
    if self._forward_hooks or self._forward_pre_hooks or self._backward_hooks or self._backward_pre_hooks:
        return logits_cross_entropy(self(hidden), targets, ignore_index, reduction, label_smoothing)
    return linear_cross_entropy(hidden, self.weight, self.bias, targets, ignore_index, reduction, label_smoothing)
