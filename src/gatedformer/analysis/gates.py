"""Gate analysis of a run: learned gate biases and gate activations, as numbers and as figures.

Three figures, as in the Highway Transformer appendix:

- ``gate_biases.png``: a heatmap of the learned gate biases (b1), rows = layers, columns = bias
  dimensions, one panel per sublayer kind (attention, FFN, ...), from ``gate_biases.safetensors``;
- ``gate_tsne.png``: a t-SNE map of the bias vectors of every gated sublayer, labelled by layer and
  sublayer;
- ``gate_activation.png``: the mean gate activation of every layer at each evaluation during
  training, from the ``gates`` statistics of the eval records in ``log.jsonl``.

The figures need the ``analysis`` extra (matplotlib and scikit-learn); reading the numbers does not.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gatedformer.errors import CheckpointError, ConfigError, GatedformerError
from gatedformer.gates.kinds import GATE_KINDS
from gatedformer.train.runlog import read_log

BIASES_FILE = "gate_biases.safetensors"
ANALYSIS_HINT = "pip install 'gatedformer[analysis]'"
_SUBLAYER_NAMES = {"attn": "attention", "self_attn": "attention", "cross_attn": "cross-attention",
                   "ffn": "FFN", "feed_forward": "FFN"}
_SUBLAYER_ORDER = ("attn", "self_attn", "cross_attn", "ffn", "feed_forward")


@dataclass(frozen=True)
class GateSite:
    """Where a gate sits, parsed from its module name (``decoder_layers.1.cross_attn.eau``)."""

    name: str
    stack: str
    """``""`` for a single stack of layers, else e.g. ``encoder`` / ``decoder``."""
    layer: int
    """0-based."""
    sublayer: str
    unit: str

    @property
    def panel(self) -> str:
        """The panel (sublayer kind) this gate is drawn in, e.g. ``attention (SDU)``."""
        words = [self.stack] if self.stack else []
        words.append(_SUBLAYER_NAMES.get(self.sublayer, self.sublayer or "block"))
        kind = GATE_KINDS.get(self.unit)
        return " ".join(words) + f" ({kind.label if kind else self.unit})"

    @property
    def label(self) -> str:
        """A short point label, ``L2 attn`` (layers counted from 1, as the papers do)."""
        prefix = f"{self.stack[:3]} " if self.stack else ""
        return f"{prefix}L{self.layer + 1} {self.sublayer or 'block'}"


def parse_site(name: str) -> GateSite:
    """The stack, layer, sublayer and unit (a gate kind's name) of a gate module name."""
    parts = name.split(".")
    unit = parts[-1]
    index = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
    if index is None:
        return GateSite(name, "", 0, ".".join(parts[:-1]), unit)
    stack = re.sub(r"_?layers$|^layers$", "", ".".join(parts[:index]))
    return GateSite(name, stack, int(parts[index]), ".".join(parts[index + 1 : -1]), unit)


def _panel_key(site: GateSite) -> tuple:
    order = _SUBLAYER_ORDER.index(site.sublayer) if site.sublayer in _SUBLAYER_ORDER else len(_SUBLAYER_ORDER)
    return (site.stack, order, site.sublayer, site.unit)


def group_by_panel(names: list[str]) -> dict[str, list[GateSite]]:
    """Gate sites grouped by panel (sublayer kind), panels and layers in model order."""
    sites = sorted((parse_site(n) for n in names), key=lambda s: (_panel_key(s), s.layer))
    panels: dict[str, list[GateSite]] = {}
    for site in sites:
        panels.setdefault(site.panel, []).append(site)
    return panels


# ---------------------------------------------------------------------------------------------
# Reading a run


def load_gate_biases(run_dir: str | Path) -> dict[str, np.ndarray]:
    """The learned gate biases of a finished run (``{}`` when the model has no gates)."""
    path = Path(run_dir) / BIASES_FILE
    if not path.is_file():
        return {}
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return {k: np.asarray(v, dtype=np.float64).reshape(-1) for k, v in load_file(str(path)).items()}
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path} is truncated or corrupt ({err}); delete it and re-run the training") from None


