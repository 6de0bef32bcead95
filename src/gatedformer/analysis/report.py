"""The tables and the markdown report of a comparison (see :mod:`gatedformer.analysis.compare`).

Everything here formats numbers that are already known: the finished runs' ``results.json``, the
recipe's published numbers, the per-component parameter counts and the interleaved step times. Nothing trains or
plots.

Changes against the baseline are paired by seed: seed k of a variant against seed k of the baseline (same data
order, same initial draws where the shapes agree), so what the seeds share cancels. With several seeds the change is
the mean and standard deviation of the per-seed changes, and it is marked "within spread" when the 95 % t-interval
of that mean includes zero (with scipy, which ``gatedformer[analysis]`` brings): such a difference is not a finding.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gatedformer.config import Recipe
from gatedformer.train.loop import RunResult


@dataclass
class VariantSummary:
    """One row of the table: the mean and spread of a variant's seeds."""

    name: str
    results: list[RunResult]
    published: float | None = None
    steps_per_epoch: int | None = None
    """Training windows in one pass over the training split (language models), for the time per epoch."""
    components: dict[str, int] | None = None
    """Parameters per component (:func:`gatedformer.analysis.params.count_by_component`)."""

    def mean(self, key: str) -> float:
        return statistics.fmean(getattr(r, key) for r in self.results)

    def std(self, key: str) -> float:
        values = [getattr(r, key) for r in self.results]
        return statistics.stdev(values) if len(values) > 1 else 0.0

    @property
    def seconds_per_epoch(self) -> float | None:
        steps = self.steps_per_epoch or self.results[0].steps_per_epoch
        return self.mean("seconds_per_step") * steps if steps else None


def _total_seconds(result: RunResult) -> float:
    """The run's wall-clock time; results from before that was kept have their training steps' time only."""
    return result.wall_seconds or result.train_seconds + result.setup_seconds


@dataclass
class ComparisonReport:
    """What ``compare`` prints of a comparison: its table, the report file, the figures, each variant's summary (the
    language-model and translation comparisons; the GLUE and sentence-classification ones have none) and notes."""

    table: str
    report_path: Path
    figures: list[Path] = field(default_factory=list)
    summaries: list[VariantSummary] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table of ``header`` and ``rows`` (cells already formatted), as every comparison report prints."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _pm(summary: VariantSummary, key: str, digits: int = 3) -> str:
    return _mean_pm([getattr(r, key) for r in summary.results], digits)


def _mean_pm(values: list[float], digits: int) -> str:
    if len(values) > 1:
        return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"
    return f"{values[0]:.{digits}f}"


def _change(value: float, base: float) -> str:
    return f"{(value - base) / base * 100:+.2f}%" if base else "—"


@dataclass
class PairedChange:
    """A variant's relative change (%) against the baseline, paired by seed."""

    changes: list[float]
    """Per seed, ``100 · (variant − baseline) / baseline``."""

    @property
    def mean(self) -> float:
        return statistics.fmean(self.changes)

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.changes) if len(self.changes) > 1 else None

    def interval(self) -> tuple[float, float] | None:
        """The 95 % t-interval of the mean change (``None`` with one seed, or without scipy)."""
        if len(self.changes) < 2:
            return None
        try:
            from scipy.stats import t as student
        except ImportError:
            return None
        half = student.ppf(0.975, len(self.changes) - 1) * self.std / math.sqrt(len(self.changes))
        return self.mean - half, self.mean + half

    @property
    def within_spread(self) -> bool | None:
        """Whether the interval includes zero (``None`` where there is no interval)."""
        interval = self.interval()
        return None if interval is None else bool(interval[0] <= 0.0 <= interval[1])

    def __str__(self) -> str:
        if self.std is None:
            return f"{self.mean:+.2f}% (1 seed)"
        text = f"{self.mean:+.2f}% ± {self.std:.2f}"
        return text + " (within spread)" if self.within_spread else text


def paired_change(summary: VariantSummary, base: VariantSummary, key: str = "test_metric") -> PairedChange:
    """``summary``'s change against ``base`` in ``key``, seed by seed (the seeds both have)."""
    pairs = zip(summary.results, base.results, strict=False)
    return PairedChange([(getattr(s, key) - getattr(b, key)) / getattr(b, key) * 100 for s, b in pairs
                         if getattr(b, key)])


def published_header(recipe: Recipe, metric: str) -> str:
    return f"published test {recipe.published_metric or metric}"


def _interleaved(summaries: list[VariantSummary], step_times: dict[str, Any] | None) -> bool:
    return step_times is not None and all(s.name in step_times for s in summaries)


