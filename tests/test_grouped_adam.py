"""GroupedAdam against PyTorch's Adam and AdamW, its state dicts both ways, clipping, and the trainer's use of it."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from gatedformer.config import OptimConfig
from gatedformer.train.checkpoint import model_state_for_saving
from gatedformer.train.grouped_adam import GroupedAdam
from gatedformer.train.optim import build_optimizer, clip_gradients


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 283), nn.LayerNorm(283), nn.ReLU(), nn.Linear(283, 3), nn.Embedding(3, 283))


def _groups(model: nn.Module, weight_decay: float = 0.1) -> list[dict]:
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model[:4](x).square().sum() + model[4].weight.sin().sum())


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1,
           drop: tuple[int, int] | None = None) -> None:
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        optimizer.zero_grad()
        _loss(model, torch.randn(4, 5, generator=generator)).backward()
        if drop is not None and step == drop[0]:
            list(model.parameters())[drop[1]].grad = None  # no gradient this step: the parameter must not move
        optimizer.step()


def _max_difference(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("decoupled", [False, True])
def test_matches_torch_adam_step_for_step(decoupled: bool) -> None:
    reference, flat = _model(), _model()
    torch_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    _train(reference, torch_class(_groups(reference), lr=1e-2, fused=True), 5)
    optimizer = GroupedAdam(_groups(flat), lr=1e-2, decoupled_weight_decay=decoupled)
    _train(flat, optimizer, 5)
    assert _max_difference(reference, flat) == 0.0  # the same kernel on the same tensors
    steps = {optimizer.state[p]["step"].untyped_storage().data_ptr() for p in flat.parameters()}
    assert len(steps) == 2  # one counter per group


@settings(max_examples=12, deadline=None)
@given(dropped_step=st.integers(0, 4), dropped=st.integers(0, 6), decoupled=st.booleans())
def test_a_parameter_without_a_gradient_is_skipped_as_torch_skips_it(dropped_step: int, dropped: int,
                                                                      decoupled: bool) -> None:
    reference, flat = _model(), _model()
    torch_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    torch_optimizer = torch_class(_groups(reference), lr=1e-2, fused=True)
    optimizer = GroupedAdam(_groups(flat), lr=1e-2, decoupled_weight_decay=decoupled)
    _train(reference, torch_optimizer, 6, drop=(dropped_step, dropped))
    _train(flat, optimizer, 6, drop=(dropped_step, dropped))
    assert _max_difference(reference, flat) < 1e-7
    steps = [optimizer.state[p]["step"].item() for p in flat.parameters()]
    assert steps == [torch_optimizer.state[p]["step"].item() for p in reference.parameters()]
    assert steps[dropped] == 5.0


def _round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("direction", ["torch-to-flat", "flat-to-torch", "flat-to-flat"])
def test_state_dicts_load_both_ways(direction: str) -> None:
    def make(kind: str, model: nn.Module) -> torch.optim.Optimizer:
        if kind == "torch":
            return torch.optim.AdamW(_groups(model), lr=1e-2, fused=True)
        return GroupedAdam(_groups(model), lr=1e-2, decoupled_weight_decay=True)

    first, second = direction.split("-to-")
    uninterrupted = _model()
    _train(uninterrupted, make(second, uninterrupted), 6)
    resumed = _model()
    before = make(first, resumed)
    _train(resumed, before, 3)
    weights = copy.deepcopy(resumed.state_dict())
    restarted = _model(seed=7)  # other weights: the loaded ones must replace them, in the flat buffer too
    after = make(second, restarted)
    restarted.load_state_dict(weights)
    after.load_state_dict(_round_trip(before.state_dict()))
    _train(restarted, after, 3, seed=2)
    _train(resumed, before, 3, seed=2)
    assert _max_difference(resumed, restarted) < 1e-7


def test_clip_grad_norm_matches_torch() -> None:
    reference, flat = _model(), _model()
    optimizer = GroupedAdam(_groups(flat), lr=1e-2)
    x = torch.randn(4, 5)
    for model in (reference, flat):
        _loss(model, x).backward()
    for max_norm in (0.5, float("inf")):
        expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        got = optimizer.clip_grad_norm_(max_norm)
        assert torch.allclose(got, expected, rtol=1e-5)
        for p, q in zip(reference.parameters(), flat.parameters(), strict=True):
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-8)


def test_gradients_accumulate_without_set_to_none() -> None:
    reference, flat = _model(), _model()
    torch_optimizer = torch.optim.Adam(_groups(reference), lr=1e-2, fused=True)
    optimizer = GroupedAdam(_groups(flat), lr=1e-2)
    x = torch.randn(4, 5)
    for model, opt in ((reference, torch_optimizer), (flat, optimizer)):
        for _ in range(3):
            opt.zero_grad(set_to_none=False)
            _loss(model, x).backward()
            _loss(model, x).backward()  # two backward passes: the gradients add up
            opt.step()
    assert _max_difference(reference, flat) < 1e-6
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in flat.parameters())


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="lr"):
        GroupedAdam(_model().parameters(), lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        GroupedAdam(_model().parameters(), betas=(0.9, 1.0))
    mixed = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    with pytest.raises(ValueError, match="one float dtype"):
        GroupedAdam(mixed)


def test_the_trainer_builds_it_and_clips_with_it() -> None:
    model = _model()
    model[4].weight = model[3].weight  # tied: one parameter under two names
    optimizer = build_optimizer(model, OptimConfig(name="adamw", lr=1e-2, weight_decay=0.1))
    assert isinstance(optimizer, GroupedAdam)
    _loss(model, torch.randn(4, 5)).backward()
    before = [p.grad.clone() for p in model.parameters()]
    norm = clip_gradients(model, optimizer, 1e-3)
    assert torch.allclose(norm, torch.linalg.vector_norm(torch.stack([g.norm() for g in before])), rtol=1e-5)
    assert all(torch.allclose(p.grad, g * 1e-3 / (norm + 1e-6), rtol=1e-4)
               for p, g in zip(model.parameters(), before, strict=True))


def test_weights_that_share_one_buffer_are_all_saved_each_in_storage_of_its_own() -> None:
    model = _model()
    model[4].weight = model[3].weight  # tied: one parameter under two names
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    for p, view in zip(params, flat.split([p.numel() for p in params]), strict=True):
        p.data = view.view_as(p)  # as flat-buffer optimisers and FSDP leave them
    saved = model_state_for_saving(model)
    assert set(saved) == set(model.state_dict()) - {"4.weight"}
    assert all(torch.equal(saved[name], tensor) for name, tensor in model.state_dict().items() if name in saved)
    assert len({t.untyped_storage().data_ptr() for t in saved.values()}) == len(saved)


def test_torch_adam_is_kept_where_a_group_mixes_dtypes() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3).double())
    optimizer = build_optimizer(model, OptimConfig(name="adam"))
    assert type(optimizer) is torch.optim.Adam