def gate_activation_series(run_dir: str | Path) -> dict[str, tuple[list[int], list[float]]]:
    """``{gate name: (steps, mean activations)}`` from the eval records of ``log.jsonl``."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for record in read_log(run_dir):
        gates = record.get("gates")
        if record.get("event") != "eval" or "step" not in record or not isinstance(gates, dict):
            continue  # a record the run did not write this way (damaged, or edited by hand)
        for name, stats in gates.items():
            mean = stats.get("mean") if isinstance(stats, dict) else None
            if isinstance(mean, int | float) and not isinstance(mean, bool) and math.isfinite(mean):
                steps, means = out.setdefault(str(name), ([], []))
                steps.append(record["step"])
                means.append(float(mean))
    return out


@dataclass
class GateAnalysis:
    """What :func:`analyze_run` drew, and why anything was left out."""

    run_dir: Path
    figures: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def has_gates(self) -> bool:
        return bool(self.figures)


def run_has_gates(run_dir: str | Path) -> bool:
    return bool(load_gate_biases(run_dir)) or bool(gate_activation_series(run_dir))


def require_analysis_extra() -> None:
    """Fail with one line naming the extra when matplotlib or scikit-learn is missing."""
    missing = []
    for module in ("matplotlib", "sklearn"):
        try:
            __import__(module)
        except ImportError:
            missing.append("scikit-learn" if module == "sklearn" else module)
    if missing:
        raise GatedformerError(f"gate figures need {' and '.join(missing)}, not installed here; "
                               f"install the analysis extra with {ANALYSIS_HINT}")


def _run_title(run_dir: Path) -> str:
    # Runs of a comparison live in OUT/<variant>/seed-<k>: name both.
    return f"{run_dir.parent.name}/{run_dir.name}" if run_dir.name.startswith("seed-") else run_dir.name


def analyze_run(run_dir: str | Path, out_dir: str | Path | None = None, prefix: str = "",
                title: str | None = None) -> GateAnalysis:
    """Draw the gate figures of one run into ``out_dir`` (default: the run directory).

    A run without gates draws nothing and says so in ``notes``; a run that has not finished has
    activations but no saved biases yet.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file() and not (run_dir / "log.jsonl").is_file():
        raise ConfigError(f"{run_dir} is not a gatedformer run (no config.json or log.jsonl); pass a train --out")
    out_dir = Path(out_dir) if out_dir is not None else run_dir
    result = GateAnalysis(run_dir)
    biases = load_gate_biases(run_dir)
    activations = gate_activation_series(run_dir)
    if not biases and not activations:
        result.notes.append(f"{run_dir} has no gates (no {BIASES_FILE}, no gate statistics in log.jsonl); "
                            "no gate figures to draw")  # other figures may follow (a translation's attention)
        return result
    require_analysis_extra()
    title = _run_title(run_dir.resolve()) if title is None else title
    if biases:
        result.figures.append(plot_gate_biases(biases, out_dir / f"{prefix}gate_biases.png", title=title))
        tsne = plot_gate_tsne(biases, out_dir / f"{prefix}gate_tsne.png", title=title)
        if tsne is None:
            result.notes.append(f"t-SNE skipped: it needs at least 3 gate bias vectors, the run has {len(biases)}")
        else:
            result.figures.append(tsne)
    else:
        result.notes.append(f"no {BIASES_FILE} yet (the run has not finished): bias heatmap and t-SNE skipped")
    if activations:
        result.figures.append(plot_gate_activations(activations, out_dir / f"{prefix}gate_activation.png",
                                                    title=title))
    else:
        result.notes.append("no gate statistics in log.jsonl: activation figure skipped")
    return result


# ---------------------------------------------------------------------------------------------
# Figures


def _grid(n: int, max_cols: int = 3) -> tuple[int, int]:
    cols = min(n, max_cols)
    return math.ceil(n / cols), cols


