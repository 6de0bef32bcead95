"""Attention figures of translation runs: every decoder layer's attention over a translated sentence, as in ConvS2S's
Figure 3 (Gehring et al. 2017, appendix C). Needs matplotlib (the ``plot`` extra).

One panel per decoder layer, the source tokens down the side and the translation's tokens along the bottom; a cell
is how much the decoder, writing that output token, attends to that source token (the Transformer's heads averaged,
ConvS2S's one attention per layer). :func:`plot_attention` draws what
:func:`~gatedformer.tasks.translation.attention_maps` reads; ``gatedformer translate --attention-plot FILE.png`` draws
the first input sentence and ``gatedformer analyze`` the first test sentence of a translation run.
"""

from __future__ import annotations

import math
from pathlib import Path

from gatedformer.errors import ConfigError, DataError, GatedformerError
from gatedformer.tasks.translation import AttentionMaps

PLOT_HINT = "pip install 'gatedformer[plot]'"


def require_plotting(path: str | Path) -> Path:
    """``path`` as the figure's destination, once matplotlib is importable and the name ends in ``.png`` (checked
    before any work, so a run is not translated for a figure that cannot be written)."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ConfigError(f"--attention-plot {path} must name a .png file, e.g. attention.png")
    if path.is_dir():
        raise ConfigError(f"--attention-plot {path} is a folder; name a .png file in it")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise GatedformerError(f"the attention figure needs matplotlib; {PLOT_HINT}") from None
    return path


def plot_attention(maps: AttentionMaps, path: str | Path, title: str = "") -> Path:
    """Draw every layer of ``maps`` into ``path`` (a PNG, written atomically) and return the path."""
    from gatedformer.analysis.plots import _pyplot, _save

    plt = _pyplot()
    count = len(maps.layers)
    cols = min(count, 4)
    rows = math.ceil(count / cols)
    width = 0.9 + 0.22 * len(maps.output)
    height = 0.9 + 0.22 * len(maps.source)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * width + 1.0, rows * height + 0.8), squeeze=False,
                             layout="constrained")
    image = None
    for index, weights in enumerate(maps.layers):
        axis = axes[index // cols][index % cols]
        # rows: source tokens, columns: output tokens (the figure's axes), each column a distribution over the source
        image = axis.imshow(weights.T.numpy(), cmap="Greys", vmin=0.0, vmax=1.0, aspect="equal",
                            interpolation="nearest")
        axis.set_title(f"layer {index + 1}", fontsize=9)
        axis.set_xticks(range(len(maps.output)), maps.output, rotation=90, fontsize=7)
        axis.set_yticks(range(len(maps.source)), maps.source, fontsize=7)
    for index in range(count, rows * cols):
        axes[index // cols][index % cols].axis("off")
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    fig.suptitle(title or "decoder attention over the source")
    return _save(fig, Path(path))


def analyze_attention(run_dir: str | Path, out_dir: str | Path | None = None, data_dir: str | Path | None = None,
                      prefix: str = "") -> tuple[list[Path], list[str]]:
    """For a translation run: the attention figure of its first test sentence, ``attention.png`` in ``out_dir`` (the
    run folder by default). Returns the figures drawn and notes on what was skipped (a language-model run, a run
    without weights yet, a corpus that is not there)."""
    from gatedformer.runs import load_trained
    from gatedformer.tasks.translation import attention_maps, load_data

    run_dir = Path(run_dir)
    try:
        run = load_trained(run_dir, data_dir, "cpu")
    except GatedformerError as err:
        return [], [f"attention figure skipped: {err}"]
    if run.task.name != "translation":
        return [], []
    try:
        data = load_data(run.config, data_dir)
    except DataError as err:
        return [], [f"attention figure skipped: {err}"]
    src_ids = data.test.src[0]
    tr = run.config.translation
    beam = 1 if tr.decode == "greedy" else tr.beam_size
    maps = attention_maps(run.model, src_ids, [data.src_vocab.itos[i] for i in src_ids], run.data.tgt, beam,
                          tr.length_penalty)
    path = Path(out_dir) if out_dir is not None else run_dir
    figure = plot_attention(maps, path / f"{prefix}attention.png",
                            title=f"{run_dir.name}: {run.config.model.backbone}, first test sentence")
    return [figure], []
