r"""The SRU appendix's Figure 6: :math:`\mathrm{Var}[c_t]/\mathrm{Var}[x_t]` at every layer of a freshly initialised
SRU stack.

With weights of variance :math:`1/d` and the forget gate near :math:`\sigma(0) = 1/2`, the cell state is
:math:`c_t = w^\top(x_t/2 + x_{t-1}/4 + \dots)`. Its variance is :math:`\mathrm{Var}[x]/3` when the inputs at
different steps are independent and :math:`\mathrm{Var}[x]` when they are equal (Lei et al. 2018, appendix A.1,
equation 5), so the ratio lies between 1/3 and 1; since each layer's output mixes its inputs over time, deeper
layers read more correlated inputs and the ratio rises towards 1. :func:`cell_variance_ratios` measures it for three
kinds of input: independent Gaussian steps, one Gaussian vector repeated at every step, and real text through the
recipe's embedding (the paper used word2vec embeddings); :func:`plot_cell_variance` draws the figure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from gatedformer.config import RunConfig, validate
from gatedformer.errors import ConfigError
from gatedformer.nn.sru import SRU

__all__ = ["BAND", "CellVariance", "cell_variance_ratios", "format_cell_variance", "plot_cell_variance",
           "sru_cell_check"]

BAND = (1.0 / 3.0, 1.0)
"""The appendix's bounds on ``Var[c]/Var[x]`` (equation 5)."""
INPUT_STD = 0.1
"""The Gaussian inputs' standard deviation: the derivation assumes a small input variance."""


@dataclass
class CellVariance:
    """``Var[c]/Var[x]`` per layer (first layer first) for each kind of input."""

    ratios: dict[str, list[float]]

    def rows(self) -> list[dict[str, float | int]]:
        depth = len(next(iter(self.ratios.values())))
        return [{"layer": i + 1, **{kind: values[i] for kind, values in self.ratios.items()}} for i in range(depth)]


@torch.no_grad()
def _ratios(stack: SRU, x: Tensor) -> list[float]:
    # The appendix's sums run over an unbounded past: measure the later half of the steps, where the cell state
    # has forgotten its zero start (2^-t of it is left after t steps).
    later = x.shape[0] // 2
    ratios = []
    for layer in stack.layers:
        h, cells = layer.cell_states(x)
        ratios.append(float(cells[later:].var() / x[later:].var()))
        x = h
    return ratios


def cell_variance_ratios(depth: int = 20, width: int = 128, length: int = 64, batch: int = 16,
                         highway_bias: float = 0.0, rescale: bool = True, text: Tensor | None = None,
                         seed: int = 0) -> CellVariance:
    """``Var[c]/Var[x]`` at every layer of a ``depth``-layer SRU stack of ``width`` at initialisation, for
    independent and for correlated (repeated) Gaussian inputs of ``length`` steps, and for ``text`` (embedded real
    windows, ``(length, batch, width)``) where given."""
    torch.manual_seed(seed)
    stack = SRU(width, width, num_layers=depth, highway_bias=highway_bias, rescale=rescale).eval()
    generator = torch.Generator().manual_seed(seed)
    independent = torch.randn(length, batch, width, generator=generator) * INPUT_STD
    correlated = (torch.randn(1, batch, width, generator=generator) * INPUT_STD).expand(length, -1, -1)
    ratios = {"independent": _ratios(stack, independent), "correlated": _ratios(stack, correlated.contiguous())}
    if text is not None:
        ratios["text"] = _ratios(stack, text)
    return CellVariance(ratios)


def plot_cell_variance(result: CellVariance, path: Path) -> Path:
    """Figure 6: the ratio against the layer, one line per kind of input, inside the band of equation 5."""
    from gatedformer.analysis.plots import _pyplot, _save

    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(6, 3.6))
    depth = len(next(iter(result.ratios.values())))
    axis.axhspan(*BAND, color="0.9", label="1/3 ≤ Var[c]/Var[x] ≤ 1 (appendix, eq. 5)")
    for kind, values in result.ratios.items():
        axis.plot(range(1, depth + 1), values, marker="o", markersize=3, label=kind)
    axis.set_xlabel("layer")
    axis.set_ylabel("Var[c] / Var[x]")
    axis.set_ylim(0, 1.15)
    axis.legend(fontsize=8, loc="lower right")
    axis.set_title("SRU at initialisation (Lei et al. 2018, Fig. 6)", fontsize=9)
    return _save(figure, Path(path))


def sru_cell_check(config: RunConfig, data_dir: str | Path | None = None, depth: int = 20,
                   figure: Path | None = None) -> CellVariance:
    """:func:`cell_variance_ratios` for an SRU recipe: its width, highway bias and rescaling, ``depth`` layers,
    and its corpus's first training windows through its embedding, as the model's first layer reads them."""
    from gatedformer.data import LMStream, load_corpus
    from gatedformer.models import build_model

    validate(config)
    if config.model.backbone != "sru":
        raise ConfigError(f"--sru-cells measures an SRU stack; the recipe's model.backbone is "
                          f"{config.model.backbone}: pick an SRU recipe (e.g. ptb-char-sru-tiny)")
    if depth < 1:
        raise ConfigError(f"--depth must be at least 1, got {depth}")
    m = config.model
    corpus = load_corpus(config.data.corpus, data_dir)
    x, _ = LMStream(corpus.train, config.data.batch_size, config.data.seq_len).window(0)
    torch.manual_seed(config.train.seed)
    model = build_model(m, len(corpus.vocab))
    with torch.no_grad():  # the embedding as the language model applies it (scaled by √d), time-major
        text = model.embedding(x.t(), math.sqrt(m.d_model))
    result = cell_variance_ratios(depth, m.d_model, x.shape[1], x.shape[0], m.highway_bias, m.rescale, text,
                                  config.train.seed)
    if figure is not None:
        plot_cell_variance(result, figure)
    return result


def format_cell_variance(result: CellVariance) -> str:
    """A printable table of the ratios, with the appendix's band."""
    kinds = list(result.ratios)
    lines = [f"{'layer':>5}  " + "  ".join(f"{k:>11}" for k in kinds) + "  in [1/3, 1]"]
    for row in result.rows():
        inside = all(BAND[0] - 0.05 <= row[k] <= BAND[1] + 0.1 for k in kinds)
        lines.append(f"{row['layer']:>5}  " + "  ".join(f"{row[k]:>11.3f}" for k in kinds) +
                     ("  yes" if inside else "  no"))
    lines += ["", "Var[c]/Var[x] of each layer's cell state over its input at initialisation: independent Gaussian "
              "steps, one Gaussian vector at every step, and the corpus through the model's embedding. The SRU "
              "appendix (eq. 5) bounds it by 1/3 and 1 and expects it to rise towards 1 with depth."]
    return "\n".join(lines)
