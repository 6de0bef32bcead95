"""``compare`` end to end on a tiny recipe (tables, figures, resume, published numbers), the optional
TensorBoard logging, and the shipped recipes that mirror the papers' tables."""

from __future__ import annotations

import importlib.util
import re
import statistics
import sys
import types
from pathlib import Path

import pytest
from conftest import tiny_overrides

from gatedformer.analysis import compare as compare_module
from gatedformer.analysis.compare import run_comparison, slug
from gatedformer.analysis.report import VariantSummary, format_table
from gatedformer.cli import main
from gatedformer.config import build_config, load_recipe, recipe_names
from gatedformer.errors import CheckpointError, ConfigError
from gatedformer.train.loop import RunResult, train

RECIPE = """
description = "two variants for the tests"
published_source = "made-up numbers for the tests"
published_metric = "bpc"

[data]
corpus = "ptb-char"  # the tests train on a small text corpus instead

[[variants]]
name = "baseline"
published = 2.5

[[variants]]
name = "+tanh L2"
set = ["model.gates=+tanh L2"]
published = 2.25

[[variants]]
name = "+σ SDU"
set = ["model.gates=+σ SDU"]
"""


def table_rows(table: str) -> list[dict[str, str]]:
    lines = [line for line in table.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in lines[2:]]


def snapshot(run_dir: Path) -> dict[str, tuple[bytes, int]]:
    return {name: ((run_dir / name).read_bytes(), (run_dir / name).stat().st_mtime_ns)
            for name in ("results.json", "log.jsonl", "model.safetensors")}