def plot_gate_biases(biases: dict[str, np.ndarray], out_path: str | Path, title: str = "") -> Path:
    """Heatmap of the gate biases: one panel per sublayer kind, rows = layers, columns = dimensions.

    Every panel shares one colour scale, symmetric around zero (where every bias starts).
    """
    from gatedformer.analysis.plots import _pyplot, _save

    plt = _pyplot()
    panels = group_by_panel(list(biases))
    limit = max(float(np.abs(v).max()) for v in biases.values()) or 1.0
    rows, cols = _grid(len(panels))
    width = max(len(v) for v in biases.values())
    fig, axes = plt.subplots(rows, cols, figsize=(min(6.0, 2.0 + width / 16) * cols + 1.0, 1.0 + 2.6 * rows),
                             squeeze=False, layout="constrained")
    image = None
    for axis, (panel, sites) in zip(axes.flat, panels.items(), strict=False):
        n_layers = max(s.layer for s in sites) + 1
        dims = max(len(biases[s.name]) for s in sites)
        matrix = np.full((n_layers, dims), np.nan)
        for site in sites:
            matrix[site.layer, : len(biases[site.name])] = biases[site.name]
        image = axis.imshow(matrix, aspect="auto", cmap="coolwarm", vmin=-limit, vmax=limit, interpolation="nearest")
        axis.set_yticks(range(n_layers), [f"L{i + 1}" for i in range(n_layers)])
        axis.set(xlabel="bias dimension", title=panel)
    for axis in axes[:, 0]:
        axis.set_ylabel("layer")
    for axis in list(axes.flat)[len(panels):]:
        axis.axis("off")
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.9, label="gate bias b1")
    fig.suptitle(f"learned gate biases{f' — {title}' if title else ''}")
    return _save(fig, Path(out_path))


def tsne_embedding(vectors: np.ndarray, seed: int = 0) -> np.ndarray:
    """2-D t-SNE of a few vectors, perplexity adapted to their number (it must stay below it)."""
    from sklearn.manifold import TSNE

    n = len(vectors)
    perplexity = float(min(30.0, max(1.0, (n - 1) / 3)))
    tsne = TSNE(n_components=2, perplexity=perplexity, init="pca", learning_rate="auto", random_state=seed,
                method="exact")
    return tsne.fit_transform(np.asarray(vectors, dtype=np.float64))


def plot_gate_tsne(biases: dict[str, np.ndarray], out_path: str | Path, title: str = "",
                   seed: int = 0) -> Path | None:
    """t-SNE scatter of the gate-bias vectors, coloured by sublayer kind and labelled ``L<k> <sublayer>``.

    Returns ``None`` (drawing nothing) with fewer than 3 vectors. Vectors of another length than the
    most common one (a different width) are left out.
    """
    width = Counter(len(v) for v in biases.values()).most_common(1)[0][0]
    names = [n for n, v in biases.items() if len(v) == width]
    if len(names) < 3:
        return None
    from gatedformer.analysis.plots import _pyplot, _save

    plt = _pyplot()
    points = tsne_embedding(np.stack([biases[n] for n in names]), seed)
    where = {n: i for i, n in enumerate(names)}
    fig, axis = plt.subplots(figsize=(6.5, 5.2), layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = "osD^v<>p*h"
    for k, (panel, sites) in enumerate(group_by_panel(names).items()):
        xy = points[[where[s.name] for s in sites]]
        axis.scatter(xy[:, 0], xy[:, 1], s=60, color=colors[k % len(colors)], marker=markers[k % len(markers)],
                     label=panel, edgecolors="black", linewidths=0.5)
        for site, (x, y) in zip(sites, xy, strict=True):
            axis.annotate(site.label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
    axis.set(xlabel="t-SNE 1", ylabel="t-SNE 2",
             title=f"t-SNE of gate biases{f' — {title}' if title else ''} ({len(names)} sublayers)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    return _save(fig, Path(out_path))


def plot_gate_activations(series: dict[str, tuple[list[int], list[float]]], out_path: str | Path,
                          title: str = "") -> Path:
    """Mean gate activation of each layer against training step, one panel per sublayer kind."""
    from gatedformer.analysis.plots import _pyplot, _save

    plt = _pyplot()
    panels = group_by_panel(list(series))
    rows, cols = _grid(len(panels))
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols, 0.4 + 3.4 * rows), squeeze=False, layout="constrained")
    cmap = plt.get_cmap("viridis")
    for axis, (panel, sites) in zip(axes.flat, panels.items(), strict=False):
        n_layers = max(s.layer for s in sites) + 1
        for site in sites:
            steps, means = series[site.name]
            color = cmap(site.layer / max(n_layers - 1, 1))
            axis.plot(steps, means, marker="o", markersize=3, color=color, label=f"L{site.layer + 1}")
        axis.set(xlabel="step", ylabel="mean gate activation", title=panel)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, ncol=2 if len(sites) > 6 else 1)
    for axis in list(axes.flat)[len(panels):]:
        axis.axis("off")
    fig.suptitle(f"gate activation during training{f' — {title}' if title else ''}")
    return _save(fig, Path(out_path))