def format_table(summaries: list[VariantSummary], metric: str, recipe: Recipe,
                 step_times: dict[str, Any] | None = None) -> str:
    """The paper-style markdown table; the first variant is the baseline for the relative changes.

    With published numbers in the recipe there are two more columns: each variant's published number
    (from its own ``[[variants]]`` entry) and the relative change the paper reports against its baseline. The
    speed column is the step time against the baseline's as ``step_times`` measured it, every variant's step timed
    side by side (:mod:`~gatedformer.analysis.step_timing`); without it, each run's own seconds per step, labelled
    as such: the runs trained one after another, so whatever else the machine did skews them (one variant once looked
    6× faster than another).
    """
    timed = _interleaved(summaries, step_times)
    has_published = any(s.published is not None for s in summaries)
    header = ["variant", "valid loss", f"valid {metric}", "test loss", f"test {metric}",
              f"Δ test {metric} vs base (paired)"]
    if has_published:
        header += [published_header(recipe, metric), "published Δ"]
    header += ["params", "step time × base (interleaved)" if timed else "s/step (own run)", "total time (s)"]
    base = summaries[0]
    rows = []
    for s in summaries:
        row = [s.name, _pm(s, "valid_loss"), _pm(s, "valid_metric"), _pm(s, "test_loss"), _pm(s, "test_metric"),
               "—" if s is base else str(paired_change(s, base))]
        if has_published:
            row.append("—" if s.published is None else f"{s.published:g}")
            known = s is not base and s.published is not None and base.published is not None
            row.append(_change(s.published, base.published) if known else "—")
        speed = f"×{step_times.ratio(s.name):.2f}" if timed else f"{s.mean('seconds_per_step'):.4f}"  # type: ignore[union-attr]
        row += [f"{s.results[0].params:,}", speed, _mean_pm([_total_seconds(r) for r in s.results], 1)]
        rows.append(row)
    return markdown_table(header, rows)


def timing_table(summaries: list[VariantSummary], step_times: dict[str, Any] | None = None) -> str:
    """Training-time cost of each variant (Highway Transformer, Table 7). With ``step_times``
    (:class:`~gatedformer.analysis.step_timing.StepTimes`), first every variant's step timed interleaved in one
    process and its ratio to the baseline's; then, from the runs themselves, which trained one after another: time
    per step and per epoch, the relative time, throughput, setup, and the extra parameters that cost buys. The runs'
    time per step leaves out the first step of each run (kernels built on first use, compilation), shown as setup."""
    base = summaries[0]
    base_step = base.mean("seconds_per_step")
    base_params = base.results[0].params
    timed = _interleaved(summaries, step_times)
    header = (["variant", "s/step (interleaved)", "× base (interleaved)"] if timed else ["variant"]) + [
        "s/step (runs)", "s/epoch", "× base (runs)", "tokens/s", "setup (s)", "params", "Δ params"]
    rows = []
    for s in summaries:
        step = s.mean("seconds_per_step")
        epoch = s.seconds_per_epoch
        row = [s.name]
        if timed:
            times = step_times[s.name]
            q1, q3 = times.quartiles
            row += [f"{times.median:.4f} [{q1:.4f}, {q3:.4f}]", f"×{step_times.ratio(s.name):.2f}"]
        row += [
            f"{step:.4f}" + (f" ± {s.std('seconds_per_step'):.4f}" if len(s.results) > 1 else ""),
            "—" if epoch is None else f"{epoch:,.1f}", f"×{step / base_step:.2f}" if base_step else "—",
            f"{s.mean('tokens_per_second'):,.0f}", f"{s.mean('setup_seconds'):.2f}", f"{s.results[0].params:,}",
            "—" if s is base else _change(s.results[0].params, base_params),
        ]
        rows.append(row)
    return markdown_table(header, rows)


def measurement_note(summaries: list[VariantSummary], step_times: Any) -> str:
    """When the interleaved step times were measured, whether a re-run kept them, and the ratios of the other
    measurements of the same variants that ``step_timing.TIMES_FILE`` records (they differ as the load did)."""
    if not _interleaved(summaries, step_times) or not getattr(step_times, "measured", ""):
        return ""
    kept = ("recorded in `step_times.json` by an earlier invocation and kept" if step_times.recorded
            else "recorded in `step_times.json`")
    text = (f"The interleaved step times were measured {step_times.measured} ({kept}; a re-run of this comparison "
            "shows them again, and measures anew only where a variant's settings changed, recording that "
            "measurement beside this one; delete the file to measure again).")
    others = [t for t in getattr(step_times, "earlier", []) if all(s.name in t for s in summaries)]
    if others:
        ratios = "; ".join(f"{t.measured}: " + ", ".join(f"×{t.ratio(s.name):.2f}" for s in summaries[1:])
                           for t in others)
        text += f" Earlier measurements of the same variants ({', '.join(s.name for s in summaries[1:])}): {ratios}."
    return text


