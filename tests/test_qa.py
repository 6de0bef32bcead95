"""The question-answering task end to end on a SQuAD-format fixture: `train --recipe squad-sru-tiny --data
squad-json:DIR` writes predictions.json and results.json whose EM/F1 an independent implementation of the official
definition recomputes; both readers resume bit for bit; bad input is one error line."""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from gatedformer.cli import main
from gatedformer.config import RunConfig, apply_overrides, build_config, load_recipe, validate
from gatedformer.errors import ConfigError
from gatedformer.train.loop import train

pytest.importorskip("tokenizers")
pytestmark = pytest.mark.usefixtures("one_thread")

_CITIES = ["Paris", "Berlin", "Rome", "Madrid", "Vienna", "Lisbon", "Athens", "Oslo"]
_COUNTRIES = ["France", "Germany", "Italy", "Spain", "Austria", "Portugal", "Greece", "Norway"]


def _document(articles: int, first: int) -> dict[str, Any]:
    data = []
    for a in range(articles):
        paragraphs = []
        for p in range(2):
            i = (a * 2 + p + first) % 8
            year = str(1000 + 37 * i)
            context = (f"The capital of {_COUNTRIES[i]} is {_CITIES[i]}. It was founded in {year} and has {i + 2} "
                       "million people.")
            qas = [{"id": f"{first}-{a}-{p}-city", "question": f"What is the capital of {_COUNTRIES[i]}?",
                    "answers": [{"text": _CITIES[i], "answer_start": context.index(_CITIES[i])}]},
                   {"id": f"{first}-{a}-{p}-year", "question": f"When was the capital of {_COUNTRIES[i]} founded?",
                    "answers": [{"text": year, "answer_start": context.index(year)},
                                {"text": f"in {year}", "answer_start": context.index(f"in {year}")}]}]
            paragraphs.append({"context": context, "qas": qas})
        data.append({"title": f"Article {a}", "paragraphs": paragraphs})
    return {"version": "1.1", "data": data}


@pytest.fixture
def squad_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "my squad"
    folder.mkdir()
    (folder / "train.json").write_text(json.dumps(_document(6, 0)), encoding="utf-8")
    (folder / "dev.json").write_text(json.dumps(_document(2, 3)), encoding="utf-8")
    return folder


