"""GLUE: the loaders on every quirk of the files, the metrics against hand-computed values, fine-tuning a pretrained
run (and resuming it bit for bit), and Table 2's comparison of two variants end to end."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import SHARED_DATA, needs_shared

from gatedformer.config import build_config, load_recipe
from gatedformer.data import glue as glue_data
from gatedformer.data.registry import CORPORA
from gatedformer.errors import ConfigError, DataError
from gatedformer.tasks.glue import finetune_config, glue_metrics
from gatedformer.train.loop import RunResult, train

pytest.importorskip("tokenizers")


pytestmark = pytest.mark.usefixtures("one_thread_module")


WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "in", "mat", "park", "sun", "big", "small", "red"]


def _sentence(i: int, n: int = 6) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n))


def _write_glue(root: Path, rows: int = 40) -> None:
    """Small GLUE folders, each with its task's quirks: CoLA without a header (dev.tsv without a final newline), MRPC
    with a byte-order mark, fields that start with a quote."""
    def put(folder: str, name: str, text: str) -> None:
        (root / "glue" / folder).mkdir(parents=True, exist_ok=True)
        (root / "glue" / folder / name).write_bytes(text.encode("utf-8"))

    cola = "".join(f"gj04\t{i % 2}\t\t{_sentence(i)}\n" for i in range(rows))
    put("CoLA", "train.tsv", cola)
    put("CoLA", "dev.tsv", cola.rstrip("\n"))
    put("CoLA", "test.tsv", "index\tsentence\n" + "".join(f"{i}\t{_sentence(i)}\n" for i in range(5)))
    header = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    mrpc = "".join(f"{i % 2}\t{i}\t{i + 1}\t\"{_sentence(i)}\t{_sentence(i + 1)}\n" for i in range(rows))
    put("MRPC", "train.tsv", "\ufeff" + header + mrpc)
    put("MRPC", "dev.tsv", "\ufeff" + header + mrpc)
    put("MRPC", "test.tsv", "index\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
        + "".join(f"{i}\t{i}\t{i + 1}\t{_sentence(i)}\t{_sentence(i + 2)}\n" for i in range(5)))
    rte = "".join(f"{i}\t\"{_sentence(i)}\t{_sentence(i + 3)}\t{('entailment', 'not_entailment')[i % 2]}\n"
                  for i in range(rows))
    put("RTE", "train.tsv", "index\tsentence1\tsentence2\tlabel\n" + rte)
    put("RTE", "dev.tsv", "index\tsentence1\tsentence2\tlabel\n" + rte)
    put("RTE", "test.tsv", "index\tsentence1\tsentence2\n"
        + "".join(f"{i}\t{_sentence(i)}\t{_sentence(i + 4)}\n" for i in range(7)))
    stsb_header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
    stsb = "".join(f"{i}\tmain\tf\t2012\t{i}\tnone\tnone\t{_sentence(i)}\t{_sentence(i + 1)}\t{(i % 11) / 2:.3f}\n"
                   for i in range(rows))
    put("STS-B", "train.tsv", stsb_header + "\tscore\n" + stsb)
    put("STS-B", "dev.tsv", stsb_header + "\tscore\n" + stsb)
    put("STS-B", "test.tsv", stsb_header + "\n"
        + "".join(f"{i}\tmain\tf\t2012\t{i}\tnone\tnone\t{_sentence(i)}\t{_sentence(i + 5)}\n" for i in range(4)))


@pytest.fixture
def glue_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data root of small GLUE files; the tasks' checksums are those of the real files, so they are not checked."""
    root = tmp_path / "data"
    _write_glue(root)
    for name, spec in glue_data.GLUE_CORPORA.items():
        files = tuple(dataclasses.replace(f, sha256=None, size=None) for f in spec.files)
        loose = dataclasses.replace(spec, files=files)
        monkeypatch.setitem(glue_data.GLUE_CORPORA, name, loose)
        monkeypatch.setitem(CORPORA, name, loose)
    return root