def parameter_table(summaries: list[VariantSummary]) -> str | None:
    """Parameters per component and variant, with each variant's total and its change from the baseline."""
    known = [s for s in summaries if s.components]
    if not known:
        return None
    components = sorted({c for s in known for c in s.components})
    base_total = sum(known[0].components.values())
    header = ["variant", *components, "total", "Δ total"]
    rows = []
    for s in known:
        total = sum(s.components.values())
        rows.append([s.name, *(f"{s.components[c]:,}" if c in s.components else "—" for c in components),
                     f"{total:,}", "—" if s is known[0] else _change(total, base_total)])
    return markdown_table(header, rows)


LOSS_METRICS = frozenset({"bpc", "ppl", "loss"})
"""The metrics that are losses (bits per character, perplexity), lower better; every other metric a task reports
(BLEU, accuracy, F1, exact match, Matthews, Pearson, Spearman) is a score, higher better."""


def higher_is_better(metric: str) -> bool:
    return metric not in LOSS_METRICS


def render_report(recipe: Recipe, summaries: list[VariantSummary], table: str, *, metric: str, corpus: str,
                  setup: str, convergence: list[Path], gate_figures: dict[str, list[Path]],
                  notes: list[str], out_dir: Path, step_times: dict[str, Any] | None = None,
                  measurements: list[str] | None = None) -> str:
    """The whole ``report.md``: results, published numbers, time, parameters, figures and (``measurements``: the
    lines :func:`~gatedformer.analysis.measurements.measurement_tables` writes) the gated-attention papers'
    measurements."""
    better = "higher" if higher_is_better(metric) else "lower"
    parts = [f"# {recipe.name}: comparison", "", recipe.description, "", setup,
             "Mean ± standard deviation over seeds. Δ is the relative change against the first variant "
             f"({better} is better), paired by seed: the mean ± standard deviation of each seed's change against the "
             "baseline's run of the same seed; \"within spread\" marks a change whose 95 % t-interval over seeds "
             "includes zero, which is not a finding.", "", "## Results", "", table, ""]
    if any(s.published is not None for s in summaries):
        recipe_corpus = recipe.config.data.corpus
        where = "" if corpus == recipe_corpus else (
            f" This comparison ran on `{corpus}`, not on the recipe's `{recipe_corpus}`: compare directions of "
            "change, not values.")
        parts += [f"Published numbers: {recipe.published_source or 'see the recipe'}.{where}", ""]
    elif recipe.published_source:
        parts += [f"Published numbers: {recipe.published_source}.", ""]
    interleaved = ("First, every variant's training step timed in this process one after another, round-robin in "
                   "a shuffled order (median seconds per step [interquartile range] over the rounds, and the median "
                   "per-round ratio to the baseline): load on the machine falls on every variant alike, so it skews "
                   "these ratios far less than the runs' own times, though load that starts or stops within the "
                   "rounds still moves them (compare the interquartile ranges, and the earlier measurements where "
                   "there are some). Then, from the runs, which trained one after another, so that load skews them: "
                   if step_times else "")
    parts += ["## Training-time cost", "",
              interleaved + ("m" if interleaved else "M") + "ean training time per step (evaluation excluded) and "
              "per epoch (steps per pass over "
              "the training split × s/step), relative to the first variant. Each run's first step is left out of "
              "s/step and tokens/s and shown as setup: it builds kernels on first use (once per machine, so "
              "whichever variant runs first pays it) and compiles under `--compile`. The results table's "
              "total time is the whole run, evaluations included.", "", timing_table(summaries, step_times), ""]
    measured = measurement_note(summaries, step_times)
    if measured:
        parts += [measured, ""]
    params = parameter_table(summaries)
    if params:
        parts += ["## Parameters", "", params, ""]
    if convergence:
        parts += ["## Convergence", "",
                  "Validation metric against step and against training time, and training loss against step; "
                  "the shaded band is the spread (min to max) over seeds. Where evaluations during training "
                  "score part of the validation split (`train.eval_windows`, `translation.bleu_sentences`), "
                  "the curve holds those, and a star marks the run's last evaluation, on the whole split.", ""]
        parts += [f"![{f.stem}]({f.relative_to(out_dir).as_posix()})" for f in convergence] + [""]
    if gate_figures:
        parts += ["## Gates", "",
                  "For each gated variant's first seed: learned gate biases (rows = layers, columns = bias "
                  "dimensions), a t-SNE map of the bias vectors of every gated sublayer, and the mean gate "
                  "activation of each layer at every evaluation.", ""]
        for name, figures in gate_figures.items():
            parts += [f"### {name}", ""] + [f"![{f.stem}]({f.relative_to(out_dir).as_posix()})" for f in figures]
            parts.append("")
    if measurements:
        parts += ["## Attention sink, activations, gate scores and loss spikes", "",
                  "What the gated-attention paper (Qiu et al. 2025) measures, for every variant: forward hooks on "
                  "the trained model as it reads a few validation sequences, and the training log.", "",
                  *measurements, ""]
    if notes:
        parts += ["## Notes", ""] + [f"- {note}" for note in notes] + [""]
    return "\n".join(parts)
