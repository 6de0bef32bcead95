"""``base + a ⊙ b``, the multiply-add every gate ends in, in the fewest kernels for the grad mode."""

from __future__ import annotations

import torch
from torch import Tensor


def add_product(base: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``base + a ⊙ b``.

    Without gradients it is ``torch.addcmul``, one kernel. With them it is a product and a sum: autograd's
    ``addcmul`` backward scales each factor by the ``value`` argument before multiplying by the gradient, four
    products where two do, so the pair takes four kernels a step where ``addcmul`` takes five. That matters where
    every kernel launch counts (eager training on a GPU, or the PyTorch fallbacks on the CPU).
    """
    if torch.is_grad_enabled() and (base.requires_grad or a.requires_grad or b.requires_grad):
        return base + a * b
    return torch.addcmul(base, a, b)