def _official(dataset: dict[str, Any], predictions: dict[str, str]) -> dict[str, float]:
    """SQuAD v1.1's evaluation written again from its definition, apart from the package's."""

    def normal(s: str) -> str:
        s = "".join(c for c in s.lower() if c not in set(string.punctuation))
        return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())

    def overlap(p: str, g: str) -> float:
        pt, gt = normal(p).split(), normal(g).split()
        same = sum((Counter(pt) & Counter(gt)).values())
        return 0.0 if same == 0 else 2 * (same / len(pt)) * (same / len(gt)) / (same / len(pt) + same / len(gt))

    em = f = total = 0
    for article in dataset["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                total += 1
                golds = [a["text"] for a in qa["answers"]]
                em += max(float(normal(predictions[qa["id"]]) == normal(g)) for g in golds)
                f += max(overlap(predictions[qa["id"]], g) for g in golds)
    return {"exact_match": 100.0 * em / total, "f1": 100.0 * f / total}


def test_train_writes_predictions_that_the_official_definition_scores_as_results_says(
        squad_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["train", "--recipe", "squad-sru-tiny", "--data", f"squad-json:{squad_dir}", "--out", str(out),
                 "--quiet", "--set", "train.steps=5", "--set", "train.eval_every=2"]) == 0
    results = json.loads((out / "results.json").read_text())
    predictions = json.loads((out / "predictions.json").read_text())
    dev = json.loads((squad_dir / "dev.json").read_text())
    contexts = {qa["id"]: p["context"] for a in dev["data"] for p in a["paragraphs"] for qa in p["qas"]}
    assert set(predictions) == set(contexts)
    assert all(answer and answer in contexts[qid] for qid, answer in predictions.items())  # spans of the paragraph
    official = _official(dev, predictions)
    assert results["exact_match"] == pytest.approx(official["exact_match"], abs=1e-9)
    assert results["f1"] == pytest.approx(official["f1"], abs=1e-9)
    assert results["metric"] == "f1" and results["valid_metric"] == results["f1"] == results["test_metric"]
    evaluations = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert results["f1"] == max(r["valid_f1"] for r in evaluations if r["event"] == "eval")
    assert (out / "best_model.safetensors").is_file()
    assert json.loads((out / "vocab.json").read_text())["words"][:2] == ["<pad>", "<unk>"]


def _config(squad_dir: Path, *overrides: str) -> RunConfig:
    return build_config(load_recipe("squad-sru-tiny"), [
        f"data.corpus=squad-json:{squad_dir}", "data.batch_size=5", "train.steps=8", "train.eval_every=4",
        "train.log_every=1", *overrides])


@pytest.mark.parametrize("rnn", ["sru", "lstm"])
def test_a_resumed_run_is_the_uninterrupted_one_bit_for_bit(squad_dir: Path, tmp_path: Path, rnn: str) -> None:
    config = _config(squad_dir, f"model.rnn={rnn}")
    whole = train(config, tmp_path / "whole", progress=False)
    assert train(config, tmp_path / "split", progress=False, stop_after=5) is None
    resumed = train(config, tmp_path / "split", progress=False, resume=True)

    def losses(run: str) -> list[float]:
        log = [json.loads(line) for line in (tmp_path / run / "log.jsonl").read_text().splitlines()]
        return [r["train_loss"] for r in log if r["event"] == "train"]

    assert losses("split") == losses("whole") and len(losses("whole")) == 8
    assert (resumed.valid_loss, resumed.valid_metric) == (whole.valid_loss, whole.valid_metric)
    assert (tmp_path / "split" / "predictions.json").read_text() == (tmp_path / "whole" / "predictions.json"
                                                                     ).read_text()


def test_the_reader_learns_the_fixture(squad_dir: Path, tmp_path: Path) -> None:
    config = _config(squad_dir, "train.steps=150", "train.eval_every=50", "optim.lr=0.01")
    result = train(config, tmp_path / "run", progress=False)
    assert result is not None and result.valid_metric > 60, result.valid_metric


def test_word_vectors_start_the_embedding_and_only_the_top_question_words_train(squad_dir: Path,
                                                                                 tmp_path: Path) -> None:
    vectors = tmp_path / "vectors.txt"
    vectors.write_text("capital " + " ".join(["0.5"] * 64) + "\nmillion " + " ".join(["-0.5"] * 64) + "\n")
    config = _config(squad_dir, f"qa.word_vectors={vectors}", "qa.tune_top_k=3", "train.steps=3",
                     "train.eval_every=3")
    train(config, tmp_path / "run", progress=False)
    from safetensors.torch import load_file

    table = load_file(str(tmp_path / "run" / "model.safetensors"))["embedding.weight"]
    record = json.loads((tmp_path / "run" / "vocab.json").read_text())
    words = record["words"]
    assert record["fixed_from"] == 5 and words.index("million") >= 5
    assert table[words.index("million")].tolist() == [-0.5] * 64  # pretrained, not among the tuned words
    assert words.index("capital") < 5 and table[words.index("capital")].tolist() != [0.5] * 64  # tuned


def test_bad_input_is_one_error_line(squad_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from conftest import one_error_line

    dev = json.loads((squad_dir / "dev.json").read_text())
    dev["data"][1]["paragraphs"][0]["qas"][1]["answers"][0]["answer_start"] = -3
    (squad_dir / "dev.json").write_text(json.dumps(dev))
    assert main(["train", "--recipe", "squad-sru-tiny", "--data", f"squad-json:{squad_dir}", "--out",
                 str(tmp_path / "run"), "--set", "train.steps=2"]) != 0
    line = one_error_line(capsys)
    assert f"{squad_dir / 'dev.json'}: data[1].paragraphs[0].qas[1].answers[0]: answer_start -3" in line
    assert main(["train", "--recipe", "squad-sru-tiny", "--data", f"squad-json:{tmp_path / 'none'}", "--out",
                 str(tmp_path / "run2")]) != 0
    assert "is not a folder" in one_error_line(capsys)
    (squad_dir / "dev.json").write_text(json.dumps(_document(1, 3)))
    assert main(["train", "--recipe", "squad-sru-tiny", "--data", f"squad-json:{squad_dir}", "--out",
                 str(tmp_path / "run3"), "--set", f"qa.word_vectors={tmp_path / 'glove.txt'}"]) != 0
    assert "qa.word_vectors=" in one_error_line(capsys)


def test_the_config_refuses_what_the_reader_cannot_do() -> None:
    def config(*overrides: str) -> RunConfig:
        return validate(apply_overrides(RunConfig(), ["data.corpus=squad", "model.backbone=reader", *overrides]))

    assert config("model.rnn=lstm").model.rnn == "lstm"
    with pytest.raises(ConfigError, match=r"model.rnn='gru' is not one of sru, lstm"):
        config("model.rnn=gru")
    with pytest.raises(ConfigError, match=r"with model.rnn=lstm leave them"):
        config("model.rnn=lstm", "model.highway_bias=-2")
    with pytest.raises(ConfigError, match=r"model.n_heads=8 does nothing"):
        config("model.n_heads=8")
    with pytest.raises(ConfigError, match=r"qa.max_span=-1"):
        config("qa.max_span=-1")
    with pytest.raises(ConfigError, match=r"qa.max_span=3 does nothing"):
        validate(apply_overrides(RunConfig(), ["qa.max_span=3"]))  # a language-model run


@pytest.mark.parametrize("name", ["squad-sru-paper", "squad-lstm-paper", "squad-sru-tiny", "squad-lstm-tiny"])
def test_the_recipes_build(name: str) -> None:
    recipe = load_recipe(name)
    for variant in recipe.variants:
        config = build_config(recipe, variant=variant)
        assert config.data.corpus == "squad" and config.model.backbone == "reader"
    assert recipe.published_metric == "f1"


def test_the_paper_recipes_hold_b2_and_the_published_numbers() -> None:
    sru, lstm = load_recipe("squad-sru-paper"), load_recipe("squad-lstm-paper")
    assert {v.name: v.published for v in sru.variants} == {"SRU, 6 layers (B.2)": 80.2,
                                                           "bi-LSTM, 3 layers (DrQA)": 78.8}
    assert {v.name: v.published for v in lstm.variants} == {"bi-LSTM, 3 layers (DrQA)": 78.8}
    for text in ("71.4 / F1 80.2", "69.5 / F1 78.8"):
        assert text in sru.description
    b2 = build_config(sru, [], sru.variants[0])
    assert (b2.model.rnn, b2.model.emb_dropout, b2.model.dropout) == ("sru", 0.5, 0.2)  # B.2's dropouts
    for config in (build_config(sru, [], sru.variants[1]), build_config(lstm)):
        assert (config.model.rnn, config.model.n_layers, config.model.dropout, config.model.emb_dropout) == (
            "lstm", 3, 0.3, 0.3)
    for config in (b2, build_config(lstm)):
        assert (config.optim.name, config.optim.lr) == ("adamax", 2e-3)  # DrQA's optimiser at its code's rate
        assert (config.model.d_model, config.data.batch_size, config.qa.max_span, config.qa.tune_top_k,
                config.qa.embedding_dim) == (128, 32, 15, 1000, 300)
