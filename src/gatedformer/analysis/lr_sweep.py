"""``compare --lr-sweep``: every variant of a recipe at several learning rates, for the gated-attention paper's
stability claim (Qiu et al. 2025: the attention output gate tolerates larger learning rates).

Each rate is a comparison of its own in ``OUT/lr-<rate>`` (its runs, ``report.md`` and figures, as ``compare`` writes
them), trained with ``optim.lr`` set to the rate, one rate after another. A run whose loss stops being finite — the
training loop stops it with exit status 3 (``train.nonfinite=stop``) — is recorded as diverged in that comparison's
``diverged.json`` and the sweep goes on; finished runs are kept and a re-run picks the sweep up where it stopped.
``OUT/report.md`` sets the final validation loss of every variant at every rate beside its divergences, and
``OUT/lr_sweep.png`` draws it.

A sweep is an option of ``compare`` rather than a recipe field: it is a way of running any recipe, as ``--seeds``
is, and the rates a user tries depend on their machine and patience, not on the recipe.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from gatedformer.analysis.compare import Divergences, _select, run_comparison, slug
from gatedformer.analysis.report import ComparisonReport, markdown_table
from gatedformer.config import Recipe, build_config
from gatedformer.errors import ConfigError
from gatedformer.io import atomic_write_text
from gatedformer.tasks import task_for
from gatedformer.train.loop import RunResult
from gatedformer.train.rundir import check_comparison_folder, claim_comparison_folder

__all__ = ["parse_rates", "rate_folder", "run_lr_sweep"]


def parse_rates(text: str) -> list[float]:
    """``"1e-3,3e-3,1e-2"`` as rates: each a finite number above 0, no rate twice; a :class:`ConfigError` naming the
    first that is not."""
    rates = []
    for word in text.split(","):
        try:
            rate = float(word)
        except ValueError:
            rate = math.nan
        if not math.isfinite(rate) or rate <= 0:
            raise ConfigError(f"--lr-sweep {text!r}: {word.strip() or 'an empty entry'!r} is not a learning rate above "
                              "0; give rates separated by commas, e.g. --lr-sweep 1e-3,3e-3,1e-2")
        if rate in rates:
            raise ConfigError(f"--lr-sweep {text!r} names {word.strip()} twice; give each rate once")
        rates.append(rate)
    return rates


def rate_folder(out_dir: Path, rate: float) -> Path:
    """The comparison folder of one rate, ``OUT/lr-0.003``."""
    return out_dir / f"lr-{rate:g}"


def _check_lr_is_free(recipe: Recipe, overrides: list[str]) -> None:
    """The sweep sets ``optim.lr``: a variant or a ``--set`` that sets it too would be overruled without a word."""
    for variant in recipe.variants:
        if any(o.split("=", 1)[0].strip() == "optim.lr" for o in variant.overrides):
            raise ConfigError(f"recipe {recipe.name}'s variant {variant.name!r} sets optim.lr, which --lr-sweep sets "
                              "for every variant; sweep a recipe whose variants leave the rate alone")
    if any(o.split("=", 1)[0].strip() == "optim.lr" for o in overrides):
        raise ConfigError("--set optim.lr and --lr-sweep both set the learning rate; leave out --set optim.lr")


def run_lr_sweep(recipe: Recipe, out_dir: str | Path, rates: list[float], seeds: int = 1,
                 overrides: list[str] | None = None, data_dir: str | Path | None = None, progress: bool = True,
                 only: list[str] | None = None, tensorboard: bool = False, matched_baseline: str | None = None,
                 step_timing: bool = True) -> ComparisonReport:
    """Every variant × seed at every rate (see the module); the first rate's comparison times the steps (the rate
    does not change them). Returns the sweep's table and report."""
    overrides = list(overrides or [])
    if seeds < 1:
        raise ConfigError(f"--seeds must be at least 1, got {seeds}")
    if not rates:
        raise ConfigError("--lr-sweep needs at least one rate, e.g. --lr-sweep 1e-3,3e-3,1e-2")
    _check_lr_is_free(recipe, overrides)
    build_config(recipe, overrides)  # a bad --set is refused before any folder is made
    out_dir = check_comparison_folder(out_dir)
    for rate in rates:
        check_comparison_folder(rate_folder(out_dir, rate))
    claim_comparison_folder(out_dir)
    names = [v.name for v in _select(recipe, only)]
    base = build_config(recipe, overrides)
    shared = task_for(base).shared_data(base, data_dir)
    reports: dict[float, ComparisonReport] = {}
    for rate in rates:
        reports[rate] = run_comparison(recipe, rate_folder(out_dir, rate), seeds, [*overrides, f"optim.lr={rate!r}"],
                                       data_dir, progress, only, tensorboard, matched_baseline,
                                       step_timing=step_timing and rate == rates[0], diverging=True, shared=shared)
        names += [s.name for s in reports[rate].summaries if s.name not in names]  # a matched baseline added
    table = sweep_table(out_dir, rates, names, seeds)
    figures = _sweep_figure(out_dir, rates, names, seeds)
    notes = [f"lr {rate:g}: {note}" for rate, report in reports.items() for note in report.notes
             if "diverged" in note]
    text = "\n".join([
        f"# {recipe.name}: learning-rate sweep", "", recipe.description, "",
        f"Every variant at learning rates {', '.join(f'{r:g}' for r in rates)} (`optim.lr`; the schedule, warm-up "
        f"and clipping as the recipe sets them), {seeds} seed(s) each"
        + (f", overrides: `{' '.join(overrides)}`" if overrides else "") + ".", "",
        "## Final validation loss and divergences per learning rate", "",
        "Final validation loss (nats per token) over the seeds that finished, mean ± standard deviation; a run whose "
        "loss or gradients stopped being finite diverged (the training loop stops it, exit status 3) and is counted "
        "apart, with the step where it stopped. The gated-attention paper (Qiu et al. 2025) reports its gate "
        "tolerating learning rates at which the baseline's loss spikes or diverges.", "",
        table, "",
        *[f"![{f.stem}]({f.relative_to(out_dir).as_posix()})" for f in figures], "",
        "## Each rate's comparison", "",
        *[f"- lr {rate:g}: [{report.report_path.relative_to(out_dir).as_posix()}]"
          f"({report.report_path.relative_to(out_dir).as_posix()})" for rate, report in reports.items()], "",
        *(["## Notes", "", *[f"- {note}" for note in notes], ""] if notes else []),
    ])
    report_path = out_dir / "report.md"
    atomic_write_text(report_path, text)
    return ComparisonReport(table, report_path, figures, [s for r in reports.values() for s in r.summaries], notes)


