"""``compare``: train every variant of a recipe for N seeds and report them side by side.

Each run lives in ``OUT/<variant>/seed-<k>``. A finished run (``results.json`` present) is kept and
skipped, an interrupted one resumes from its checkpoint, so the command can be re-run until done.
"""

from __future__ import annotations

import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from gatedformer.config import Recipe, Variant, build_config
from gatedformer.errors import ConfigError
from gatedformer.io import atomic_write_text
from gatedformer.train.checkpoint import latest_checkpoint
from gatedformer.train.loop import RunResult, train


@dataclass
class VariantSummary:
    """One row of the table: the mean and spread of a variant's seeds."""

    name: str
    results: list[RunResult]
    published: float | None = None

    def mean(self, key: str) -> float:
        return statistics.fmean(getattr(r, key) for r in self.results)

    def std(self, key: str) -> float:
        values = [getattr(r, key) for r in self.results]
        return statistics.stdev(values) if len(values) > 1 else 0.0


@dataclass
class ComparisonReport:
    table: str
    report_path: Path
    figures: list[Path] = field(default_factory=list)
    summaries: list[VariantSummary] = field(default_factory=list)


def slug(name: str) -> str:
    """A folder name for a variant: ``+σ L1-6\\FFN`` -> ``sigma-L1-6-noFFN``."""
    text = name.replace("σ", "sigma").replace("\\", " no").replace("+", " ")
    text = re.sub(r"[^A-Za-z0-9.\-]+", "-", text).strip("-")
    return text or "variant"


def _select(recipe: Recipe, only: list[str] | None) -> list[Variant]:
    if not only:
        return recipe.variants
    names = {v.name: v for v in recipe.variants}
    missing = [n for n in only if n not in names and n not in {slug(v) for v in names}]
    if missing:
        raise ConfigError(f"recipe {recipe.name} has no variant {missing[0]!r}; its variants: {', '.join(names)}")
    return [v for v in recipe.variants if v.name in only or slug(v.name) in only]


def run_comparison(recipe: Recipe, out_dir: Path, seeds: int = 1, overrides: list[str] | None = None,
                   data_dir: str | Path | None = None, progress: bool = True,
                   only: list[str] | None = None) -> ComparisonReport:
    """Train (or pick up) every variant × seed, then write ``report.md`` and its figures."""
    if seeds < 1:
        raise ConfigError(f"--seeds must be at least 1, got {seeds}")
    variants = _select(recipe, only)
    if len({slug(v.name) for v in variants}) != len(variants):
        raise ConfigError(f"recipe {recipe.name} has two variants with the same folder name; rename one")
    overrides = list(overrides or [])
    # Build every config before training anything, so a bad variant fails at once.
    plans = []
    for variant in variants:
        for seed in range(seeds):
            config = build_config(recipe, overrides, variant)
            config.train.seed += seed
            plans.append((variant, seed, config, out_dir / slug(variant.name) / f"seed-{seed}"))

    from gatedformer.data import load_corpus

    corpus = load_corpus(plans[0][2].data.corpus, data_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done_seconds: list[float] = []
    for index, (variant, seed, config, run_dir) in enumerate(plans, start=1):
        if (run_dir / "results.json").is_file():
            _say(progress, f"[{index}/{len(plans)}] {variant.name} seed {seed}: finished earlier, kept")
            continue
        resuming = run_dir.exists() and latest_checkpoint(run_dir) is not None
        eta = ""
        if done_seconds:
            eta = f", about {statistics.fmean(done_seconds) * (len(plans) - index + 1) / 60:.1f} min left"
        _say(progress, f"[{index}/{len(plans)}] {variant.name} seed {seed}"
                       f"{' (resuming)' if resuming else ''}{eta}")
        started = time.perf_counter()
        train(config, run_dir, data_dir=data_dir, resume=resuming, progress=progress, corpus=corpus)
        done_seconds.append(time.perf_counter() - started)

    summaries = [
        VariantSummary(v.name, [RunResult.load(out_dir / slug(v.name) / f"seed-{s}") for s in range(seeds)],
                       v.published)
        for v in variants
    ]
    metric = summaries[0].results[0].metric
    table = format_table(summaries, metric, recipe)
    figures = _figures(summaries, seeds, metric, out_dir)
    report_path = out_dir / "report.md"
    atomic_write_text(report_path, _report(recipe, summaries, table, figures, seeds, overrides))
    return ComparisonReport(table, report_path, figures, summaries)


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)