def test_loaders_read_every_quirk(glue_root: Path) -> None:
    cola = glue_data.load_glue("cola", glue_root)
    assert len(cola["train"]) == len(cola["valid"]) == 40  # no header; dev.tsv's last line has no newline
    assert cola["valid"].examples[-1].text_a == _sentence(39) and cola["train"].examples[1].label == 1
    assert cola["test"].examples[2].label is None and cola["test"].examples[2].text_a == _sentence(2)
    mrpc = glue_data.load_glue("glue-mrpc", glue_root)  # the byte-order mark is not part of the header
    assert mrpc["train"].examples[0].text_a == f"\"{_sentence(0)}" and mrpc["train"].examples[3].label == 1
    rte = glue_data.load_glue("rte", glue_root)  # a field that starts with a quote stays one field
    assert len(rte["valid"]) == 40 and rte["valid"].examples[1].label == 1
    assert rte["test"].examples[6].text_b == _sentence(10)
    stsb = glue_data.load_glue("stsb", glue_root)
    assert stsb["train"].examples[3].label == 1.5 and stsb["test"].examples[0].label is None


@pytest.mark.parametrize(("row", "match"), [
    ("7\tx\ty\tmaybe\n", r"RTE/dev.tsv line 3: label 'maybe' is not one of entailment, not_entailment"),
    ("7\tx\ty\tentailment\textra\n", r"RTE/dev.tsv line 3: 5 tab-separated fields where the file has 4"),
])
def test_a_malformed_row_is_one_line_naming_file_and_line(glue_root: Path, row: str, match: str) -> None:
    path = glue_root / "glue" / "RTE" / "dev.tsv"
    lines = path.read_text().split("\n")
    lines[2] = row.rstrip("\n")
    path.write_text("\n".join(lines))
    with pytest.raises(DataError, match=match) as err:
        glue_data.load_glue("rte", glue_root)
    assert "\n" not in str(err.value) and "data fetch glue-rte" in str(err.value)


def test_a_score_outside_zero_to_five_is_refused(glue_root: Path) -> None:
    path = glue_root / "glue" / "STS-B" / "train.tsv"
    path.write_text(path.read_text().replace("\t1.500\n", "\t7.5\n", 1))
    with pytest.raises(DataError, match=r"STS-B/train.tsv line 5: score '7.5'"):
        glue_data.load_glue("stsb", glue_root)


@needs_shared("glue/CoLA/dev.tsv", "glue/MRPC/train.tsv", "glue/RTE/train.tsv", "glue/STS-B/dev.tsv",
              "glue/SST-2/train.tsv", "glue/WNLI/test.tsv")
def test_the_real_files_hold_glues_published_counts() -> None:
    counts = {"cola": (8551, 1043, 1063), "sst2": (67349, 872, 1821), "mrpc": (3668, 408, 1725),
              "stsb": (5749, 1500, 1379), "rte": (2490, 277, 3000), "wnli": (635, 71, 146)}
    positives = {"cola": (6023, 721), "sst2": (37569, 444), "mrpc": (2474, 279), "wnli": (312, 31)}
    for task, sizes in counts.items():
        splits = glue_data.load_glue(task, SHARED_DATA)
        assert tuple(len(splits[s]) for s in ("train", "valid", "test")) == sizes, task
        if task in positives:
            assert tuple(sum(e.label == 1 for e in splits[s].examples) for s in ("train", "valid")) \
                == positives[task], task
    rte = glue_data.load_glue("rte", SHARED_DATA)["train"]
    assert rte.examples[2164].text_a.startswith('"That film')  # the row quote-aware readers merge
    assert sum(e.label == 0 for e in rte.examples) == 1249


def test_metrics_match_hand_computed_values() -> None:
    labels, predictions = [1, 1, 1, 0, 0, 1, 0, 1], [1, 0, 1, 0, 1, 1, 0, 1]
    # tp 4, fp 1, fn 1, tn 2: accuracy 6/8, F1 2·4 / (2·4 + 1 + 1), MCC (4·2 - 1·1) / sqrt(5·5·3·3)
    mrpc = glue_metrics(glue_data.glue_task("mrpc"), predictions, labels)
    assert mrpc["accuracy"] == pytest.approx(0.75) and mrpc["f1"] == pytest.approx(0.8)
    cola = glue_metrics(glue_data.glue_task("cola"), predictions, labels)
    assert cola["matthews"] == pytest.approx(7 / 15) and "f1" not in cola
    # STS-B: Pearson of (1,2,3,4) with (2,4,5,9) and Spearman of ranks (1,2,3,4) with (1,3,2,4)
    stsb = glue_metrics(glue_data.glue_task("stsb"), [1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 5.0, 9.0])
    x, y = [1, 2, 3, 4], [2, 4, 5, 9]
    mx, my = sum(x) / 4, sum(y) / 4
    pearson = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / math.sqrt(
        sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))
    assert stsb["pearson"] == pytest.approx(pearson) and stsb["spearman"] == pytest.approx(1.0)
    spearman = glue_metrics(glue_data.glue_task("stsb"), [1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 2.0, 4.0])["spearman"]
    assert spearman == pytest.approx(1 - 6 * 2 / (4 * 15))
    assert stsb["pearson_spearman"] == pytest.approx((pearson + 1.0) / 2)
    constant = glue_metrics(glue_data.glue_task("stsb"), [2.0] * 4, [1.0, 3.0, 2.0, 4.0])
    assert constant["pearson"] == constant["spearman"] == 0.0


