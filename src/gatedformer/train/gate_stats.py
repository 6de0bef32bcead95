"""Gate activation statistics and learned gate biases, read off a model from the outside.

Gates know nothing of training: every gate unit offers ``gate_activation(x)`` and ``gate_bias``
(see :mod:`gatedformer.gates`), and this module uses forward hooks to record them while a model is
evaluated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from gatedformer.gates import GateUnit


def gate_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every gate unit in ``model`` by its qualified name, e.g. ``layers.0.attn.sdu``."""
    return {name: module for name, module in model.named_modules() if isinstance(module, GateUnit)}


def gate_biases(model: nn.Module) -> dict[str, torch.Tensor]:
    """The learned gate bias (b1) of every gate, as CPU float32 copies keyed by module name."""
    return {name: module.gate_bias.detach().float().cpu().clone() for name, module in gate_modules(model).items()}


class GateStatistics:
    """Mean and standard deviation of every gate's activation over the inputs it saw."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = gate_modules(model)
        self._sums: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[GateStatistics]:
        """Record activations during the ``with`` block (e.g. one evaluation pass)."""
        self._sums = {name: [0.0, 0.0, 0.0] for name in self.modules}
        handles = [module.register_forward_hook(self._hook(name)) for name, module in self.modules.items()]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, name: str):
        def record(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            with torch.no_grad():
                activation = module.gate_activation(inputs[0]).float()
                sums = self._sums[name]
                sums[0] += activation.sum().item()
                sums[1] += activation.square().sum().item()
                sums[2] += activation.numel()

        return record

    def summary(self) -> dict[str, dict[str, float]]:
        """``{name: {"mean": m, "std": s}}`` for every gate that saw any input."""
        out = {}
        for name, (total, squares, count) in self._sums.items():
            if count:
                mean = total / count
                out[name] = {"mean": mean, "std": max(squares / count - mean * mean, 0.0) ** 0.5}
        return out
