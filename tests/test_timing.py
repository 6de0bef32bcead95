"""Where a run's time goes: the first step apart, the whole run, and validation curves that compare like with like."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import tiny_overrides

from gatedformer.config import RunConfig, apply_overrides
from gatedformer.train.clock import TrainingClock
from gatedformer.train.loop import RunResult, train
from gatedformer.train.runlog import eval_series, read_log


def test_the_first_step_of_each_start_is_setup_not_a_training_step() -> None:
    clock = TrainingClock()
    clock.add_step(9.0, 100)  # kernels built on first use
    clock.add_step(1.0, 100)
    clock.add_step(3.0, 100)
    assert clock.setup_seconds == 9.0 and clock.step_seconds == 4.0 and clock.timed_steps == 2
    assert clock.seconds_per_step(3) == 2.0 and clock.tokens_per_second == 50.0

    saved = json.loads(json.dumps(clock.state()))
    resumed = TrainingClock(saved, steps=3, tokens=300)
    resumed.add_step(5.0, 100)  # a new process builds its kernels again
    resumed.add_step(2.0, 100)
    assert resumed.setup_seconds == 14.0 and resumed.timed_steps == 3 and resumed.seconds_per_step(5) == 2.0
    assert resumed.wall_seconds >= saved["wall_seconds"] > 0


def test_a_checkpoint_from_before_the_clock_counts_every_step_as_timed() -> None:
    clock = TrainingClock({"train_seconds": 6.0}, steps=3, tokens=30)
    assert clock.seconds_per_step(3) == 2.0 and clock.tokens_per_second == 5.0 and clock.setup_seconds == 0.0
    assert TrainingClock().seconds_per_step(0) == 0.0


def test_a_run_of_one_step_per_start_reports_its_setup_step() -> None:
    clock = TrainingClock()
    clock.add_step(0.5, 10)
    assert clock.seconds_per_step(1) == 0.5 and clock.tokens_per_second == 0.0


def test_a_slow_first_step_stays_out_of_the_time_per_step(text_corpus: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from gatedformer.train import loop

    optimise, calls = loop.optimise, []

    def first_step_builds_kernels(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.5)
        return optimise(*args, **kwargs)

    monkeypatch.setattr(loop, "optimise", first_step_builds_kernels)
    config = apply_overrides(RunConfig(), tiny_overrides(text_corpus, steps=6))
    result = train(config, tmp_path / "run", progress=False)
    assert result is not None
    assert result.setup_seconds >= 0.5 > result.seconds_per_step * 5
    assert result.seconds_per_step == pytest.approx(result.train_seconds / 5)
    assert result.wall_seconds > result.setup_seconds + result.train_seconds
    assert result.steps_per_epoch > 0
    assert all(r["time"] <= result.train_seconds for r in read_log(tmp_path / "run") if "time" in r)


def test_results_from_before_the_clock_still_load(tmp_path: Path) -> None:
    old = {"run_dir": str(tmp_path), "corpus": "ptb-char", "metric": "bpc", "valid_loss": 1.0, "valid_metric": 1.4,
           "test_loss": 1.0, "test_metric": 1.4, "params": 10, "steps": 4, "seconds_per_step": 0.1,
           "train_seconds": 0.4, "tokens_per_second": 100.0}
    (tmp_path / "results.json").write_text(json.dumps(old))
    result = RunResult.load(tmp_path)
    assert result.wall_seconds == 0.0 and result.setup_seconds == 0.0 and result.steps_per_epoch == 0


@pytest.mark.parametrize("part_key, metric", [("valid_windows", "valid_bpc"), ("bleu_sentences", "valid_bleu")])
def test_the_curve_keeps_evaluations_of_the_same_part_of_the_split(part_key: str, metric: str) -> None:
    records = [{"event": "eval", "step": s, "time": s / 10, metric: v, part_key: n}
               for s, v, n in ((10, 3.0, 20), (20, 2.5, 20), (30, 2.0, 20), (30, 2.6, 400))]
    records.insert(1, {"event": "train", "step": 15, "train_loss": 1.0})
    (steps, values), last = eval_series(records, metric)
    assert steps == [10, 20, 30] and values == [3.0, 2.5, 2.0] and last == (30, 2.6)
    (times, _), last = eval_series(records, metric, x="time")
    assert times == [1.0, 2.0, 3.0] and last == (3.0, 2.6)
    every_time_whole = [dict(r, **{part_key: 400}) for r in records if r["event"] == "eval"]
    assert eval_series(every_time_whole, metric)[1] is None
    assert eval_series([], metric) == (([], []), None)
