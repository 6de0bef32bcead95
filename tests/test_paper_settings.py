"""What the papers' appendices state holds from the first step: the initialisation of every parameter their
statements cover (recurrent cells included), the SRU's cell-state variance at initialisation (Figure 6), and the
figures that set several runs side by side."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides

from gatedformer.analysis.sru_variance import BAND, cell_variance_ratios
from gatedformer.cli import main
from gatedformer.config import build_config, load_recipe, recipe_names
from gatedformer.models.rtransformer import RecurrentWeights
from gatedformer.tasks import task_for
from gatedformer.train.init import initialise
from gatedformer.train.loop import train

# Parameters a paper's "all weights from U(-a, a), biases 0" does not reach: LayerNorm gains and biases, the
# position biases of Transformer-XL's attention and the SRU's parameters, which have schemes of their own.
_OWN_SCHEME = ("norm", ".u", ".v", "sru.")


@pytest.mark.parametrize("name", [n for n in recipe_names() if n.endswith("-paper")
                                  and load_recipe(n).config.init.scheme == "uniform"])
def test_paper_recipes_start_from_the_appendix_initialisation(name: str) -> None:
    """HT A.1/A.2: every weight from U(-a, a) and every bias 0 — the R-Transformer's GRU/LSTM cells included."""
    recipe = load_recipe(name)
    for variant in recipe.variants:
        # The paper's model at a tenth of its width: the same layers, the same init statement.
        config = build_config(recipe, ["model.d_model=32", "model.d_ffn=64", "model.n_heads=2"], variant)
        torch.manual_seed(0)
        model = task_for(config).nominal_model(config, 50)
        initialise(model, config.init)
        bound = config.init.scale
        recurrent = [m for m in model.modules() if isinstance(m, RecurrentWeights)]
        assert (config.model.backbone == "rtransformer") == bool(recurrent)
        for parameter_name, parameter in model.named_parameters():
            if any(part in parameter_name for part in _OWN_SCHEME):
                continue
            if parameter_name.rsplit(".", 1)[-1].startswith("bias"):
                assert torch.count_nonzero(parameter) == 0, f"{name}: {parameter_name} is not zero"
            else:
                assert parameter.abs().max() <= bound, f"{name}: {parameter_name} beyond U(±{bound})"
                assert parameter.abs().max() > 0.8 * bound, f"{name}: {parameter_name} not from U(±{bound})"


def test_the_default_scheme_leaves_recurrent_cells_as_torch_draws_them() -> None:
    cell = RecurrentWeights("gru", 16)
    before = [p.clone() for p in cell.parameters()]
    initialise(cell, load_recipe("ptb-char-tiny").config.init.__class__("default"))
    assert all(torch.equal(a, b) for a, b in zip(before, cell.parameters(), strict=True))


def test_sru_cell_variance_at_initialisation_follows_the_appendix() -> None:
    """Var[c]/Var[x] is 1/3 for independent steps and 1 for repeated ones at the first layer, and rises towards 1
    with depth (Lei et al. 2018, appendix A.1, eq. 5 and Fig. 6)."""
    result = cell_variance_ratios(depth=6, width=128, length=48, batch=32)
    independent, correlated = result.ratios["independent"], result.ratios["correlated"]
    assert independent[0] == pytest.approx(1 / 3, abs=0.04)
    assert correlated[0] == pytest.approx(1.0, abs=0.1)
    assert independent[-1] > independent[0] + 0.1  # deeper layers read more correlated inputs
    assert all(BAND[0] - 0.04 <= r <= BAND[1] + 0.12 for r in independent + correlated)


def test_init_check_draws_figure_6_for_an_sru_recipe_only(text_corpus: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    args = [f"--set={o}" for o in tiny_overrides(text_corpus) if not o.startswith("model.n_heads")]
    figure = tmp_path / "fig6.png"
    assert main(["init-check", "--recipe", "ptb-char-sru-tiny", *args, "--sru-cells", "--depth", "4",
                 "--figure", str(figure)]) == 0
    out = capsys.readouterr().out
    assert "independent" in out and "correlated" in out and "text" in out and figure.stat().st_size > 5000
    assert main(["init-check", "--recipe", "ptb-char-tiny", *args, "--sru-cells"]) == 2
    assert "--sru-cells measures an SRU stack" in capsys.readouterr().err


def test_analyze_sets_several_runs_gate_biases_side_by_side(text_corpus: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    recipe = load_recipe("ptb-char-tiny")
    for layers in (2, 3):  # HT Fig. 13(e)/(f): the same gates on models of two depths
        config = build_config(recipe, [*tiny_overrides(text_corpus, steps=2), "train.eval_every=2",
                                       f"model.n_layers={layers}", "model.gates=+σ SDU"])
        train(config, tmp_path / f"L{layers}", progress=False)
    out = tmp_path / "figures"
    assert main(["analyze", "--run", str(tmp_path / "L2"), "--run", str(tmp_path / "L3"), "--out", str(out)]) == 0
    assert "gate_biases_runs.png" in capsys.readouterr().out
    assert (out / "gate_biases_runs.png").stat().st_size > 5000 and (out / "L2-gate_biases.png").is_file()
    assert main(["analyze", "--run", str(tmp_path / "L2"), "--run", str(tmp_path / "L3")]) == 2
    assert "needs --out" in capsys.readouterr().err
