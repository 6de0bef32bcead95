"""The one table of every gate (issue 53, item 3): the gates recipes name every gate with a baseline of its size, and
``compare --recipe gates-tiny`` in miniature writes the table with matched baselines, paired spread, step-time ratios
and the gated-attention papers' measurements."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import tiny_overrides

from gatedformer.analysis.compare import run_comparison
from gatedformer.analysis.matching import TOLERANCE, matched_config, parameter_count
from gatedformer.config import build_config, load_recipe

GATES_RECIPES = ("gates-tiny", "gates-wikitext2-tiny")
EVERY_GATE = ["+σ SDU", "+tanh SDU", "+highway gate", "+gated MHDPA", "+EAU+GRC", "+SDPA gate", "+SDPA gate headwise",
              "+SwiGLU", "+GRU gate", "+ReZero"]
"""The gates the table compares (the spec of each variant, which is also its name)."""


@pytest.mark.parametrize("name", GATES_RECIPES)
def test_every_gate_is_in_the_table_beside_a_baseline_of_its_size(name: str) -> None:
    recipe = load_recipe(name)
    specs = {v.name: build_config(recipe, [], v).model.gates for v in recipe.variants}
    assert specs["baseline"] == "" and recipe.variants[0].name == "baseline"
    for gate in EVERY_GATE:
        assert specs[gate] == gate, f"{name} has no variant {gate}"
    counts = {v.name: parameter_count(matched_config(recipe, [], v)) for v in recipe.variants}
    matched = [v.name for v in recipe.variants if v.match_params is not None]
    assert matched, name
    for variant in recipe.variants:
        if variant.match_params is not None or variant.name == "baseline":
            continue
        size = counts[variant.name]
        same_size = [m for m in ["baseline", *matched] if abs(counts[m] - size) <= TOLERANCE * size]
        assert same_size, f"{name}: {variant.name} ({size:,} parameters) has no baseline of its size"
    assert build_config(recipe).model.norm == "pre"


def test_the_two_gates_recipes_differ_in_their_corpus_alone() -> None:
    char, word = (load_recipe(n) for n in GATES_RECIPES)
    assert [v.name for v in char.variants] == [v.name for v in word.variants]
    assert (build_config(char).data.corpus, build_config(word).data.corpus) == ("ptb-char", "wikitext2")
    assert (char.published_metric, word.published_metric) == ("bpc", "ppl")


def test_gates_tiny_in_miniature_writes_the_one_table(text_corpus: str, tmp_path: Path) -> None:
    recipe = load_recipe("gates-tiny")
    variants = ["baseline", "+σ SDU", "baseline, params of +σ SDU"]
    report = run_comparison(recipe, tmp_path / "cmp", seeds=2, overrides=tiny_overrides(text_corpus, steps=4),
                            progress=False, only=variants)
    rows = [line.split("|")[1:-1] for line in report.table.splitlines()[2:]]
    assert [r[0].strip() for r in rows] == variants
    header = [h.strip() for h in report.table.splitlines()[0].split("|")[1:-1]]
    assert "step time × base (interleaved)" in header
    change = header.index("Δ test bpc vs base (paired)")
    assert all("±" in r[change] for r in rows[1:])  # two seeds: each change with its spread over them
    sizes = [s.results[0].params for s in report.summaries]
    assert abs(sizes[2] - sizes[1]) <= TOLERANCE * sizes[1] < sizes[1] - sizes[0]
    text = report.report_path.read_text(encoding="utf-8")
    for heading in ("### Attention sink", "### Largest activation", "### Gate scores", "### Loss spikes"):
        assert heading in text
    sink = text.split("### Attention sink")[1].split("###")[0]
    assert all(f"| {v} | attention |" in sink for v in variants)  # every variant, the mean of its 2 seeds
    gates = text.split("### Gate scores")[1].split("###")[0]
    assert "| +σ SDU | attention (SDU) |" in gates and "| baseline |" not in gates
    spikes = text.split("### Loss spikes")[1]
    assert "spikes per seed" in spikes and all(f"| {v} |" in spikes for v in variants)
    assert (tmp_path / "cmp" / "measurements.png").stat().st_size > 5000
    assert (tmp_path / "cmp" / "loss_spikes.png") in report.figures


def test_gates_paper_sets_the_papers_gate_beside_its_baseline_and_trains(text_corpus: str, tmp_path: Path) -> None:
    from gatedformer.train.loop import train

    recipe = load_recipe("gates-paper")
    specs = {v.name: build_config(recipe, [], v).model.gates for v in recipe.variants}
    assert specs == {"baseline": "+SwiGLU", "+SDPA gate": "+SwiGLU+SDPA gate",
                     "+SDPA gate headwise": "+SwiGLU+SDPA gate headwise", "baseline, params of +SDPA gate": "+SwiGLU"}
    config = build_config(recipe)
    assert (config.model.n_layers, config.model.norm, config.init.scheme, config.init.scale) == (28, "pre", "normal",
                                                                                                  0.02)
    assert config.model.dropout == config.model.attn_dropout == 0.0
    small = [f"data.corpus={text_corpus}", "data.batch_size=2", "data.seq_len=16", "data.eval_batch_size=2",
             "data.eval_seq_len=16", "model.d_model=16", "model.n_heads=2", "model.d_ffn=48", "train.steps=1",
             "train.eval_every=1", "train.eval_windows=1", "train.precision=fp32"]
    for variant in recipe.variants[:3]:  # the paper's shape (28 layers, pre-LN, SwiGLU), a step each
        result = train(matched_config(recipe, small, variant), tmp_path / variant.name.replace(" ", "-"),
                       progress=False)
        assert result.steps == 1 and result.valid_loss > 0
