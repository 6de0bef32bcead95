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


@pytest.mark.loss_plot
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


# --- compare: the speed it prints is the side-by-side ratio, and a re-run keeps the recorded one ----------------


def _result(name: str, seconds_per_step: float) -> Any:
    from gatedformer.train.loop import RunResult

    return RunResult(run_dir=name, corpus="ptb-char", metric="bpc", valid_loss=1.0, valid_metric=1.4, test_loss=1.0,
                     test_metric=1.4, params=100, steps=10, seconds_per_step=seconds_per_step,
                     train_seconds=10 * seconds_per_step, tokens_per_second=1000.0)


def _times(ratio: float, rounds: int = 5) -> Any:
    from gatedformer.analysis.bench.timing import Timing
    from gatedformer.analysis.step_timing import StepTimes

    return StepTimes({"baseline": Timing([0.01] * rounds), "+σ SDU": Timing([0.01 * ratio] * rounds)})


def _rows(table: str) -> list[dict[str, str]]:
    lines = [line for line in table.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines[2:]]


def test_the_printed_table_shows_the_interleaved_ratio_not_each_runs_raw_time() -> None:
    from gatedformer.analysis.report import VariantSummary, format_table

    # Under load the baseline's run took 0.12 s a step and the gated one's 0.02: its own time says 6× faster.
    summaries = [VariantSummary("baseline", [_result("a", 0.12)]), VariantSummary("+σ SDU", [_result("b", 0.02)])]
    recipe = load_recipe("ptb-char-tiny")
    rows = _rows(format_table(summaries, "bpc", recipe, _times(1.25)))
    assert [r["step time × base (interleaved)"] for r in rows] == ["×1.00", "×1.25"]
    assert not any("s/step" in key for key in rows[0])
    alone = _rows(format_table(summaries, "bpc", recipe))  # --no-step-timing: the runs' own times, said so
    assert [r["s/step (own run)"] for r in alone] == ["0.1200", "0.0200"]


def test_a_recorded_measurement_is_kept_and_a_new_one_goes_beside_it(tmp_path: Path) -> None:
    from gatedformer.analysis.step_timing import TIMES_FILE, recorded_or_measured

    recipe = load_recipe("ptb-char-tiny")
    configs = {"baseline": build_config(recipe, [], recipe.variants[0]),
               "+σ SDU": build_config(recipe, [], recipe.variants[1])}
    first, notes = recorded_or_measured(configs, tmp_path, lambda: _times(1.33))
    assert notes == [] and not first.recorded and first.ratio("+σ SDU") == pytest.approx(1.33)

    def refuse() -> Any:
        raise AssertionError("measured again: the recorded ratios would be silently replaced")

    again, _ = recorded_or_measured(configs, tmp_path, refuse)  # a re-run of the finished comparison
    assert again.recorded and again.measured == first.measured and again.ratio("+σ SDU") == pytest.approx(1.33)
    assert again["baseline"].samples == first["baseline"].samples

    # Changed settings are another measurement: taken now, recorded beside the first, which stays.
    configs["+σ SDU"] = build_config(recipe, ["train.threads=1"], recipe.variants[1])
    changed, _ = recorded_or_measured(configs, tmp_path, lambda: _times(1.89))
    assert not changed.recorded and changed.ratio("+σ SDU") == pytest.approx(1.89)
    recorded = json.loads((tmp_path / TIMES_FILE).read_text())["measurements"]
    assert len(recorded) == 2 and all(m["measured"].endswith("UTC") for m in recorded)

    # A damaged file is neither trusted nor overwritten.
    (tmp_path / TIMES_FILE).write_text("{not json")
    fresh, notes = recorded_or_measured(configs, tmp_path, lambda: _times(1.5))
    assert fresh.ratio("+σ SDU") == pytest.approx(1.5) and "could not be read" in notes[0]
    assert (tmp_path / TIMES_FILE).read_text() == "{not json"


