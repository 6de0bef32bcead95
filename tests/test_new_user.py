"""What a new user tripped on (issue 51): each test reproduces one finding and holds the fix to it."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import tiny_overrides

from gatedformer.config import build_config, load_recipe
from gatedformer.train import lossplot
from gatedformer.train.loop import train
from gatedformer.train.progress import PlainProgress, progress_bar

pytestmark = pytest.mark.usefixtures("one_thread")


# --- loss.png reads the metric the task logs -------------------------------------------------------------------

# Each task's log as it writes it: its start record (counts of the splits, some named valid_*), two evaluations and,
# once finished, its test record.
TASK_LOGS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "lm": ("bpc", {"train_windows": 90, "valid_windows": 9}, {"valid_loss": 1.2, "valid_windows": 3, "valid_bpc": 1.7}),
    "translation": ("bleu", {"corpus": "multi30k", "pair": "en-de"},
                    {"valid_loss": 3.1, "valid_bleu": 4.2, "bleu_sentences": 200}),
    "mlm": ("ppl", {"train_windows": 90, "valid_windows": 9, "test_windows": 9},
            {"valid_loss": 5.0, "valid_ppl": 148.4, "valid_accuracy": 0.12, "valid_windows": 4}),
    "glue": ("f1", {"task": "mrpc", "train_examples": 40, "valid_examples": 40, "test_examples": 5},
             {"valid_loss": 0.7, "valid_f1": 0.66, "valid_accuracy": 0.5, "best_valid_metric": 0.66}),
    "sentclass": ("accuracy", {"set": "mr", "train_examples": 90, "valid_examples": 10, "test_examples": 10},
                  {"valid_loss": 0.69, "valid_accuracy": 0.6, "best_valid_accuracy": 0.6}),
}


def _write_log(run: Path, task: str, finished: bool) -> str:
    metric, start, evaluation = TASK_LOGS[task]
    records = [{"event": "data", "step": 0, **start}, {"event": "train", "step": 1, "train_loss": 2.0},
               {"event": "eval", "step": 2, **evaluation}, {"event": "train", "step": 3, "train_loss": 1.5},
               {"event": "eval", "step": 4, **evaluation}]
    if finished:
        records.append({"event": "test", "step": 4, "test_loss": 1.0, f"test_{metric}": 1.0})
        (run / "results.json").write_text(json.dumps({"metric": metric, "valid_metric": 1.0}))
    run.mkdir(exist_ok=True)
    (run / "log.jsonl").write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    return metric


@pytest.mark.parametrize("finished", [True, False])
@pytest.mark.parametrize("task", sorted(TASK_LOGS))
def test_loss_png_right_panel_draws_the_tasks_metric(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, task: str,
                                                     finished: bool) -> None:
    # A sentence-classification run's figure read valid_examples (the start record's count) and drew nothing.
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    metric = _write_log(run, task, finished)
    if finished:
        assert lossplot.metric_of(run) == metric
    else:
        assert lossplot.metric_of(run) not in ("examples", "windows", "loss")
    drawn: list[Any] = []
    save = lossplot._save
    monkeypatch.setattr(lossplot, "_save", lambda fig, path: (drawn.append(fig), save(fig, path))[1])
    assert lossplot.plot_run(run) == run / "loss.png"
    right = drawn[0].axes[1]
    assert len(right.lines[0].get_xdata()) == 2, f"{task}: the right panel ({right.get_title()}) is empty"
    if finished:
        assert right.get_title() == f"valid {metric}"


# --- train() from Python: loss.png, and progress lines off a terminal ------------------------------------------


def test_train_from_python_draws_loss_png_and_prints_plain_progress(text_corpus: str, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    config = build_config(load_recipe("ptb-char-tiny"), tiny_overrides(text_corpus, steps=8))
    train(config, tmp_path / "run")  # progress on (the default); pytest's stderr is not a terminal
    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = capsys.readouterr().err.splitlines()
    assert lines and lines[0] == "run: training 8 steps"
    assert any(line.startswith("run: step 8/8 (100%)") for line in lines)
    assert any("valid" in line and "bpc" in line for line in lines)  # each evaluation has its line
    assert not any("\r" in line for line in lines)  # no bar redrawn in place


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_plain_progress_prints_at_most_every_interval_with_pace_and_time_left() -> None:
    stream, clock = io.StringIO(), _Clock()
    bar = PlainProgress(100, 0, "runs/sdu", stream=stream, every=30.0, clock=clock)
    for _ in range(10):  # 10 steps of 2 s: one line after 30 s, not one a step
        clock.now += 2.0
        bar.update(1)
    assert stream.getvalue().splitlines() == ["runs/sdu: training 100 steps"]
    for _ in range(6):
        clock.now += 2.0
        bar.update(1)
    bar.set_postfix(loss="2.345")
    lines = stream.getvalue().splitlines()
    assert lines[1] == "runs/sdu: step 15/100 (15%), 2 s/step, about 2.8 min left"
    bar.set_postfix(valid="1.234 bpc")  # an evaluation: a line at once
    assert stream.getvalue().splitlines()[2].startswith("runs/sdu: step 16/100 (16%), loss 2.345, valid 1.234 bpc")
    bar.close()
    bar.close()
    assert len(stream.getvalue().splitlines()) == 4


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert isinstance(progress_bar(True, 5, 0, "run"), PlainProgress)
    assert not isinstance(progress_bar(False, 5, 0, "run"), PlainProgress)  # --quiet: nothing
    monkeypatch.setattr("sys.stderr", Terminal())
    bar = progress_bar(True, 5, 0, "run")
    assert not isinstance(bar, PlainProgress) and not bar.disable
    bar.close()


# --- analyze on a translation run ------------------------------------------------------------------------------


def test_analyze_of_a_translation_run_does_not_say_nothing_to_draw_then_draw(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from gatedformer.analysis import attention
    from gatedformer.cli import main

    run = tmp_path / "run"
    run.mkdir()
    config = build_config(load_recipe("multi30k-convs2s-tiny"), [])
    (run / "config.json").write_text(json.dumps(config.to_dict()))
    drawn = run / "attention.png"
    monkeypatch.setattr(attention, "analyze_attention", lambda *args: ([drawn], []))  # the run's weights aside
    assert main(["analyze", "--run", str(run)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == f"figure: {drawn}"
    assert not any("nothing to draw" in line for line in printed)
    assert any("no gate figures to draw" in line for line in printed)


# --- a small text: corpus is told which field to change ---------------------------------------------------------


def test_a_small_text_corpus_names_the_evaluation_field_and_a_value_that_works(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Training fitted; the valid split did not hold one evaluation window, and the error said to lower batch_size.
    from gatedformer.cli import main

    text = tmp_path / "notes.txt"
    text.write_text("the cat sat on a mat. " * 600, encoding="utf-8")
    args = ["train", "--recipe", "ptb-char-tiny", "--data", f"text:{text}", "--out", str(tmp_path / "run"), "--quiet",
            "--set", "data.batch_size=2", "--set", "data.seq_len=8", "--set", "data.eval_seq_len=32",
            "--set", "data.eval_batch_size=32", "--set", "model.d_model=16", "--set", "model.n_layers=1",
            "--set", "model.n_heads=2", "--set", "model.d_ffn=32", "--set", "train.steps=2",
            "--set", "train.eval_every=2"]
    assert main(args) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "valid split has" in error
    assert "data.eval_batch_size=32" in error and "data.batch_size" not in error
    fix = error.rsplit("; set ", 1)[1].split(" or ")
    assert [f.split("=")[0] for f in fix] == ["data.eval_batch_size", "data.eval_seq_len"]
    for value in fix:  # each value it names works
        assert main([*args, "--set", value, "--out", str(tmp_path / value)]) == 0, capsys.readouterr().err
