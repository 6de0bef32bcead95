"""Mixed precision: fp16 with a gradient scaler is refused on the CPU with one line; its code path (scaled backward,
unscaled clipping, overflow skipping) and the scaler's checkpoint round trip run on the CPU with torch's CPU
GradScaler. Training, resuming and comparing under fp16 on a GPU is in test_cuda.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides

from gatedformer.cli import main
from gatedformer.config import RunConfig, build_config, load_recipe
from gatedformer.errors import ConfigError
from gatedformer.train.checkpoint import load_checkpoint, save_checkpoint
from gatedformer.train.distributed import DistContext
from gatedformer.train.loop import RunState, backward, optimise, train


def test_fp16_on_the_cpu_is_refused_with_one_line(text_corpus: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    config = build_config(load_recipe("ptb-char-tiny"), [*tiny_overrides(text_corpus), "train.precision=fp16"])
    with pytest.raises(ConfigError, match="train.precision=fp16 .* needs a CUDA GPU"):
        train(config, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / "log.jsonl").exists()
    args = [a for o in tiny_overrides(text_corpus) for a in ("--set", o)]
    assert main(["train", "--recipe", "ptb-char-tiny", "--out", str(tmp_path / "cli"), "--quiet", *args,
                 "--set", "train.precision=fp16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use train.precision=bf16" in err[0]
    with pytest.raises(ConfigError, match="train.precision"):
        build_config(load_recipe("ptb-char-tiny"), ["train.precision=fp8"])


class _Schedule:
    steps = 0

    def step(self) -> None:
        self.steps += 1


def _setup(scale: float) -> tuple[torch.nn.Linear, torch.optim.Optimizer, torch.amp.GradScaler]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu", init_scale=scale)


def _step(loss: torch.Tensor, model: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule: _Schedule,
          config: RunConfig, out_dir: Path, scaler: torch.amp.GradScaler | None) -> tuple[float, bool]:
    """The loop's backward pass and update of one step, on a model outside a run."""
    scaler = scaler if scaler is not None else torch.amp.GradScaler("cpu", enabled=False)
    run = RunState(config=config, task=None, out_dir=out_dir, ddp=DistContext(), data=None, metric="", model=model,
                   optimizer=optimizer, scheduler=schedule, scaler=scaler, params=0, files_sha256={})
    backward(loss, scaler)
    return optimise(run, loss.detach())


def test_the_scaled_step_equals_the_unscaled_one(tmp_path: Path) -> None:
    config = build_config(load_recipe("ptb-char-tiny"), ["optim.clip=0.5"])
    x = torch.randn(4, 3)
    plain, plain_opt, _ = _setup(1.0)
    scaled, scaled_opt, scaler = _setup(2.0**12)
    for model, optimizer, grad_scaler in ((plain, plain_opt, None), (scaled, scaled_opt, scaler)):
        value, stepped = _step(model(x).square().mean(), model, optimizer, _Schedule(), config, tmp_path,
                               grad_scaler)
        assert stepped and value > 0
    # the gradients were unscaled before clipping: the same update
    for a, b in zip(plain.parameters(), scaled.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert scaler.get_scale() == 2.0**12 and scaler.state_dict()["_growth_tracker"] == 1


def test_an_overflow_skips_the_update_and_lowers_the_scale(tmp_path: Path) -> None:
    config = build_config(load_recipe("ptb-char-tiny"), [])
    model, optimizer, scaler = _setup(2.0**12)
    before = [p.detach().clone() for p in model.parameters()]
    schedule = _Schedule()
    loss = model.weight.sum() * 1e36  # finite, but its gradients times the scale overflow float32
    value, stepped = _step(loss, model, optimizer, schedule, config, tmp_path, scaler)
    assert not stepped and schedule.steps == 1  # not an error: the scaler's business
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler.get_scale() == 2.0**11


def test_the_scaler_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    model, optimizer, scaler = _setup(2.0**10)
    scaler.scale(torch.ones(()))  # the scale exists once a loss was scaled
    scaler.update(2.0**7)
    state = {"optimizer": optimizer.state_dict(), "scheduler": {}, "scaler": scaler.state_dict()}
    meta = {"step": 3, "tokens_seen": 30, "loss_sum": 1.0, "loss_count": 3, "train_seconds": 1.0,
            "setup_seconds": 0.1, "wall_seconds": 1.2}
    path = save_checkpoint(tmp_path, 3, model, state, meta)
    restored = torch.amp.GradScaler("cpu")
    restored.load_state_dict(load_checkpoint(path).trainer_state["scaler"])
    assert restored.state_dict() == scaler.state_dict() and restored.get_scale() == 2.0**7
