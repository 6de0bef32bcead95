"""Gate analysis: bias heatmap, t-SNE of the biases and activation curves for a gated run, and the
``analyze`` command (a run without gates has no gate figures to draw and says so)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_overrides

from gatedformer.analysis.gates import (
    analyze_run,
    gate_activation_series,
    group_by_panel,
    load_gate_biases,
    parse_site,
    tsne_embedding,
)
from gatedformer.cli import main
from gatedformer.config import RunConfig, apply_overrides, validate
from gatedformer.train.loop import train


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A gated and an ungated run of 3 layers, trained once for the whole module."""
    folder = tmp_path_factory.mktemp("analysis")
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "park"]
    rng = np.random.default_rng(0)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(words, 8)) + "." for _ in range(300)) + "\n", encoding="utf-8")
    out = {}
    for name, gates in (("gated", "+σ SDU"), ("plain", "")):
        overrides = [*tiny_overrides(f"text:{corpus}", steps=4), "train.eval_every=2", "model.n_layers=3",
                     f"model.gates={gates}"]
        train(validate(apply_overrides(RunConfig(), overrides)), folder / name, progress=False)
        out[name] = folder / name
    return out


def test_gate_names_parse_into_layers_and_sublayers() -> None:
    site = parse_site("layers.2.ffn.sdu")
    assert (site.stack, site.layer, site.sublayer, site.unit, site.panel, site.label) == (
        "", 2, "ffn", "sdu", "FFN (SDU)", "L3 ffn")
    cross = parse_site("decoder_layers.1.cross_attn.eau")
    assert (cross.stack, cross.layer, cross.sublayer, cross.panel) == ("decoder", 1, "cross_attn",
                                                                       "decoder cross-attention (EAU)")
    panels = group_by_panel(["layers.1.ffn.sdu", "layers.0.ffn.sdu", "layers.1.attn.sdu", "layers.0.attn.sdu"])
    assert list(panels) == ["attention (SDU)", "FFN (SDU)"]  # attention first, layers in order
    assert [s.layer for s in panels["FFN (SDU)"]] == [0, 1]


@pytest.mark.slow
def test_gated_run_draws_heatmap_tsne_and_activations(runs: dict[str, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    biases = load_gate_biases(runs["gated"])
    assert sorted(biases) == sorted(f"layers.{i}.{s}.sdu" for i in range(3) for s in ("attn", "ffn"))
    assert all(v.shape == (16,) for v in biases.values()) and any(np.abs(v).max() > 0 for v in biases.values())
    series = gate_activation_series(runs["gated"])
    assert set(series) == set(biases)
    steps, means = series["layers.0.attn.sdu"]
    assert steps == [2, 4] and all(0.0 < m < 1.0 for m in means)  # σ gates

    assert main(["analyze", "--run", str(runs["gated"]), "--out", str(tmp_path / "figs")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line for line in printed if line.startswith("figure: ")] == [
        f"figure: {tmp_path / 'figs' / name}" for name in ("gate_biases.png", "gate_tsne.png", "gate_activation.png",
                                                          "measurements.png", "loss_spikes.png")]
    assert all((tmp_path / "figs" / name).stat().st_size > 5000 for name in ("gate_biases.png", "gate_tsne.png",
                                                                            "gate_activation.png"))


def test_tsne_adapts_to_few_points_and_is_deterministic() -> None:
    vectors = np.random.default_rng(1).normal(size=(4, 16))
    first, second = tsne_embedding(vectors), tsne_embedding(vectors)
    assert first.shape == (4, 2) and np.array_equal(first, second)


def test_run_without_gates_has_nothing_to_draw(runs: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    assert analyze_run(runs["plain"]).figures == []
    assert main(["analyze", "--run", str(runs["plain"])]) == 0  # not an error: one line saying so
    printed = capsys.readouterr().out.strip().splitlines()
    notes = [line for line in printed if "gate figures" in line]
    assert len(notes) == 1 and "has no gates" in notes[0] and "no gate figures to draw" in notes[0]
    assert not list(runs["plain"].glob("gate_*.png"))
    assert "### Attention sink" in printed and "### Gate scores" not in printed  # its attention is still measured


def one_line_error(capsys: pytest.CaptureFixture, fragment: str) -> None:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gatedformer: error: ") and fragment in lines[0], lines


def test_analyze_errors_are_one_line(runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture) -> None:
    assert main(["analyze", "--run", str(tmp_path / "nowhere")]) == 2
    one_line_error(capsys, "not a gatedformer run")
    # Without scikit-learn the figures cannot be drawn: one line naming the extra to install.
    monkeypatch.setitem(sys.modules, "sklearn", None)
    assert main(["analyze", "--run", str(runs["gated"]), "--out", str(tmp_path / "figs")]) == 2
    one_line_error(capsys, "gate figures need scikit-learn, not installed here; install the analysis extra "
                           "with pip install 'gatedformer[analysis]'")
    assert not (tmp_path / "figs").exists()
