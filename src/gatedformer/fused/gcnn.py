"""The fused paths of the gated convolutional LM (:mod:`gatedformer.models.gcnn`).

* Each causal convolution as one matrix product over the ``k`` shifted windows of its channels-last input
  (:func:`gatedformer.ops.causal_conv.causal_conv1d`), whose backward pass beats ``nn.Conv1d``'s on the CPU.
* A plain block's GLU and residual add, ``X + a ⊙ σ(b)``, as one compiled pass each way
  (:func:`gatedformer.ops.fused_gates.glu_residual`) unless hooks watch the block.

The numbers are the reference's up to float rounding.
"""

from __future__ import annotations

from torch import Tensor

from gatedformer.fused.registry import implements
from gatedformer.models.gcnn import GatedConvBlock, GatedConvLayer
from gatedformer.ops.causal_conv import causal_conv1d
from gatedformer.ops.fused_gates import glu_residual
from gatedformer.ops.fused_linear import unhooked

__all__ = ["gated_conv_block_forward", "gated_conv_causal_conv"]


@implements(GatedConvLayer, "causal_conv")
def gated_conv_causal_conv(self: GatedConvLayer, x: Tensor) -> Tensor:
    """The reference's causal convolution as one matrix product over shifted windows."""
    return causal_conv1d(x, self.conv.weight, self.conv.bias)


@implements(GatedConvBlock)
def gated_conv_block_forward(self: GatedConvBlock, x: Tensor, cache: list[dict[str, Tensor]] | None = None) -> Tensor:
    """``X + F(X)``; a plain block's GLU and residual add in one pass each way."""
    if len(self.branch) == 1 and unhooked(self.branch) and unhooked(self.branch[0]):
        # One gated convolution: its GLU and the residual add in one pass each way (on the CPU).
        layer = self.branch[0]
        return glu_residual(layer.glu, x, layer.convolve(x, None if cache is None else cache[0]))
    if cache is None:
        return x + self.branch(x)
    h = x
    for layer, layer_cache in zip(self.branch, cache, strict=True):
        h = layer(h, layer_cache)
    return x + h
