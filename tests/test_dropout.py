"""The fast CPU dropout: Bernoulli masks seeded by torch's generator, scaled so the expectation holds."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gatedformer.backbones.dropout import Dropout, dropout, keep_mask, relu_dropout


def test_masks_follow_torch_seed_and_keep_probability() -> None:
    torch.manual_seed(3)
    a = keep_mask((400, 500), 0.25)
    torch.manual_seed(3)
    b = keep_mask((400, 500), 0.25)
    assert torch.equal(a, b)
    assert not torch.equal(a, keep_mask((400, 500), 0.25))  # the generator moved on
    kept = (a > 0).float().mean().item()
    assert kept == pytest.approx(0.75, abs=0.005)  # 200,000 draws: ~6 standard deviations
    assert a.unique().tolist() == [0.0, pytest.approx(1 / 0.75)]
    assert a.mean().item() == pytest.approx(1.0, abs=0.01)


def test_dropout_module_is_a_torch_dropout() -> None:
    layer = Dropout(0.3)
    assert isinstance(layer, nn.Dropout) and layer.p == 0.3
    x = torch.randn(64, 32, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    mask = y.detach() / x.detach()
    kept = y != 0
    assert torch.allclose(mask[kept], torch.full_like(mask[kept], 1 / 0.7))
    assert torch.equal(x.grad, torch.where(kept, torch.tensor(1 / 0.7), torch.tensor(0.0)))
    layer.eval()
    assert layer(x) is x
    assert dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))


def test_dtype_is_kept() -> None:
    x = torch.randn(8, 8, dtype=torch.bfloat16)
    assert Dropout(0.5)(x).dtype == torch.bfloat16
    assert keep_mask((3, 4), 0.5, torch.float64).dtype == torch.float64


def test_relu_dropout_is_dropout_of_relu() -> None:
    x = torch.randn(256, 64, requires_grad=True)
    torch.manual_seed(0)
    fused = relu_dropout(x, 0.2)
    fused.sum().backward()
    kept = fused.detach() != 0
    assert torch.equal(kept & (x.detach() <= 0), torch.zeros_like(kept))  # never keeps a non-positive input
    assert torch.allclose(fused[kept], x.detach()[kept] / 0.8)
    assert torch.equal(x.grad != 0, kept)
    assert (kept.sum() / (x > 0).sum()).item() == pytest.approx(0.8, abs=0.03)
    assert torch.equal(relu_dropout(x, 0.2, training=False), x.relu())
