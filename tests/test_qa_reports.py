"""The question-answering recipes through the analysis commands: `params` counts the reader (it built only language
models outside the named tasks), and `compare`'s report says which way F1 is better (it said "lower" for every
metric but BLEU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import one_error_line
from test_qa import _document

from gatedformer.analysis.report import higher_is_better
from gatedformer.cli import main
from gatedformer.config import build_config, load_recipe
from gatedformer.tasks import task_for

pytest.importorskip("tokenizers")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def squad_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "squad"
    folder.mkdir()
    (folder / "train.json").write_text(json.dumps(_document(3, 0)), encoding="utf-8")
    (folder / "dev.json").write_text(json.dumps(_document(1, 3)), encoding="utf-8")
    return folder


def test_params_counts_both_readers_of_the_paper_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["params", "--recipe", "squad-sru-paper", "--vocab-size", "1000", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["variants"]
    recipe = load_recipe("squad-sru-paper")
    assert [row["variant"] for row in rows] == [v.name for v in recipe.variants]
    for row, variant in zip(rows, recipe.variants, strict=True):
        config = build_config(recipe, [], variant)
        model = task_for(config).nominal_model(config, 1000)
        assert row["total"] == sum(p.numel() for p in model.parameters())
        assert row["components"]["embeddings"] == 1000 * 300
    assert rows[0]["components"] != rows[1]["components"]  # six SRU layers, not three LSTMs


def test_params_reads_the_vocabulary_from_the_data_or_says_to_give_it(
        squad_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["params", "--recipe", "squad-sru-tiny", "--data", f"squad-json:{squad_dir}", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["variants"]
    config = build_config(load_recipe("squad-sru-tiny"), [f"data.corpus=squad-json:{squad_dir}"])
    words = len(task_for(config).load_data(config, None).words)
    assert [row["vocab_size"] for row in rows] == [words, words]
    assert main(["params", "--recipe", "squad-sru-tiny", "--data", f"squad-json:{squad_dir / 'none'}"]) != 0
    assert "or give the vocabulary's size with --vocab-size N" in one_error_line(capsys)


def test_the_report_says_scores_are_higher_better_and_losses_lower() -> None:
    assert all(higher_is_better(m) for m in ("f1", "exact_match", "accuracy", "bleu", "matthews", "pearson"))
    assert not any(higher_is_better(m) for m in ("bpc", "ppl"))


def test_compare_puts_the_readers_side_by_side_with_f1_higher_better(squad_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    assert main(["compare", "--recipe", "squad-sru-tiny", "--data", f"squad-json:{squad_dir}", "--out", str(out),
                 "--no-step-timing", "--set", "train.steps=2", "--set", "train.eval_every=2"]) == 0
    report = (out / "report.md").read_text()
    assert "(higher is better)" in report and "lower is better" not in report
    assert "SRU (last layer read, B.2)" in report and "bi-LSTM (layers concatenated, DrQA)" in report
    assert "test f1" in report
