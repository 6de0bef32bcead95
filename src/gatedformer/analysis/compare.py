"""``compare``: train every variant of a recipe for N seeds and report them side by side.

Each run lives in ``OUT/<variant>/seed-<k>``. A finished run (``results.json`` present) is kept and
skipped, an interrupted one resumes from its checkpoint, so the command can be re-run until done.
The report (``OUT/report.md``) holds the paper-style table, the training-time and parameter tables,
the convergence figure and, for gated variants, the gate figures of their first seed.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gatedformer.analysis.matching import matched_config, with_matched_baseline
from gatedformer.analysis.report import (
    ComparisonReport,
    VariantSummary,
    format_table,
    render_report,
)
from gatedformer.analysis.step_timing import ROUNDS, TIMES_FILE, StepTimes, interleaved_step_times, recorded_or_measured
from gatedformer.config import (
    Recipe,
    RunConfig,
    Variant,
    build_config,
    check_overrides_spare_variants,
)
from gatedformer.errors import CheckpointError, ConfigError, GatedformerError
from gatedformer.io import atomic_write_json, atomic_write_text, read_limited
from gatedformer.tasks import task_for
from gatedformer.train.checkpoint import latest_checkpoint
from gatedformer.train.loop import (
    FINISHED_RUN_CHANGES,
    NonFiniteLoss,
    RunResult,
    TrainingInterrupted,
    saved_config_differences,
    train,
)
from gatedformer.train.progress import duration
from gatedformer.train.rundir import check_comparison_folder, claim_comparison_folder

__all__ = ["ComparisonReport", "VariantSummary", "format_table", "run_comparison", "slug"]


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


def _checkpoint_step(run_dir: Path) -> int:
    checkpoint = latest_checkpoint(run_dir) if run_dir.exists() else None
    match = re.search(r"(\d+)$", checkpoint.name) if checkpoint is not None else None
    return int(match.group(1)) if match else 0


class _Progress:
    """Which run, which step, and how long the whole comparison still needs.

    The time left is the steps left in every unfinished run times the wall-clock seconds per step of
    its variant, measured in this invocation (evaluations included; once a run has finished, its
    final evaluation on the whole valid and test splits too). Until a variant has been timed, the
    mean of the variants timed so far stands in, then the wall-clock seconds per step of runs
    finished earlier.
    """

    def __init__(self, enabled: bool, plans: list[tuple[Variant, int, RunConfig, Path]]) -> None:
        self.enabled = enabled
        self.plans = plans
        self.done = [c.train.steps if (d / "results.json").is_file() else _checkpoint_step(d)
                     for _, _, c, d in plans]
        self.rates: dict[str, float] = {}
        self.earlier: dict[str, float] = {}
        for variant, _, _, run_dir in plans:
            if (run_dir / "results.json").is_file() and variant.name not in self.earlier:
                done = RunResult.load(run_dir)
                self.earlier[variant.name] = (done.wall_seconds / done.steps if done.wall_seconds and done.steps
                                              else done.seconds_per_step)
        self.current = -1
        self.started = time.perf_counter()
        self.run_started = 0.0
        self.run_first_step = 0

    def say(self, message: str) -> None:
        if self.enabled:
            from tqdm.auto import tqdm

            tqdm.write(message, file=sys.stderr)
            sys.stderr.flush()

    def _rate(self, name: str) -> float | None:
        if name in self.rates:
            return self.rates[name]
        if self.rates:
            return sum(self.rates.values()) / len(self.rates)
        return self.earlier.get(name) or (sum(self.earlier.values()) / len(self.earlier) if self.earlier else None)

    def seconds_left(self) -> float | None:
        total = 0.0
        for i, (variant, _, config, _) in enumerate(self.plans):
            left = config.train.steps - self.done[i]
            if left <= 0:
                continue
            rate = self._rate(variant.name)
            if rate is None:
                return None
            total += left * rate
        return total

    def eta(self) -> str:
        left = self.seconds_left()
        return "" if left is None else f"; about {duration(left)} left in all"

    def _tag(self, index: int) -> str:
        variant, seed, _, _ = self.plans[index]
        return f"[{index + 1}/{len(self.plans)}] {variant.name} seed {seed}"

    def kept(self, index: int) -> None:
        self.say(f"{self._tag(index)}: finished earlier, kept")

    def start(self, index: int, resuming: bool) -> None:
        self.current = index
        self.run_started = time.perf_counter()
        self.run_first_step = self.done[index]
        steps = self.plans[index][2].train.steps
        where = f" (resuming at step {self.done[index]})" if resuming else ""
        self.say(f"{self._tag(index)}{where}: {steps} steps{self.eta()}")

    def record(self, record: dict[str, Any]) -> None:
        if self.current < 0 or record.get("event") not in ("train", "eval"):
            return
        step = int(record["step"])
        self.done[self.current] = step
        if step > self.run_first_step:
            variant = self.plans[self.current][0].name
            self.rates[variant] = (time.perf_counter() - self.run_started) / (step - self.run_first_step)
        if record["event"] == "eval":
            values = [f"{k[len('valid_'):]} {v:.3f}" for k, v in record.items()
                      if k.startswith("valid_") and k not in ("valid_loss", "valid_windows")
                      and isinstance(v, int | float)]
            total = self.plans[self.current][2].train.steps
            self.say(f"  {self._tag(self.current)}: step {step}/{total}, valid {', '.join(values) or '—'}"
                     f"{self.eta()}")

    def finish(self, index: int, result: RunResult | None) -> None:
        variant, _, config, _ = self.plans[index]
        took = time.perf_counter() - self.run_started
        if config.train.steps > self.run_first_step:  # the whole run, final evaluation on valid and test included
            self.rates[variant.name] = took / (config.train.steps - self.run_first_step)
        self.done[index] = config.train.steps
        score = f", test {result.metric} {result.test_metric:.3f}" if result is not None else ""
        self.say(f"{self._tag(index)}: done in {duration(took)}{score}{self.eta()}")


DIVERGED_FILE = "diverged.json"
"""Where a comparison that goes on past divergences (``compare --lr-sweep``) records them."""


class Divergences:
    """The runs of a comparison folder whose loss stopped being finite, in ``OUT/diverged.json``: ``{run folder
    relative to OUT: {"step": the step, "error": the error's line}}``, written as each is recorded (a comparison
    stopped later keeps them)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.path = out_dir / DIVERGED_FILE
        self.runs: dict[str, dict[str, Any]] = {}
        if self.path.is_file():
            try:
                data = json.loads(read_limited(self.path, 1 << 22))
                self.runs = {str(k): dict(v) for k, v in data.items()}
            except (OSError, ValueError, TypeError, AttributeError):
                raise CheckpointError(f"{self.path} is damaged; delete it (and the run folders it names) to train "
                                      "those runs again") from None

    def _key(self, run_dir: Path) -> str:
        return run_dir.relative_to(self.out_dir).as_posix()

    def has(self, run_dir: Path) -> bool:
        return self._key(run_dir) in self.runs

    def step(self, run_dir: Path) -> int:
        return int(self.runs[self._key(run_dir)]["step"])

    def record(self, run_dir: Path, error: Exception) -> None:
        found = re.search(r"at step (\d+)", str(error))
        self.runs[self._key(run_dir)] = {"step": int(found.group(1)) if found else 0, "error": str(error)}
        atomic_write_json(self.path, self.runs)

    def check(self, plans: list[tuple[Variant, int, RunConfig, Path]]) -> None:
        """Refuse a recorded divergence whose run was trained with other settings than these (as a finished run)."""
        for _, _, config, run_dir in plans:
            if self.has(run_dir) and (run_dir / "config.json").is_file():
                differences = saved_config_differences(run_dir, config, FINISHED_RUN_CHANGES)
                if differences:
                    raise ConfigError(f"{run_dir} diverged with other settings: {'; '.join(differences[:3])}; "
                                      f"delete it and its entry in {self.path} to train it with these, or choose "
                                      "another --out")

    def describe(self, name: str, plans: list[tuple[Variant, int, RunConfig, Path]]) -> str:
        """Which seeds of variant ``name`` diverged, and at which step."""
        return ", ".join(f"seed {seed} at step {self.step(d)}" for v, seed, _, d in plans
                         if v.name == name and self.has(d))


class ComparisonInterrupted(GatedformerError):
    """A signal stopped a comparison; its current run kept a checkpoint."""

    exit_code = 130


def _plan_runs(recipe: Recipe, variants: list[Variant], seeds: int, overrides: list[str], out_dir: Path
               ) -> list[tuple[Variant, int, RunConfig, Path]]:
    """Every variant × seed's config and run folder, all built before anything trains (so a bad variant fails at
    once); a finished run with other settings is refused, naming the fields."""
    plans = []
    for variant in variants:
        for seed in range(seeds):
            config = matched_config(recipe, overrides, variant)
            config.train.seed += seed
            plans.append((variant, seed, config, out_dir / slug(variant.name) / f"seed-{seed}"))
    for _, _, config, run_dir in plans:
        if (run_dir / "results.json").is_file():
            differences = saved_config_differences(run_dir, config, FINISHED_RUN_CHANGES)
            if differences:
                raise ConfigError(f"{run_dir} finished with other settings: {'; '.join(differences[:3])}; "
                                  "delete it to train it with these, or choose another --out")
    return plans


def _train_plans(plans: list[tuple[Variant, int, RunConfig, Path]], data_dir: str | Path | None, progress: bool,
                 shared: Any, diverged: Divergences | None = None) -> _Progress:
    """Train every planned run that has not finished (an interrupted one resumes), one after another. With
    ``diverged``, a run whose loss stops being finite is recorded there as diverged and the others go on (a run
    recorded so earlier is kept as it is); without it, it stops the comparison."""
    tracker = _Progress(progress, plans)
    trained = 0
    for index, (_, _, config, run_dir) in enumerate(plans):
        if (run_dir / "results.json").is_file():
            tracker.kept(index)
            continue
        if diverged is not None and diverged.has(run_dir):
            tracker.done[index] = config.train.steps
            tracker.say(f"{tracker._tag(index)}: diverged earlier at step {diverged.step(run_dir)}, kept as diverged")
            continue
        resuming = run_dir.exists() and latest_checkpoint(run_dir) is not None
        tracker.start(index, resuming)
        try:
            result = train(config, run_dir, data_dir=data_dir, resume=resuming, progress=progress, shared=shared,
                           on_record=tracker.record)
        except TrainingInterrupted as stop:
            interrupted = ComparisonInterrupted(
                f"stopped by signal {stop.signal} at step {stop.step} of {run_dir}; checkpoint saved — run the same "
                "compare command again to continue: finished runs are kept and this one resumes")
            interrupted.exit_code = stop.exit_code  # 128 + the signal, as for train
            raise interrupted from None
        except NonFiniteLoss as err:
            if diverged is None:
                raise
            diverged.record(run_dir, err)
            tracker.done[index] = config.train.steps  # nothing left of it for the time estimate
            tracker.say(f"{tracker._tag(index)}: diverged at step {diverged.step(run_dir)}; recorded, going on")
            continue
        tracker.finish(index, result)
        trained += 1
    if trained:
        tracker.say(f"all {len(plans)} runs done; this invocation trained {trained} in "
                    f"{duration(time.perf_counter() - tracker.started)}")
    return tracker


def _without_diverged(variants: list[Variant], plans: list[tuple[Variant, int, RunConfig, Path]], diverged: Divergences,
                      notes: list[str]) -> list[Variant]:
    """The variants none of whose seeds diverged; a note for each left out (and for a baseline left out)."""
    lost = [v for v in variants if any(diverged.has(d) for p, _, _, d in plans if p is v)]
    notes += [f"{v.name} diverged ({diverged.describe(v.name, plans)}): left out of the tables" for v in lost]
    kept = [v for v in variants if v not in lost]
    if kept and lost and lost[0] is variants[0]:
        notes.append(f"the baseline diverged: the changes are against {kept[0].name}")
    return kept


def _step_times(variants: list[Variant], plans: list[tuple[Variant, int, RunConfig, Path]], out_dir: Path,
                data_dir: str | Path | None, shared: Any, tracker: _Progress, notes: list[str]) -> StepTimes:
    """Every variant's training step timed interleaved in this process, or the measurement a previous run of these
    configs recorded (measured again, the ratios would change with the load of the moment, silently)."""
    firsts = {v.name: next(c for p, _, c, _ in plans if p is v) for v in variants}

    def measure() -> StepTimes:
        tracker.say(f"timing every variant's training step, interleaved ({ROUNDS} rounds)")
        return interleaved_step_times(firsts, data_dir, shared)

    step_times, timing_notes = recorded_or_measured(firsts, out_dir, measure)
    notes += timing_notes
    if step_times.recorded:
        tracker.say(f"step times: the measurement of {step_times.measured}, kept in {out_dir / TIMES_FILE}")
    return step_times


def run_comparison(recipe: Recipe, out_dir: Path, seeds: int = 1, overrides: list[str] | None = None,
                   data_dir: str | Path | None = None, progress: bool = True,
                   only: list[str] | None = None, tensorboard: bool = False, matched_baseline: str | None = None,
                   step_timing: bool = True, diverging: bool = False, shared: Any = None) -> ComparisonReport:
    """Train (or pick up) every variant × seed, then write ``report.md`` and its figures. ``matched_baseline`` (a
    variant's name, or ``""`` for the largest) adds a baseline of that variant's size; ``step_timing`` times every
    variant's training step interleaved in this process for the training-time table. ``diverging`` records a run
    whose loss stops being finite in ``OUT/diverged.json`` and goes on (the report leaves out the variants with a
    diverged seed, naming them), where without it such a run stops the comparison (exit 3); ``shared`` is the
    task's shared data where the caller has read it (:meth:`~gatedformer.tasks.base.Task.shared_data`)."""
    if seeds < 1:
        raise ConfigError(f"--seeds must be at least 1, got {seeds}")
    check_overrides_spare_variants(recipe, list(overrides or []))
    if matched_baseline is not None:
        recipe = with_matched_baseline(recipe, list(overrides or []), matched_baseline)
    variants = _select(recipe, only)
    if len({slug(v.name) for v in variants}) != len(variants):
        raise ConfigError(f"recipe {recipe.name} has two variants with the same folder name; rename one")
    overrides = list(overrides or []) + (["train.tensorboard=true"] if tensorboard else [])
    # "" would mean the current folder; a folder of the user's files (their report.md) is refused before any work
    out_dir = check_comparison_folder(out_dir)
    plans = _plan_runs(recipe, variants, seeds, overrides, out_dir)
    if any(config.train.tensorboard for _, _, config, _ in plans):
        from gatedformer.train.tensorboard import require_tensorboard

        require_tensorboard()

    # Runs on one corpus share what their task lets them (a language model's corpus is read once for all).
    if shared is None:
        shared = task_for(plans[0][2]).shared_data(plans[0][2], data_dir)
    claim_comparison_folder(out_dir)
    diverged = Divergences(out_dir) if diverging else None
    if diverged is not None:
        diverged.check(plans)
    tracker = _train_plans(plans, data_dir, progress, shared, diverged)

    notes: list[str] = []
    if diverged is not None:
        variants = _without_diverged(variants, plans, diverged, notes)
        if not variants:
            report_path = out_dir / "report.md"
            atomic_write_text(report_path, f"# {recipe.name}: comparison\n\nEvery variant diverged: "
                              + "; ".join(notes) + "\n")
            return ComparisonReport("", report_path, [], [], notes)
    summaries = []
    for variant in variants:
        _, _, config, first_dir = next(p for p in plans if p[0] is variant)
        results = [_load_result(out_dir / slug(variant.name) / f"seed-{s}") for s in range(seeds)]
        summaries.append(VariantSummary(variant.name, results, variant.published,
                                        _steps_per_epoch(config, results, shared),
                                        _components(config, first_dir, data_dir, shared)))
    metric = summaries[0].results[0].metric
    step_times = _step_times(variants, plans, out_dir, data_dir, shared, tracker, notes) if step_timing else None
    table = format_table(summaries, metric, recipe, step_times)
    if seeds == 1:
        notes.append("One seed per variant: the changes against the baseline carry no spread, so a small one may be "
                     "seed-to-seed variation; `--seeds 3` pairs each change with its spread over seeds.")
    convergence = _convergence(summaries, metric, out_dir, notes)
    gate_figures = _gate_figures(summaries, out_dir, notes)
    measured, measure_figures = _measurements(summaries, out_dir, data_dir, shared, notes)
    base_config = build_config(recipe, overrides)
    setup = (f"Corpus `{base_config.data.corpus}`, backbone `{base_config.model.backbone}`, "
             f"{base_config.model.n_layers} layers, d_model {base_config.model.d_model}, "
             f"{base_config.train.steps} steps, {seeds} seed(s) per variant"
             + (f", overrides: `{' '.join(overrides)}`" if overrides else "") + ".")
    report_path = out_dir / "report.md"
    text = render_report(recipe, summaries, table, metric=metric, corpus=base_config.data.corpus, setup=setup,
                         convergence=convergence, gate_figures=gate_figures, notes=notes, out_dir=out_dir,
                         step_times=step_times, measurements=measured)
    atomic_write_text(report_path, text)
    figures = convergence + [f for group in gate_figures.values() for f in group] + measure_figures
    return ComparisonReport(table, report_path, figures, summaries, notes)


def _load_result(run_dir: Path) -> RunResult:
    result = RunResult.load(run_dir)
    result.run_dir = str(run_dir)  # where it is now, should the folder have moved since
    return result


def _steps_per_epoch(config: RunConfig, results: list[RunResult], shared: Any) -> int | None:
    """Training steps per epoch, as the results say (results written before they kept it: from the shared data)."""
    known = next((r.steps_per_epoch for r in results if r.steps_per_epoch), 0)
    if known or shared is None:
        return known or None
    task = task_for(config)
    return task.steps_per_epoch(task.load_data(config, None, shared=shared), config, None)


def _components(config: RunConfig, run_dir: Path, data_dir: str | Path | None, shared: Any) -> dict[str, int] | None:
    """Parameters per component of the variant's model, rebuilt from its config (weights not needed)."""
    from gatedformer.analysis.params import count_by_component

    task = task_for(config)
    try:
        data = shared if shared is not None else task.inference_data(config, run_dir, data_dir)
        with torch.device("meta"):  # shapes only
            return count_by_component(task.build_model(config, data))
    except GatedformerError:
        return None


def _convergence(summaries: list[VariantSummary], metric: str, out_dir: Path, notes: list[str]) -> list[Path]:
    try:
        from gatedformer.analysis.plots import plot_convergence

        runs = {s.name: [Path(r.run_dir) for r in s.results] for s in summaries}
        return [plot_convergence(runs, metric, out_dir / "convergence.png")]
    except ImportError:
        notes.append("convergence figure skipped: matplotlib is missing (pip install 'gatedformer[plot]')")
        return []


def _gate_figures(summaries: list[VariantSummary], out_dir: Path, notes: list[str]) -> dict[str, list[Path]]:
    """Gate figures of each gated variant's first seed, under ``OUT/gates``."""
    from gatedformer.analysis.gates import analyze_run, run_has_gates

    gated = [s for s in summaries if run_has_gates(s.results[0].run_dir)]
    figures: dict[str, list[Path]] = {}
    for s in gated:
        try:
            analysis = analyze_run(s.results[0].run_dir, out_dir / "gates", prefix=f"{slug(s.name)}-",
                                   title=f"{s.name}, seed 0")
        except GatedformerError as err:  # the analysis extra is missing: the report still comes out
            notes.append(f"gate figures skipped: {err}")
            break
        figures[s.name] = analysis.figures
        notes += [f"{s.name}: {note}" for note in analysis.notes]
    return figures


def _measurements(summaries: list[VariantSummary], out_dir: Path, data_dir: str | Path | None, shared: Any,
                  notes: list[str]) -> tuple[list[str], list[Path]]:
    """The gated-attention papers' measurements of every seed of every variant
    (:mod:`~gatedformer.analysis.measurements`): the report's lines (tables, figures) and the figures drawn."""
    from gatedformer.analysis.measurements import measure_run, measurement_tables, plot_loss_spikes, plot_measurements

    batches: dict[str, Any] = {}  # one validation batch for every run of the same data settings
    measured = {s.name: [measure_run(r.run_dir, data_dir, corpus=shared, batches=batches) for r in s.results]
                for s in summaries}
    notes += list(dict.fromkeys(note for runs in measured.values() for m in runs for note in m.notes))
    parts = measurement_tables(measured)
    figures: list[Path] = []
    try:
        drawn = [plot_measurements(measured, out_dir / "measurements.png"),
                 plot_loss_spikes({name: runs[0] for name, runs in measured.items()}, out_dir / "loss_spikes.png",
                                  title="first seed")]
        figures = [f for f in drawn if f is not None]
    except ImportError:
        notes.append("measurement figures skipped: matplotlib is missing (pip install 'gatedformer[plot]')")
    parts += [f"![{f.stem}]({f.relative_to(out_dir).as_posix()})" for f in figures]
    return parts, figures