def _pm(summary: VariantSummary, key: str, digits: int = 3) -> str:
    if len(summary.results) > 1:
        return f"{summary.mean(key):.{digits}f} ± {summary.std(key):.{digits}f}"
    return f"{summary.mean(key):.{digits}f}"


def format_table(summaries: list[VariantSummary], metric: str, recipe: Recipe) -> str:
    """The paper-style markdown table; the first variant is the baseline for the relative change."""
    has_published = any(s.published is not None for s in summaries)
    header = ["variant", "valid loss", f"valid {metric}", "test loss", f"test {metric}", "Δ test vs base"]
    if has_published:
        header.append(f"published test {recipe.published_metric or metric}")
    header += ["params", "s/step", "total time (s)"]
    base = summaries[0].mean("test_metric")
    rows = []
    for s in summaries:
        change = (s.mean("test_metric") - base) / base * 100 if base else 0.0
        row = [s.name, _pm(s, "valid_loss"), _pm(s, "valid_metric"), _pm(s, "test_loss"), _pm(s, "test_metric"),
               "—" if s is summaries[0] else f"{change:+.2f}%"]
        if has_published:
            row.append("—" if s.published is None else f"{s.published:g}")
        row += [f"{s.results[0].params:,}", f"{s.mean('seconds_per_step'):.4f}", f"{s.mean('train_seconds'):.1f}"]
        rows.append(row)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _timing_table(summaries: list[VariantSummary]) -> str:
    base = summaries[0]
    lines = ["| variant | params | Δ params | s/step | Δ time/step | tokens/s |", "|---|---|---|---|---|---|"]
    for s in summaries:
        dp = (s.results[0].params - base.results[0].params) / base.results[0].params * 100
        dt = (s.mean("seconds_per_step") - base.mean("seconds_per_step")) / base.mean("seconds_per_step") * 100
        lines.append(f"| {s.name} | {s.results[0].params:,} | {dp:+.2f}% | {s.mean('seconds_per_step'):.4f} | "
                     f"{dt:+.1f}% | {s.mean('tokens_per_second'):,.0f} |")
    return "\n".join(lines)


def _figures(summaries: list[VariantSummary], seeds: int, metric: str, out_dir: Path) -> list[Path]:
    try:
        from gatedformer.analysis.plots import plot_convergence
    except ImportError:
        return []
    try:
        runs = {s.name: [Path(r.run_dir) for r in s.results] for s in summaries}
        return [plot_convergence(runs, metric, out_dir / "convergence.png")]
    except ImportError:
        return []


def _report(recipe: Recipe, summaries: list[VariantSummary], table: str, figures: list[Path], seeds: int,
            overrides: list[str]) -> str:
    config = build_config(recipe, overrides)
    parts = [
        f"# {recipe.name}: comparison",
        "",
        recipe.description,
        "",
        f"Corpus `{config.data.corpus}`, backbone `{config.model.backbone}`, {config.model.n_layers} layers, "
        f"d_model {config.model.d_model}, {config.train.steps} steps, {seeds} seed(s) per variant"
        + (f", overrides: `{' '.join(overrides)}`" if overrides else "") + ".",
        "Mean ± standard deviation over seeds; Δ is the relative change of the test metric against the first "
        "variant (lower is better).",
        "",
        "## Results",
        "",
        table,
        "",
    ]
    if recipe.published_source:
        parts += [f"Published numbers: {recipe.published_source}.", ""]
    parts += ["## Training-time cost", "", _timing_table(summaries), ""]
    if figures:
        parts += ["## Convergence", ""] + [f"![{f.stem}]({f.name})" for f in figures] + [""]
    return "\n".join(parts)
