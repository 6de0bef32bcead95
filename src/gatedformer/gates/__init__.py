"""Gating units: each works on ``(..., d_model)`` tensors and knows nothing about training.

Every unit with a gate (:class:`SDU`, :class:`HighwayGate`, :class:`GatedMHDPA`, :class:`EAU`,
:class:`GatedResidual`) exposes the same introspection surface, described by :class:`GateUnit`,
so a trainer can record gate statistics and export learned biases without special cases. The units of the later
papers (:class:`SDPAGate` and :class:`HeadwiseSDPAGate`, the GLU-variant feed-forwards, :class:`GRUGate`,
:class:`ReZero`) are not ``GateUnit``s: none is one sigmoid of the sublayer's input with a bias of its own (the
SDPA gates have no bias, the GRU gate's reads the sublayer's output too); the attention output gates offer
``gate_activation`` (their scores) all the same.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

from torch import Tensor

from .eau import EAU
from .gated_mhdpa import GatedMHDPA
from .glu import GLU, GLUFeedForward
from .glu_variants import FFNGEGLU, FFNGLU, FFNBilinear, FFNReGLU, FFNSwiGLU, GLUVariantFeedForward
from .grc import GatedResidual
from .gru_gate import GRUGate
from .highway import HighwayGate
from .rezero import ReZero
from .sdpa_gate import HeadwiseSDPAGate, SDPAGate
from .sdu import SDU


@runtime_checkable
class GateUnit(Protocol):
    """What every gated unit offers for introspection."""

    kind: ClassVar[str]
    d_model: int

    def gate_activation(self, x: Tensor) -> Tensor:
        """The gate's activation for input ``x`` (same shape as ``x``)."""
        ...

    @property
    def gate_bias(self) -> Tensor:
        """The gate pre-activation bias, detached but sharing storage with the parameter."""
        ...


# Keyed by each class's ``kind`` so a config string or an exported statistic maps back to a class.
GATE_UNITS: dict[str, type] = {cls.kind: cls for cls in (SDU, HighwayGate, GatedMHDPA, EAU, GatedResidual)}

__all__ = [
    "EAU",
    "FFNGEGLU",
    "FFNGLU",
    "GATE_UNITS",
    "GLU",
    "SDU",
    "FFNBilinear",
    "FFNReGLU",
    "FFNSwiGLU",
    "GLUFeedForward",
    "GLUVariantFeedForward",
    "GRUGate",
    "GateUnit",
    "GatedMHDPA",
    "GatedResidual",
    "HeadwiseSDPAGate",
    "HighwayGate",
    "ReZero",
    "SDPAGate",
]