def _pretrain_overrides(corpus: str) -> list[str]:
    return [f"data.corpus={corpus}", "data.seq_len=24", "data.batch_size=4", "data.eval_batch_size=8",
            "model.d_model=16", "model.n_heads=2", "model.d_ffn=32", "model.max_positions=32",
            "tokenizer.vocab_size=80", "train.steps=4", "train.eval_every=2", "train.log_every=1",
            "train.eval_windows=4", "train.threads=1", "finetune.seq_len=24", "finetune.batch_size=8",
            "finetune.lr=1e-3", "finetune.evals_per_epoch=2"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny finished masked-LM run."""
    folder = tmp_path_factory.mktemp("pretrained")
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "park", "in", "sun"]
    generator = torch.Generator().manual_seed(0)
    picks = torch.randint(0, len(words), (3000,), generator=generator).tolist()
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(" ".join(words[i] for i in picks[j: j + 8]) for j in range(0, 3000, 8)) + "\n")
    config = build_config(load_recipe("glue-tiny"), _pretrain_overrides(f"text:{corpus}"))
    train(config, folder / "run", progress=False)
    return folder / "run"


def test_finetune_config_takes_the_pretrained_model_and_the_papers_epochs(pretrained: Path, glue_root: Path,
                                                                         tmp_path: Path) -> None:
    config = finetune_config(pretrained, "rte", [], glue_root)
    assert config.data.corpus == "glue-rte" and config.model.d_model == 16 and config.train.init_from == str(pretrained)
    assert config.train.steps == 8 * math.ceil(40 / 8) and config.optim.lr == 1e-3 and config.optim.beta2 == 0.999
    mine = finetune_config(pretrained, "cola", ["finetune.epochs=2", "optim.lr=5e-4", "train.steps=3"], glue_root)
    assert mine.train.steps == 3 and mine.optim.lr == 5e-4
    assert finetune_config(pretrained, "cola", ["finetune.epochs=2"], glue_root).train.steps == 2 * 5
    with pytest.raises(ConfigError, match="finetune.lr must be positive"):  # named as the user wrote it
        finetune_config(pretrained, "rte", ["finetune.lr=-1"], glue_root)
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.json").write_text((pretrained / "config.json").read_text())
    with pytest.raises(ConfigError, match="has not finished"):
        finetune_config(unfinished, "rte", [], glue_root)


def _finetune(pretrained: Path, glue_root: Path, out: Path, task: str, stop_after: int | None = None,
              resume: bool = False) -> None:
    config = finetune_config(pretrained, task, ["finetune.epochs=2"], glue_root)
    train(config, out, data_dir=glue_root, progress=False, stop_after=stop_after, resume=resume)


def _refuse(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


@pytest.mark.parametrize("task", ["mrpc", "stsb"])
def test_finetuning_reports_the_best_evaluation_and_resumes_bit_for_bit(pretrained: Path, glue_root: Path,
                                                                        tmp_path: Path, task: str) -> None:
    _finetune(pretrained, glue_root, tmp_path / "whole", task)
    _finetune(pretrained, glue_root, tmp_path / "parts", task, stop_after=4)  # mid-epoch, after an evaluation
    assert not (tmp_path / "parts" / "results.json").exists()
    _finetune(pretrained, glue_root, tmp_path / "parts", task, resume=True)
    # strict JSON (a reader that refuses NaN reads it): the test split's loss and metric, whose labels are not
    # public, are null, and NaN again when read back as a RunResult
    whole, parts = (json.loads((tmp_path / d / "results.json").read_text(), parse_constant=_refuse)
                    for d in ("whole", "parts"))
    assert whole["test_loss"] is None and whole["test_metric"] is None
    assert math.isnan(RunResult.load(tmp_path / "whole").test_metric)
    names = ("accuracy", "f1") if task == "mrpc" else ("pearson", "spearman")
    assert all(name in whole for name in names) and whole["task"] == task
    assert {k: whole[k] for k in ("valid_loss", "valid_metric", *names)} == \
        {k: parts[k] for k in ("valid_loss", "valid_metric", *names)}
    evaluations = [json.loads(line) for line in (tmp_path / "whole" / "log.jsonl").read_text().splitlines()]
    scores = [r[f"valid_{whole['metric']}"] for r in evaluations if r["event"] == "eval"]
    assert whole["valid_metric"] == max(scores)
    for name in ("dev_predictions.tsv", "MRPC.tsv" if task == "mrpc" else "STS-B.tsv"):
        assert (tmp_path / "whole" / name).read_text() == (tmp_path / "parts" / name).read_text()
    dev = (tmp_path / "whole" / "dev_predictions.tsv").read_text().splitlines()
    assert dev[0] == "index\tprediction\tlabel" and len(dev) == 41
    submission = (tmp_path / "whole" / ("MRPC.tsv" if task == "mrpc" else "STS-B.tsv")).read_text().splitlines()
    assert submission[0] == "index\tprediction" and len(submission) == (6 if task == "mrpc" else 5)


@pytest.mark.parametrize("task", ["stsb", "cola"])
def test_the_metric_is_recomputed_exactly_from_dev_predictions(pretrained: Path, glue_root: Path, tmp_path: Path,
                                                               task: str) -> None:
    # STS-B's scores and labels were written to three decimals (and clipped to 0-5): the file could not give back
    # the number results.json holds.
    config = finetune_config(pretrained, task, ["finetune.epochs=1"], glue_root)
    train(config, tmp_path / "run", data_dir=glue_root, progress=False)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    spec = glue_data.glue_task(f"glue-{task}")
    rows = [line.split("\t") for line in (tmp_path / "run" / "dev_predictions.tsv").read_text().splitlines()[1:]]

    def value(text: str) -> float:
        return float(text) if spec.regression else float(spec.labels.index(text))

    metrics = glue_metrics(spec, [value(p) for _, p, _ in rows], [value(y) for _, _, y in rows])
    assert metrics[spec.metric] == results["valid_metric"]
    assert all(metrics[name] == results[name] for name in metrics if name in results)


@pytest.mark.parametrize("task", ["mrpc", "cola", "stsb"])
def test_a_finetuned_model_classifies_as_its_evaluation_does_and_exports(
        pretrained: Path, glue_root: Path, tmp_path: Path, task: str, capsys: pytest.CaptureFixture[str]) -> None:
    import gatedformer
    from gatedformer.cli import main
    from gatedformer.runs import evaluate_run

    config = finetune_config(pretrained, task, ["finetune.epochs=1"], glue_root)
    train(config, tmp_path / "run", data_dir=glue_root, progress=False)
    model = gatedformer.load(tmp_path / "run", device="cpu")
    dev = glue_data.load_glue(task, glue_root)["valid"].examples
    pairs = task != "cola"
    inputs = [(e.text_a, e.text_b) if pairs else e.text_a for e in dev]
    assert model.reads_pairs == pairs
    predicted = model.classify(inputs, batch_size=7)  # batches of another size than the evaluation's
    scores = evaluate_run(tmp_path / "run", "valid", data_dir=glue_root, device="cpu")
    if task == "stsb":
        assert model.labels is None and all(isinstance(p, float) and 0.0 <= p <= 5.0 for p in predicted)
        with pytest.raises(ConfigError, match="no class probabilities"):
            model.classify(inputs[0], probabilities=True)
    else:
        assert model.labels == ("0", "1")
        accuracy = sum(p == model.labels[e.label] for p, e in zip(predicted, dev, strict=True)) / len(dev)
        assert accuracy == pytest.approx(scores["accuracy"])  # the final weights' evaluation, example by example
        chances = model.classify(inputs[:3], probabilities=True)
        assert [max(c, key=c.get) for c in chances] == predicted[:3]
        assert all(sum(c.values()) == pytest.approx(1.0) for c in chances)
    alone = model.classify(inputs[4])  # one example, not a list of them (its batch unpadded: scores to rounding)
    assert alone == (pytest.approx(predicted[4], rel=1e-5) if task == "stsb" else predicted[4])
    # the example as the network reads it: [CLS] a [SEP] (b [SEP]), token types and all
    ids, types = model.data[1].encode_pairs([dev[4].text_a], [dev[4].text_b] if pairs else None, config.data.seq_len)
    with torch.no_grad():
        out = model.model(torch.tensor(ids), torch.tensor(types), None).logits[0]
    if task == "stsb":
        assert alone == pytest.approx(float(out[0].clamp(0, 5)), rel=1e-6)
    else:
        chances = model.classify(inputs[4], probabilities=True)
        assert list(chances.values()) == pytest.approx(out.softmax(-1).tolist(), rel=1e-6)
    wrong = inputs[0][0] if pairs else (inputs[0], inputs[0])
    with pytest.raises(DataError, match="input 1 is"):
        model.classify([wrong])

    exported = model.save_pretrained(tmp_path / "export")
    assert "model.classify(" in (exported / "README.md").read_text()
    again = gatedformer.from_pretrained(exported, device="cpu")
    assert again.classify(inputs, batch_size=7) == predicted and again.labels == model.labels

    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(["\t".join(i) if pairs else i for i in inputs[:3]] + [""]) + "\n")
    assert main(["classify", "--run", str(tmp_path / "run"), "--input", str(lines), "--device", "cpu"]) == 0
    shown = [p if isinstance(p, str) else f"{p:.3f}" for p in predicted[:3]]
    assert capsys.readouterr().out.splitlines() == [*shown, ""]  # an empty line gives an empty line
    if pairs:
        lines.write_text("one sentence only\n")
        assert main(["classify", "--run", str(tmp_path / "run"), "--input", str(lines), "--device", "cpu"]) == 2
        err = capsys.readouterr().err.strip()
        assert "input line 1 holds 1 sentence(s)" in err and "\n" not in err


@pytest.mark.slow
def test_glue_comparison_of_two_variants_end_to_end(pretrained: Path, glue_root: Path, tmp_path: Path) -> None:
    from gatedformer.analysis.glue import run_glue_comparison

    corpus = json.loads((pretrained / "config.json").read_text())["data"]["corpus"]
    overrides = _pretrain_overrides(corpus) + ["finetune.tasks=rte stsb qnli", "finetune.epochs=1"]
    recipe = load_recipe("glue-tiny")
    report = run_glue_comparison(recipe, tmp_path / "cmp", overrides=overrides, data_dir=glue_root, progress=False,
                                 only=["BERT", "+EAU+GRC"])
    text = report.report_path.read_text()
    assert "| RTE | accuracy (%) |" in text and "| STS-B | Pearson–Spearman |" in text and "62.45" in text
    assert "glue-qnli: no data" in text and "figure2_mlm_loss.png" in text
    mlm_row = next(line for line in text.splitlines() if line.startswith("| +EAU+GRC | "))
    masked = json.loads((tmp_path / "cmp" / "EAU-GRC" / "seed-0" / "pretrain" / "results.json").read_text())
    assert f"| {100 * masked['valid_accuracy']:.2f} |" in mlm_row  # the masked tokens' accuracy beside the loss
    assert (tmp_path / "cmp" / "EAU-GRC" / "seed-0" / "rte" / "dev_predictions.tsv").is_file()
    again = run_glue_comparison(recipe, tmp_path / "cmp", overrides=overrides, data_dir=glue_root, progress=False,
                                only=["BERT", "+EAU+GRC"])  # every run kept
    assert again.table == report.table


def test_finetune_command_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gatedformer.cli import main

    assert main(["finetune", "--run", str(tmp_path), "--task", "rte", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gatedformer: error: train.init_from=") and "\n" not in err
    assert main(["compare", "--recipe", "glue-tiny", "--out", str(tmp_path / "cmp"), "--matched-baseline"]) == 2
    assert "--matched-baseline does not apply" in capsys.readouterr().err and not (tmp_path / "cmp").exists()
