"""The part the highway gate and the gated MHDPA share: ``(1 - T(X)) ⊙ carry + T(X) ⊙ f(X)``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._checks import check_size


class TransformGate(nn.Module):
    r"""``T(X) = σ(X W_1 + b_1)`` and ``f(X) = X W_2 + b_2`` from one ``Linear(d, 2d)`` (first half: gate,
    second half: transform), mixing a carried tensor with ``f(X)``; the subclasses say what is carried."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.d_model = check_size("d_model", d_model)
        self.proj = nn.Linear(d_model, 2 * d_model)
        nn.init.zeros_(self.proj.bias)

    def _mix(self, carry: Tensor, x: Tensor) -> Tensor:
        """``(1 - T(x)) ⊙ carry + T(x) ⊙ f(x)``."""
        pre_gate, transformed = self.proj(x).chunk(2, dim=-1)
        t = torch.sigmoid(pre_gate)
        # lerp needs one dtype; under autocast the carried tensor may be float32 and the projection bf16.
        dtype = torch.promote_types(carry.dtype, transformed.dtype)
        # carry + t * (f - carry) is algebraically (1 - t) carry + t f with one fewer element-wise op.
        return torch.lerp(carry.to(dtype), transformed.to(dtype), t.to(dtype))

    def gate_activation(self, x: Tensor) -> Tensor:
        """``T(X) = sigmoid(X W1 + b1)``; computes only the gate half of the projection."""
        d = self.d_model
        return torch.sigmoid(nn.functional.linear(x, self.proj.weight[:d], self.proj.bias[:d]))

    @property
    def gate_bias(self) -> Tensor:
        """``b1``: a detached view that shares storage with the fused bias parameter."""
        return self.proj.bias.detach()[: self.d_model]

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}"
