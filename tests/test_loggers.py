"""The run log's one interface (train/loggers.py): log.jsonl, TensorBoard and Weights & Biases take the same
records; W&B offline (no network) and through a fake module that records what it is given."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
from conftest import tiny_overrides

from gatedformer.cli import main
from gatedformer.config import build_config, load_recipe
from gatedformer.train.loggers import CallbackLog, JsonlLog, RunLogger, open_loggers
from gatedformer.train.loop import train
from gatedformer.train.tensorboard import TensorBoardLog


class _FakeRun:
    logged: list = []
    finished = 0

    def log(self, scalars: dict, step: int) -> None:
        self.logged.append((dict(scalars), step))

    def finish(self) -> None:
        _FakeRun.finished += 1


def _fake_wandb(inits: list) -> types.ModuleType:
    fake = types.ModuleType("wandb")

    def init(**kwargs: object) -> _FakeRun:
        inits.append(kwargs)
        return _FakeRun()

    fake.init = init
    return fake


def test_every_logger_implements_the_one_interface(tmp_path: Path) -> None:
    assert all(issubclass(cls, RunLogger) for cls in (JsonlLog, CallbackLog, TensorBoardLog))
    config = build_config(load_recipe("ptb-char-tiny"), [])
    seen: list = []
    loggers = open_loggers(config, tmp_path, tmp_path / "log.jsonl", seen.append)
    assert [type(logger) for logger in loggers] == [JsonlLog, CallbackLog]
    for logger in loggers:
        logger.record({"event": "train", "step": 1, "loss": 2.0})
    assert json.loads((tmp_path / "log.jsonl").read_text()) == seen[0] == {"event": "train", "step": 1, "loss": 2.0}


def test_wandb_gets_the_log_and_resumes_the_same_run(text_corpus: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    inits: list = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(inits))
    _FakeRun.logged, _FakeRun.finished = [], 0
    config = build_config(load_recipe("ptb-char-tiny"), [*tiny_overrides(text_corpus, steps=4), "train.eval_every=2",
                                                         "model.gates=+σ SDU", "train.wandb=true",
                                                         "train.wandb_project=gated"])
    assert train(config, tmp_path / "run", progress=False, stop_after=2) is None
    assert train(config, tmp_path / "run", progress=False, resume=True) is not None
    assert [i["project"] for i in inits] == ["gated", "gated"] and inits[0]["id"] == inits[1]["id"]
    assert inits[0]["resume"] == "allow" and inits[0]["config"]["model"]["gates"] == "+σ SDU"
    assert _FakeRun.finished == 2  # each process closed its run
    tags = {tag for scalars, _ in _FakeRun.logged for tag in scalars}
    assert {"train/loss", "valid/loss", "valid/bpc", "test/bpc", "gates/layers.0.attn.sdu/mean"} <= tags
    # the resumed process replays the kept log first, then goes on: steps never go back within a process
    second = [step for _, step in _FakeRun.logged[len(_FakeRun.logged) // 2:]]
    assert second == sorted(second)
    assert sorted({step for scalars, step in _FakeRun.logged if "valid/bpc" in scalars}) == [2, 4]


def test_wandb_missing_is_one_line(text_corpus: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    assert main(["train", "--recipe", "ptb-char-tiny", "--out", str(tmp_path / "run"), "--quiet",
                 *[f"--set={o}" for o in tiny_overrides(text_corpus)], "--set", "train.wandb=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'gatedformer[wandb]'" in err[0]
    assert not (tmp_path / "run" / "log.jsonl").exists()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_offline_writes_its_run_without_a_network(text_corpus: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = build_config(load_recipe("ptb-char-tiny"), [*tiny_overrides(text_corpus, steps=2), "train.wandb=true"])
    train(config, tmp_path / "run", progress=False)
    run_id = (tmp_path / "run" / "wandb" / "run_id").read_text().strip()
    files = list((tmp_path / "run" / "wandb").rglob(f"run-{run_id}.wandb"))
    assert len(files) == 1 and files[0].stat().st_size > 0