@pytest.mark.slow
def test_two_variants_two_seeds_report_and_resume(text_corpus: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    recipe_file = tmp_path / "two.toml"
    recipe_file.write_text(RECIPE, encoding="utf-8")
    recipe = load_recipe(str(recipe_file))
    overrides = [*tiny_overrides(text_corpus, steps=4), "train.eval_every=2"]
    out = tmp_path / "cmp"
    only = ["baseline", "+tanh L2"]

    # First invocation: Ctrl-C in the middle of the last run, after its step-2 checkpoint.
    real_train = compare_module.train

    def interrupted(config, run_dir, **kwargs):
        if run_dir == out / "tanh-L2" / "seed-1":
            real_train(config, run_dir, **{**kwargs, "stop_after": 2})
            raise KeyboardInterrupt
        return real_train(config, run_dir, **kwargs)

    monkeypatch.setattr(compare_module, "train", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_comparison(recipe, out, seeds=2, overrides=overrides, only=only)
    monkeypatch.setattr(compare_module, "train", real_train)
    assert not (out / "tanh-L2" / "seed-1" / "results.json").exists()
    before = {run: snapshot(out / run) for run in ("baseline/seed-0", "baseline/seed-1", "tanh-L2/seed-0")}
    capsys.readouterr()

    # Second invocation: the finished runs are kept as they are, the interrupted one resumes.
    report = run_comparison(recipe, out, seeds=2, overrides=overrides, only=only)
    progress = capsys.readouterr().err
    for run, files in before.items():
        assert snapshot(out / run) == files, f"{run} was retrained"
    assert progress.count("finished earlier, kept") == 3
    assert "[4/4] +tanh L2 seed 1 (resuming at step 2): 4 steps" in progress
    assert re.search(r"step 4/4, valid bpc \d", progress) and "left in all" in progress
    assert (out / "tanh-L2" / "seed-1" / "results.json").is_file()

    # The paper-style table: mean ± std over the two seeds, the change against the baseline, and the
    # published column taken from each variant's own entry.
    rows = table_rows(report.table)
    assert [r["variant"] for r in rows] == only
    for row in rows:
        assert re.fullmatch(r"\d+\.\d{3} ± \d+\.\d{3}", row["test bpc"]), row
        assert re.fullmatch(r"\d+\.\d{3} ± \d+\.\d{3}", row["valid loss"]), row
    assert rows[0]["published test bpc"] == "2.5" and rows[1]["published test bpc"] == "2.25"
    assert rows[1]["published Δ"] == "-10.00%"
    base, gated = report.summaries
    changes = [(g.test_metric - b.test_metric) / b.test_metric * 100
               for g, b in zip(gated.results, base.results, strict=True)]
    mean, std = statistics.fmean(changes), statistics.stdev(changes)
    assert rows[1]["Δ test bpc vs base (paired)"].startswith(f"{mean:+.2f}% ± {std:.2f}")
    assert gated.results[0].params > base.results[0].params

    text = report.report_path.read_text(encoding="utf-8")
    for section in ("## Results", "## Training-time cost", "## Parameters", "## Convergence", "## Gates"):
        assert section in text
    assert "gate: SDU" in text and "s/epoch" in text and "× base (runs)" in text and "× base (interleaved)" in text
    timing = table_rows(text[text.index("## Training-time cost"):text.index("## Parameters")])
    assert [r["variant"] for r in timing] == only and timing[0]["× base (interleaved)"] == "×1.00"
    assert "not on the recipe's `ptb-char`" in text  # the published numbers are for another corpus
    assert (out / "convergence.png").stat().st_size > 5000
    gate_figures = sorted(p.name for p in (out / "gates").iterdir())
    assert gate_figures == ["tanh-L2-gate_activation.png", "tanh-L2-gate_biases.png"]  # one gated sublayer pair
    assert all((out / "gates" / name).stat().st_size > 5000 for name in gate_figures)
    assert "t-SNE skipped" in text  # two bias vectors are too few for t-SNE
    for figure in report.figures:
        assert f"]({figure.relative_to(out).as_posix()})" in text


def test_a_finished_run_is_kept_only_for_the_same_experiment(text_corpus: str, tmp_path: Path) -> None:
    recipe_file = tmp_path / "two.toml"
    recipe_file.write_text(RECIPE, encoding="utf-8")
    recipe = load_recipe(str(recipe_file))
    overrides = [*tiny_overrides(text_corpus, steps=2), "train.eval_every=2"]
    out = tmp_path / "cmp"
    run = out / "baseline" / "seed-0"
    run_comparison(recipe, out, overrides=overrides, only=["baseline"], progress=False)
    before = snapshot(run)

    # Where and how fast it ran does not change the experiment: kept as it is.
    run_comparison(recipe, out, overrides=[*overrides, "train.threads=1", "train.log_every=2"], only=["baseline"],
                   progress=False)
    assert snapshot(run) == before
    # Other settings would put another experiment's numbers in the table: refused, the run left alone.
    with pytest.raises(ConfigError, match=re.escape(f"{run} finished with other settings: train.steps (2 saved, "
                                                    "3 now); delete it to train it with these")):
        run_comparison(recipe, out, overrides=[*overrides, "train.steps=3"], only=["baseline"], progress=False)
    assert snapshot(run) == before
    # A damaged results.json is named, with the fix; for a damaged config.json the config the weights record stands
    # in, and the run is kept.
    saved = (run / "results.json").read_bytes()
    (run / "results.json").write_bytes(saved[: len(saved) // 2])
    with pytest.raises(CheckpointError, match=re.escape(f"{run / 'results.json'} is damaged (JSONDecodeError); "
                                                        f"delete {run} to train that run again")):
        run_comparison(recipe, out, overrides=overrides, only=["baseline"], progress=False)
    (run / "results.json").write_bytes(saved)
    before = snapshot(run)
    saved = (run / "config.json").read_bytes()
    (run / "config.json").write_bytes(saved[: len(saved) // 2])
    with pytest.raises(ConfigError, match=re.escape("train.steps (2 saved, 3 now)")):
        run_comparison(recipe, out, overrides=[*overrides, "train.steps=3"], only=["baseline"], progress=False)
    run_comparison(recipe, out, overrides=overrides, only=["baseline"], progress=False)
    assert snapshot(run) == before


def _summary(name: str, test_metric: float, published: float | None) -> VariantSummary:
    result = RunResult(run_dir="x", corpus="ptb-char", metric="bpc", valid_loss=1.0, valid_metric=1.4,
                       test_loss=1.0, test_metric=test_metric, params=100, steps=10, seconds_per_step=0.1,
                       train_seconds=1.0, tokens_per_second=10.0)
    return VariantSummary(name, [result], published)


def test_published_column_follows_the_recipe_for_a_subset_of_variants() -> None:
    recipe = load_recipe("ptb-char-tiny")
    chosen = compare_module._select(recipe, ["+tanh SDU", "baseline"])
    assert [v.name for v in chosen] == ["baseline", "+tanh SDU"]  # recipe order, whatever the order asked
    rows = table_rows(format_table([_summary(v.name, 1.5, v.published) for v in chosen], "bpc", recipe))
    assert [(r["variant"], r["published test bpc"]) for r in rows] == [("baseline", "1.495"), ("+tanh SDU", "1.364")]
    assert rows[1]["published Δ"] == f"{(1.364 - 1.495) / 1.495 * 100:+.2f}%"
    unpublished = table_rows(format_table([_summary("a", 1.5, None), _summary("b", 1.4, None)], "bpc", recipe))
    assert "published test bpc" not in unpublished[0]


class _FakeWriter:
    written: list[tuple[str, float, int]] = []

    def __init__(self, log_dir: str) -> None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)

    def add_scalar(self, tag: str, value: float, global_step: int) -> None:
        self.written.append((tag, value, global_step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_tensorboard_scalars_from_the_log(text_corpus: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = _FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    _FakeWriter.written = []
    recipe = load_recipe("ptb-char-tiny")
    config = build_config(recipe, [*tiny_overrides(text_corpus, steps=4), "train.eval_every=2", "model.gates=+σ SDU",
                                   "train.tensorboard=true"])
    train(config, tmp_path / "run", progress=False)
    tags = {tag for tag, _, _ in _FakeWriter.written}
    assert {"train/loss", "train/lr", "valid/loss", "valid/bpc", "test/loss", "test/bpc"} <= tags
    assert "gates/layers.0.attn.sdu/mean" in tags
    assert sorted(step for tag, _, step in _FakeWriter.written if tag == "valid/bpc") == [2, 4]
    assert (tmp_path / "run" / "tensorboard").is_dir()


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_tensorboard_missing_is_one_line(text_corpus: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = [f"--set={o}" for o in tiny_overrides(text_corpus)]
    for command in ("train", "compare"):
        out = tmp_path / command
        assert main([command, "--recipe", "ptb-char-tiny", "--out", str(out), "--tensorboard", *args]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("gatedformer: error: "), lines
        assert "needs the tensorboard package" in lines[0] and "pip install 'gatedformer[tensorboard]'" in lines[0]
        assert not out.exists()  # it failed before doing anything


# ---------------------------------------------------------------------------------------------
# The shipped recipes

PUBLISHED = {
    "ptb-char-paper": {"baseline": 1.495, "+σ SDU": 1.371, "+tanh SDU": 1.364},
    "ptb-char-rtransformer-paper": {"baseline": 1.250, "+tanh SDU": 1.274, "+σ SDU": 1.245},
    "ptb-word-paper": {"baseline": 130.43, "+σ SDU": 130.30, "+tanh SDU": 139.53},
    "ptb-word-rtransformer-paper": {"baseline": 92.31, "+σ SDU": 87.88, "+tanh SDU": 84.92},
    # Table 5: the four gates on every sublayer and the six ablations
    "enwik8-xl6-paper": {"baseline": 1.24339, "+tanh SDU": 1.21424, "+σ SDU": 1.21123, "+highway gate": 1.22177,
                         "+gated MHDPA": 1.22398, "+tanh L1-6\\FFN": 1.22866, "+tanh L1-3": 1.22039,
                         "+tanh L3-6": 1.24420, "+σ L1-6\\FFN": 1.23332, "+σ L1-3": 1.23589, "+σ L3-6": 1.24261},
    # Table 6: all 17 rows
    "enwik8-xl12-paper": {"baseline": 1.07160, "+tanh L1-12": 1.12797, "+tanh L1-6": 1.08234, "+tanh L1-3": 1.07140,
                          "+tanh L1-2": 1.06904, "+tanh L1": 1.06960, "+tanh L6-12": 1.07313,
                          "+tanh L1-12\\FFN": 1.09920, "+σ L1-12": 1.10462, "+σ L1-6": 1.08283, "+σ L1-3": 1.07383,
                          "+σ L1-2": 1.07148, "+σ L1": 1.07157, "+σ L6-12": 1.07607, "+σ L1-12\\FFN": 1.08652,
                          "+highway gate": 1.10922, "+gated MHDPA": 1.10292},
    # EAU paper, Table 3: baseline and +EAU+GRC at three sizes
    "multi30k-paper": {"baseline": 40.540, "+EAU+GRC": 48.876, "baseline l2": 39.432, "+EAU+GRC l2": 47.847,
                       "baseline l2 n64 k128 f512": 38.930, "+EAU+GRC l2 n64 k128 f512": 47.483},
    # EAU paper, Table 1 (WMT'14); SRU paper, Table 7 as its text gives it; ConvS2S, Table 1
    "wmt14-paper": {"baseline": 26.61, "+EAU": 26.69, "+GRC": 26.77, "+EAU+GRC": 26.79},
    "wmt14-sru-paper": {"Transformer base (6 layers)": 27.5, "w/ SRU (4 layers)": 27.8, "w/ SRU (5 layers)": 28.2},
    "wmt14-convs2s-paper": {"ConvS2S": 25.16},
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_paper_recipes_carry_the_published_numbers(name: str) -> None:
    recipe = load_recipe(name)
    published = {v.name: v.published for v in recipe.variants if v.published is not None}
    assert published == PUBLISHED[name]  # and no number the issue does not give
    assert recipe.published_source and recipe.published_metric in ("bpc", "ppl", "bleu")
    tiny = name.replace("-paper", "-tiny")
    if tiny in recipe_names():  # the tiny recipe of a table carries the same published rows
        assert {v.name: v.published for v in load_recipe(tiny).variants if v.published is not None} == (
            PUBLISHED[name] if name != "multi30k-paper" else {"baseline": 38.930, "+EAU+GRC": 47.483})


def test_every_recipe_validates_and_its_variants_have_distinct_folders() -> None:
    assert "ptb-char-tiny" in recipe_names()
    for name in recipe_names():
        recipe = load_recipe(name)
        assert recipe.variants, name
        for variant in recipe.variants:
            build_config(recipe, [], variant)
        assert len({slug(v.name) for v in recipe.variants}) == len(recipe.variants), name
        if name.endswith("-paper"):
            assert recipe.published_source, name
            assert name.replace("-paper", "-tiny") in recipe_names(), f"{name} has no -tiny counterpart"


def test_paper_hyperparameters() -> None:
    char = build_config(load_recipe("ptb-char-paper"))
    assert (char.data.batch_size, char.data.seq_len, char.model.d_model, char.model.n_heads) == (16, 400, 512, 8)
    assert (char.optim.name, char.optim.lr, char.optim.schedule, char.optim.clip) == ("sgd", 2.0, "linear", 0.15)
    assert (char.init.scheme, char.init.scale, char.model.dropout) == ("uniform", 0.1, 0.15)
    assert char.train.steps == 100 * 784  # 100 epochs of 5,017,482 / (16 x 400) windows
    word = build_config(load_recipe("ptb-word-paper"))
    assert (word.model.d_model, word.model.n_heads, word.data.seq_len) == (128, 8, 80)
    assert (word.model.dropout, word.model.emb_dropout, word.optim.clip, word.init.scale) == (0.35, 0.15, 0.35, 0.01)
    rt = build_config(load_recipe("ptb-word-rtransformer-paper"))
    assert (rt.model.backbone, rt.model.rnn_type, rt.model.rnn_window, rt.model.n_layers) == ("rtransformer", "lstm",
                                                                                               9, 3)
    rt_char = build_config(load_recipe("ptb-char-rtransformer-paper"))
    assert (rt_char.model.rnn_type, rt_char.model.rnn_window) == ("gru", 7)
    for name, layers in (("enwik8-xl6-paper", 6), ("enwik8-xl12-paper", 12)):
        xl = build_config(load_recipe(name))
        assert (xl.model.backbone, xl.model.n_layers, xl.model.d_model, xl.model.n_heads, xl.model.d_ffn) == (
            "transformer-xl", layers, 512, 8, 2048)
        assert (xl.model.mem_len, xl.data.batch_size, xl.optim.name, xl.optim.lr, xl.optim.warmup_steps) == (
            512, 22, "adam", 2.5e-4, 0)
        assert (xl.data.corpus, xl.init.scheme) == ("enwik8", "normal")
    xl12 = [v.name for v in load_recipe("enwik8-xl12-paper").variants]
    assert len(xl12) == 17 and "+σ L6-12" in xl12 and "+tanh L1-12\\FFN" in xl12 and "+gated MHDPA" in xl12


@pytest.mark.parametrize(("tiny", "paper"), [
    ("ptb-char-tiny", "ptb-char-paper"), ("ptb-char-rtransformer-tiny", "ptb-char-rtransformer-paper"),
    ("ptb-word-tiny", "ptb-word-paper"), ("ptb-word-rtransformer-tiny", "ptb-word-rtransformer-paper"),
    ("enwik8-xl6-tiny", "enwik8-xl6-paper"), ("enwik8-xl12-tiny", "enwik8-xl12-paper"),
    ("ptb-char-sru-tiny", "ptb-char-sru-paper"), ("ptb-char-sru-transformer-tiny", "ptb-char-sru-transformer-paper"),
    ("wikitext2-gcnn-tiny", "wikitext2-gcnn-paper"),
])
def test_tiny_recipes_mirror_their_paper_recipe(tiny: str, paper: str) -> None:
    def arms(recipe):  # what each variant changes about the model kind (sizes may differ; a tiny recipe adds the
        # parameter-matched baseline, which a paper recipe leaves to `compare --matched-baseline`)
        return [(v.name, v.published, [o for o in v.overrides if o.startswith(("model.gates", "model.backbone"))])
                for v in recipe.variants if v.match_params is None]

    small, full = load_recipe(tiny), load_recipe(paper)
    assert arms(small) == arms(full)
    assert build_config(small).model.backbone == build_config(full).model.backbone


def test_a_signal_during_compare_says_to_run_compare_again(text_corpus: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture) -> None:
    from gatedformer.train.loop import TrainingInterrupted

    def stopped(config, run_dir, **kwargs):
        raise TrainingInterrupted(15, 3, Path(run_dir))

    monkeypatch.setattr(compare_module, "train", stopped)
    args = ["compare", "--recipe", "ptb-char-tiny", "--out", str(tmp_path / "cmp"), "--quiet"]
    for override in tiny_overrides(text_corpus, steps=4):
        args += ["--set", override]
    assert main(args) == 143  # 128 + SIGTERM, as for train
    error = capsys.readouterr().err.strip()
    assert "stopped by signal 15 at step 3 of" in error and "run the same compare command again" in error
    assert "--resume" not in error and "\n" not in error


def test_paired_changes_say_when_they_are_within_the_seed_spread() -> None:
    from gatedformer.analysis.report import PairedChange

    clear = PairedChange([-3.1, -2.9, -3.0])
    assert str(clear) == "-3.00% ± 0.10" and clear.within_spread is False
    lucky = PairedChange([-2.0, 1.5, -1.2])  # the seeds disagree on the sign: not a finding
    assert lucky.within_spread is True and str(lucky).endswith("(within spread)")
    assert str(PairedChange([-0.77])) == "-0.77% (1 seed)" and PairedChange([-0.77]).within_spread is None
    low, high = clear.interval()
    assert low < -3.0 < high < 0  # the 95 % t-interval with 2 degrees of freedom: ±4.303 · 0.1 / √3
    assert high - low == pytest.approx(2 * 4.3027 * 0.1 / 3 ** 0.5, rel=1e-3)


@pytest.mark.slow
def test_every_recipes_matched_baseline_has_the_gated_variants_parameters() -> None:
    from gatedformer.analysis.matching import TOLERANCE, matched_config, parameter_count

    for name in recipe_names():
        recipe = load_recipe(name)
        for variant in recipe.variants:
            if variant.match_params is None:
                continue
            target = next(v for v in recipe.variants if v.name == variant.match_params)
            matched = matched_config(recipe, [], variant)
            want = parameter_count(build_config(recipe, [], target))
            assert abs(parameter_count(matched) - want) <= TOLERANCE * want, (name, variant.name)
            assert matched.model.d_ffn > build_config(recipe, [], variant).model.d_ffn  # wider, not gated
            assert matched.model.gates == build_config(recipe, [], recipe.variants[0]).model.gates


def test_a_matched_baseline_has_the_gated_variants_parameters(text_corpus: str, tmp_path: Path) -> None:
    from gatedformer.analysis.matching import TOLERANCE

    # Any compare can ask for one; params shows it.
    recipe_file = tmp_path / "two.toml"
    recipe_file.write_text(RECIPE, encoding="utf-8")
    overrides = [*tiny_overrides(text_corpus, steps=2), "train.eval_every=2"]
    report = run_comparison(load_recipe(str(recipe_file)), tmp_path / "cmp", overrides=overrides,
                            only=["baseline", "+σ SDU", "baseline, params of +σ SDU"], matched_baseline="",
                            progress=False)
    rows = table_rows(report.table)
    assert [r["variant"] for r in rows] == ["baseline", "+σ SDU", "baseline, params of +σ SDU"]
    base, sdu, matched = (s.results[0].params for s in report.summaries)
    assert abs(matched - sdu) <= TOLERANCE * sdu and sdu > 1.2 * base
    assert "One seed per variant" in report.report_path.read_text(encoding="utf-8")
    assert main(["params", "--recipe", str(recipe_file), "--vocab-size", "40", "--matched-baseline", "+tanh L2"]) == 0
    with pytest.raises(ConfigError, match="--matched-baseline 'nope' is not a variant"):
        run_comparison(load_recipe(str(recipe_file)), tmp_path / "x", overrides=overrides, matched_baseline="nope")


def test_paper_recipes_say_what_is_not_from_the_paper() -> None:
    for name in recipe_names():
        if name.endswith("-paper"):
            assert "Not from " in load_recipe(name).description, f"{name} does not say what is not from the paper"
