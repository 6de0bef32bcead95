"""Gating units: each works on ``(..., d_model)`` tensors and knows nothing about training.

Every unit with a gate (:class:`SDU`, :class:`HighwayGate`, :class:`GatedMHDPA`, :class:`EAU`,
:class:`GatedResidual`) exposes the same introspection surface, described by :class:`GateUnit`,
so a trainer can record gate statistics and export learned biases without special cases.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

from torch import Tensor

from .eau import EAU
from .gated_mhdpa import GatedMHDPA
from .glu import GLU, GLUFeedForward
from .grc import GatedResidual
from .highway import HighwayGate
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
    "GATE_UNITS",
    "GLU",
    "SDU",
    "GLUFeedForward",
    "GateUnit",
    "GatedMHDPA",
    "GatedResidual",
    "HighwayGate",
]
