"""Learning-rate robustness (issue 53, item 4): ``compare --lr-sweep`` trains every variant at every rate, records a
run that diverges and goes on, keeps every finished run, and reports the final loss and the divergences per rate."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import one_error_line, sets, tiny_overrides

from gatedformer.analysis import compare as compare_module
from gatedformer.analysis.lr_sweep import parse_rates, run_lr_sweep
from gatedformer.cli import main
from gatedformer.config import load_recipe
from gatedformer.errors import ConfigError

# lr 1e30 sends the loss to NaN at the second step: the loop stops the run (exit status 3 for train)
DIVERGING = 1e30


def _overrides(corpus: str) -> list[str]:
    return [o for o in tiny_overrides(corpus, steps=6) if not o.startswith("optim.lr")] + [
        "optim.schedule=constant", "train.eval_every=3"]


def test_a_sweep_records_the_diverged_runs_goes_on_and_keeps_the_finished(text_corpus: str, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "sweep"
    args = ["compare", "--recipe", "ptb-char-tiny", "--out", str(out), "--lr-sweep", f"1e-2,{DIVERGING}",
            "--variants", "baseline", "+σ SDU", "--quiet", "--no-step-timing", *sets(_overrides(text_corpus))]
    assert main(args) == 0  # divergences are results of a sweep, not its failure
    printed = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in printed.splitlines() if line.startswith("| baseline") or line.startswith("| +σ SDU")}
    assert set(rows) == {"baseline", "+σ SDU"}
    for finished, diverged in rows.values():
        assert float(finished) > 0  # the final validation loss at lr 0.01
        assert diverged == "diverged 1/1 (step 2)"
    diverging = out / f"lr-{DIVERGING:g}"
    assert (out / "lr-0.01" / "baseline" / "seed-0" / "results.json").is_file()
    assert not (diverging / "baseline" / "seed-0" / "results.json").is_file()
    assert "diverged 1/1 (step 2)" in (out / "report.md").read_text(encoding="utf-8")
    assert (out / "lr_sweep.png").is_file() and (out / "lr-0.01" / "report.md").is_file()

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("a finished or diverged run was trained again")

    # Run again: every run is kept as it finished or diverged, and the report is the same
    monkeypatch.setattr(compare_module, "train", no_training)
    again = run_lr_sweep(load_recipe("ptb-char-tiny"), out, [0.01, DIVERGING], overrides=_overrides(text_corpus),
                         progress=False, only=["baseline", "+σ SDU"], step_timing=False)
    assert again.table in printed
    # A recorded divergence trained with other settings is not silently taken for these
    with pytest.raises(ConfigError, match="diverged with other settings"):
        run_lr_sweep(load_recipe("ptb-char-tiny"), out, [DIVERGING],
                     overrides=[*_overrides(text_corpus), "model.d_ffn=48"], progress=False, only=["baseline"],
                     step_timing=False)


def test_without_a_sweep_a_diverged_run_still_stops_the_comparison(text_corpus: str, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    args = ["compare", "--recipe", "ptb-char-tiny", "--out", str(tmp_path / "cmp"), "--variants", "baseline",
            "--quiet", "--no-step-timing", *sets([*_overrides(text_corpus), f"optim.lr={DIVERGING}"])]
    assert main(args) == 3
    assert "non-finite loss" in one_error_line(capsys)


@pytest.mark.parametrize(("rates", "fragment"), [
    ("1e-3,abc", "'abc' is not a learning rate above 0"),
    ("1e-3,0", "'0' is not a learning rate above 0"),
    ("1e-3,,1e-2", "an empty entry"),
    ("1e-3,0.001", "names 0.001 twice"),
])
def test_bad_rates_are_one_error_line(rates: str, fragment: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture) -> None:
    assert main(["compare", "--recipe", "ptb-char-tiny", "--out", str(tmp_path / "x"), "--lr-sweep", rates]) == 2
    assert fragment in one_error_line(capsys)
    assert not (tmp_path / "x").exists()


def test_a_sweep_refuses_a_learning_rate_set_elsewhere(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert parse_rates("1e-3, 3e-3,1e-2") == [1e-3, 3e-3, 1e-2]
    assert main(["compare", "--recipe", "ptb-char-tiny", "--out", str(tmp_path / "x"), "--lr-sweep", "1e-3",
                 "--set", "optim.lr=0.01"]) == 2
    assert "leave out --set optim.lr" in one_error_line(capsys)
    recipe = tmp_path / "lr.toml"
    recipe.write_text('[[variants]]\nname = "baseline"\n\n[[variants]]\nname = "fast"\nset = ["optim.lr=0.1"]\n',
                      encoding="utf-8")
    assert main(["compare", "--recipe", str(recipe), "--out", str(tmp_path / "y"), "--lr-sweep", "1e-3"]) == 2
    assert "variant 'fast' sets optim.lr" in one_error_line(capsys)
    assert main(["compare", "--recipe", "glue-tiny", "--out", str(tmp_path / "z"), "--lr-sweep", "1e-3"]) == 2
    assert "--lr-sweep does not apply" in one_error_line(capsys)
