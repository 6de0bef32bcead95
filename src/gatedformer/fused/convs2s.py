"""The fused convolution of ConvS2S (:mod:`gatedformer.models.convs2s`): each block's convolution as one matrix
product over the ``w`` shifted windows of its channels-last input
(:func:`gatedformer.ops.causal_conv.causal_conv1d`), whose backward pass beats ``nn.Conv1d``'s on the CPU. The
numbers are the reference's up to float rounding."""

from __future__ import annotations

from torch import Tensor

from gatedformer.fused.registry import implements
from gatedformer.models.convs2s import ConvGLU
from gatedformer.ops.causal_conv import causal_conv1d

__all__ = ["conv_glu_convolve"]


@implements(ConvGLU, "convolve")
def conv_glu_convolve(self: ConvGLU, x: Tensor) -> Tensor:
    """The reference's causal convolution as matrix products over shifted windows."""
    return causal_conv1d(x, self.conv.weight, self.conv.bias)
