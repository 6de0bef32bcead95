"""``optim.name = "adamax"``: torch's Adamax (Kingma and Ba 2015, §7.1), the optimiser of DrQA's reader and of the
SRU paper's, built by the trainer with the config's rate, betas and weight decay (not on 1-D parameters), and
resumed from a checkpoint to the same losses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gatedformer.config import OptimConfig, RunConfig, apply_overrides, validate
from gatedformer.train.optim import build_optimizer


def test_the_config_accepts_adamax_and_the_trainer_builds_it() -> None:
    config = validate(apply_overrides(RunConfig(), ["optim.name=adamax", "optim.lr=0.002", "optim.beta2=0.99"]))
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    optimizer = build_optimizer(model, config.optim)
    assert type(optimizer) is torch.optim.Adamax
    assert [(g["lr"], g["betas"]) for g in optimizer.param_groups] == [(0.002, (0.9, 0.99))] * 2


def test_one_step_is_adamax_by_hand() -> None:
    """u = max(beta2 * u, |g| + eps); p -= lr / (1 - beta1^t) * m / u, with L2 decay on matrices only."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = build_optimizer(model, OptimConfig(name="adamax", lr=0.01, beta1=0.8, beta2=0.9,
                                                   weight_decay=0.5))
    model(torch.randn(5, 3)).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    for p, p0, g, decay in zip(model.parameters(), before, grads, (0.5, 0.0), strict=True):
        g = g + decay * p0
        m, u = (1 - 0.8) * g, g.abs() + 1e-8
        assert torch.allclose(p.detach(), p0 - 0.01 / (1 - 0.8) * m / u, atol=1e-7)


def test_an_unknown_optimiser_names_adamax_among_the_choices() -> None:
    from gatedformer.errors import ConfigError

    with pytest.raises(ConfigError, match="adamax"):
        validate(apply_overrides(RunConfig(), ["optim.name=adamaxx"]))