def test_rerunning_a_finished_compare_keeps_its_timing_table(text_corpus: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from gatedformer.analysis import compare as compare_module

    recipe = load_recipe("ptb-char-tiny")
    overrides = [*tiny_overrides(text_corpus, steps=2), "train.eval_every=2"]
    only = ["baseline", "+σ SDU"]
    monkeypatch.setattr(compare_module, "interleaved_step_times", lambda *args: _times(1.33, rounds=3))
    first = compare_module.run_comparison(recipe, tmp_path / "cmp", overrides=overrides, only=only, progress=False)
    text = first.report_path.read_text(encoding="utf-8")
    timing = text[text.index("## Training-time cost"):text.index("## Parameters")]
    assert "×1.33" in first.table and "measured 20" in timing

    # The machine is busier now: a second measurement would give other ratios, and replace the first silently.
    monkeypatch.setattr(compare_module, "interleaved_step_times", lambda *args: _times(1.89, rounds=3))
    second = compare_module.run_comparison(recipe, tmp_path / "cmp", overrides=overrides, only=only, progress=False)
    again = second.report_path.read_text(encoding="utf-8")
    assert second.table == first.table and "×1.89" not in again
    assert again[again.index("## Training-time cost"):again.index("## Parameters")].replace(
        "recorded in `step_times.json` by an earlier invocation and kept", "recorded in `step_times.json`") == timing


# --- init-check on ConvS2S: interior positions, where appendix A's sums hold -------------------------------------


def _padded_batches(count: int = 4, batch: int = 16, length: int = 16) -> list[tuple[Any, Any, Any]]:
    """Sentences of 5 to ``length`` tokens, padded at the end, as the translation batches are."""
    import torch

    from gatedformer.data.translation import PAD_ID

    generator = torch.Generator().manual_seed(0)

    def side() -> Any:
        lengths = torch.randint(5, length + 1, (batch,), generator=generator)
        tokens = torch.randint(4, 50, (batch, length), generator=generator)
        tokens[torch.arange(length)[None, :] >= lengths[:, None]] = PAD_ID
        return tokens

    out = []
    for _ in range(count):
        src, tgt = side(), side()
        out.append((src, tgt, tgt.roll(-1, 1)))
    return out


def test_init_check_measures_convs2s_blocks_on_interior_positions() -> None:
    # Pooled over sentence edges and padding, where part of each kernel reads zeros, the forward ratio read some 5 %
    # (here, with short sentences and w=5, far more) below appendix A's 1.
    import statistics

    import torch

    from gatedformer.analysis import init_check as ic
    from gatedformer.data.translation import PAD_ID
    from gatedformer.models.convs2s import ConvS2S

    real = torch.tensor([[True] * 5 + [False] * 2])
    assert ic.interior_positions(real, 1).tolist() == [[False, True, True, True, False, False, False]]
    assert ic.interior_positions(real, 2).tolist() == [[False, False, True, False, False, False, False]]

    torch.manual_seed(0)
    model = ConvS2S(50, 50, embed_dim=64, encoder_layers=[(64, 5)] * 3, max_len=64, dropout=0.1, pad_id=PAD_ID,
                    weight_norm=False).train()
    runner = ic._TranslationRunner(model, torch.device("cpu")).train()
    measured = {}
    for name, sites in (("pooled", ic.layer_sites(model)),
                        ("interior", ic._interior_sites(ic.layer_sites(model), runner))):
        torch.manual_seed(1)  # the same dropout masks
        measured[name] = ic.measure_layers(runner, _padded_batches(), loss_fn=ic._cross_entropy, sites=sites)
    interior = measured["interior"]
    assert all(r["positions"] == "interior" and "interior positions" in r["note"] for r in interior)
    assert statistics.fmean(r["forward"] for r in measured["pooled"]) < 0.9
    assert all(abs(r["forward"] - r["forward_predicted"]) < 0.1 for r in interior), [r["forward"] for r in interior]
    assert all(abs(r["backward"] - r["backward_predicted"]) < 0.12 for r in interior), [r["backward"] for r in interior]
    assert "interior positions: real tokens" in ic.format_init_check(interior)
    assert "interior positions" not in ic.format_init_check(measured["pooled"])