def plot_runs_gate_biases(runs: dict[str, dict[str, np.ndarray]], out_path: str | Path) -> Path:
    """Several runs' gate biases side by side (Highway Transformer, Fig. 13(e)/(f): a 6- and a 12-layer model): one
    column per run, one row per sublayer kind, rows of each heatmap = layers; one colour scale for all."""
    from gatedformer.analysis.plots import _pyplot, _save

    plt = _pyplot()
    grouped = {title: group_by_panel(list(biases)) for title, biases in runs.items()}
    kinds = list(dict.fromkeys(panel for panels in grouped.values() for panel in panels))
    limit = max(float(np.abs(v).max()) for biases in runs.values() for v in biases.values()) or 1.0
    width = max(len(v) for biases in runs.values() for v in biases.values())
    fig, axes = plt.subplots(len(kinds), len(runs), squeeze=False, layout="constrained",
                             figsize=(min(6.0, 2.0 + width / 16) * len(runs) + 1.0, 1.0 + 2.6 * len(kinds)))
    image = None
    for col, (title, panels) in enumerate(grouped.items()):
        biases = runs[title]
        for row, kind in enumerate(kinds):
            axis = axes[row, col]
            sites = panels.get(kind)
            if not sites:
                axis.axis("off")
                continue
            n_layers = max(s.layer for s in sites) + 1
            matrix = np.full((n_layers, max(len(biases[s.name]) for s in sites)), np.nan)
            for site in sites:
                matrix[site.layer, : len(biases[site.name])] = biases[site.name]
            image = axis.imshow(matrix, aspect="auto", cmap="coolwarm", vmin=-limit, vmax=limit,
                                interpolation="nearest")
            axis.set_yticks(range(n_layers), [f"L{i + 1}" for i in range(n_layers)])
            axis.set(title=f"{title}\n{kind}", xlabel="bias dimension", ylabel="layer" if col == 0 else None)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.9, label="gate bias b1")
    fig.suptitle("learned gate biases, run by run")
    return _save(fig, Path(out_path))


def analyze_runs(run_dirs: list[str | Path], out_dir: str | Path) -> GateAnalysis:
    """Each run's gate figures (named after the run), and their gate biases side by side in one figure,
    ``gate_biases_runs.png``, in ``out_dir``."""
    out_dir = Path(out_dir)
    combined = GateAnalysis(out_dir)
    titles: dict[str, dict[str, np.ndarray]] = {}
    for run_dir in map(Path, run_dirs):
        title = _run_title(run_dir.resolve())
        if title in titles:
            title = str(run_dir)
        single = analyze_run(run_dir, out_dir, prefix=f"{re.sub(r'[^A-Za-z0-9.-]+', '-', title)}-", title=title)
        combined.figures += single.figures
        combined.notes += single.notes
        biases = load_gate_biases(run_dir)
        if biases:
            titles[title] = biases
    if len(titles) > 1:
        combined.figures.append(plot_runs_gate_biases(titles, out_dir / "gate_biases_runs.png"))
    else:
        combined.notes.append("fewer than two of these runs have saved gate biases: no side-by-side figure")
    return combined