def _outcomes(out_dir: Path, rate: float, name: str, seeds: int) -> tuple[list[float], list[int]]:
    """The final validation losses of a variant's finished seeds at ``rate``, and the steps where the others
    diverged."""
    folder = rate_folder(out_dir, rate)
    diverged = Divergences(folder)
    losses, steps = [], []
    for seed in range(seeds):
        run_dir = folder / slug(name) / f"seed-{seed}"
        if diverged.has(run_dir):
            steps.append(diverged.step(run_dir))
        elif (run_dir / "results.json").is_file():
            losses.append(RunResult.load(run_dir).valid_loss)
    return losses, steps


def sweep_table(out_dir: Path, rates: list[float], names: list[str], seeds: int) -> str:
    """Variants down, rates across: each cell the final validation loss and the diverged seeds."""
    rows = []
    for name in names:
        row = [name]
        for rate in rates:
            losses, steps = _outcomes(out_dir, rate, name, seeds)
            cell = "—"
            if losses:
                cell = (f"{statistics.fmean(losses):.3f} ± {statistics.stdev(losses):.3f}" if len(losses) > 1
                        else f"{losses[0]:.3f}")
            if steps:
                where = ", ".join(str(s) for s in steps)
                cell = (f"diverged {len(steps)}/{seeds} (step {where})" if not losses
                        else f"{cell}; diverged {len(steps)}/{seeds} (step {where})")
            row.append(cell)
        rows.append(row)
    return markdown_table(["variant", *(f"lr {r:g}" for r in rates)], rows)


def _sweep_figure(out_dir: Path, rates: list[float], names: list[str], seeds: int) -> list[Path]:
    """Final validation loss against the rate (log scale), a line per variant; a cross at the top where a seed
    diverged."""
    try:
        from gatedformer.analysis.plots import _pyplot, _save

        plt = _pyplot()
    except ImportError:
        return []
    fig, axis = plt.subplots(figsize=(6.5, 4.2), layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    outcomes = {n: [_outcomes(out_dir, r, n, seeds) for r in rates] for n in names}
    finished = [x for n in names for losses, _ in outcomes[n] for x in losses]
    top = max(finished) * 1.05 if finished else 1.0
    for i, name in enumerate(names):
        color = colors[i % len(colors)]
        xs = [r for r, (losses, _) in zip(rates, outcomes[name], strict=True) if losses]
        ys = [statistics.fmean(losses) for losses, _ in outcomes[name] if losses]
        axis.plot(xs, ys, marker="o", color=color, label=name)
        lost = [r for r, (_, steps) in zip(rates, outcomes[name], strict=True) if steps]
        if lost:
            # staggered, so that the variants that diverged at one rate show one cross each
            axis.scatter(lost, [top * (1 + 0.01 * i)] * len(lost), marker="x", color=color, s=60, zorder=3)
    axis.set_xscale("log")
    axis.set(xlabel="learning rate (optim.lr)", ylabel="final valid loss (nats/token)",
             title="learning-rate robustness (× at the top: a seed diverged)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    return [_save(fig, out_dir / "lr_sweep.png")]
