"""The EAU/GRC paper's BERT experiments in one command (§4.2–4.3): pretrain every variant of a masked-LM recipe,
fine-tune each on every GLUE task of ``finetune.tasks`` whose data is present or can be fetched, and write the
report: Table 2's layout (tasks × variants, mean ± std over seeds, the published numbers beside ours), the MLM table
and Figure 2 (the MLM loss curves).

Runs live in ``OUT/<variant>/seed-<k>/pretrain`` and ``OUT/<variant>/seed-<k>/<task>``; a finished run is kept (for
the same settings), an interrupted one resumes, so the command can be run again until it is done. A recipe with no
GLUE task to be had (offline, with none present; or ``finetune.tasks`` empty) is the pretraining comparison alone.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gatedformer.analysis.compare import slug
from gatedformer.analysis.report import ComparisonReport, markdown_table
from gatedformer.analysis.text_tasks import register_comparison
from gatedformer.config import Recipe, RunConfig, Variant, build_config, check_overrides_spare_variants
from gatedformer.data.glue import glue_task, locate_glue
from gatedformer.errors import ConfigError, DataError, GatedformerError
from gatedformer.io import atomic_write, atomic_write_text, read_limited
from gatedformer.tasks import task_for
from gatedformer.tasks.glue import finetune_config
from gatedformer.train.checkpoint import JSON_BYTES, latest_checkpoint
from gatedformer.train.loop import FINISHED_RUN_CHANGES, RunResult, TrainingInterrupted, saved_config_differences, train
from gatedformer.train.rundir import check_comparison_folder, claim_comparison_folder
from gatedformer.train.runlog import eval_series, read_log, series

__all__ = ["PUBLISHED_TABLE_2", "run_glue_comparison", "train_or_keep"]

PUBLISHED_TABLE_2: dict[str, tuple[str, tuple[float, float, float, float]]] = {
    "mrpc": ("accuracy", (73.04, 81.86, 78.92, 79.41)),
    "rte": ("accuracy", (57.04, 58.84, 57.40, 62.45)),
    "wnli": ("accuracy", (52.11, 56.30, 46.48, 56.34)),
    "sst2": ("accuracy", (89.79, 88.88, 89.91, 89.68)),
    "qnli": ("accuracy", (86.31, 86.00, 86.06, 86.02)),
    "cola": ("matthews", (0.450, 0.452, 0.464, 0.451)),
    "stsb": ("pearson_spearman", (0.833, 0.821, 0.840, 0.835)),
}
"""Dhayalkar 2024, Table 2: BERT / +EAU / +GRC / +EAU+GRC, accuracies in %, correlations as fractions."""
PUBLISHED_SPECS = ("", "+EAU", "+GRC", "+EAU+GRC")
"""The gate spec of each of Table 2's columns."""
_METRIC_LABELS = {"accuracy": "accuracy (%)", "matthews": "Matthews corr.", "pearson_spearman": "Pearson–Spearman"}


def _say(progress: bool, message: str) -> None:
    if progress:
        from tqdm.auto import tqdm

        tqdm.write(message, file=sys.stderr)


def train_or_keep(config: RunConfig, run_dir: Path, data_dir: str | Path | None, progress: bool, label: str,
                  shared: Any = None, ignore: set[str] | None = None) -> RunResult:
    """Train ``config`` into ``run_dir``, keep it where it finished with the same settings (but ``ignore``), resume
    it where it stopped."""
    if (run_dir / "results.json").is_file():
        differences = saved_config_differences(run_dir, config, FINISHED_RUN_CHANGES | (ignore or set()))
        if differences:
            raise ConfigError(f"{run_dir} finished with other settings: {'; '.join(differences[:3])}; delete it to "
                              "train it with these, or choose another --out")
        _say(progress, f"{label}: finished earlier, kept")
        result = RunResult.load(run_dir)
        result.run_dir = str(run_dir)
        return result
    resuming = run_dir.exists() and latest_checkpoint(run_dir) is not None
    _say(progress, f"{label}{' (resuming)' if resuming else ''}: {config.train.steps} steps")
    started = time.perf_counter()
    try:
        result = train(config, run_dir, data_dir=data_dir, resume=resuming, progress=progress, shared=shared)
    except TrainingInterrupted as stop:
        raise ComparisonInterrupted(f"stopped by signal {stop.signal} at step {stop.step} of {run_dir}; checkpoint "
                                    "saved — run the same compare command again to continue: finished runs are "
                                    "kept and this one resumes") from None
    assert result is not None
    _say(progress, f"{label}: done in {time.perf_counter() - started:.0f} s, valid {result.metric} "
                   f"{result.valid_metric:.4f}")
    return result


class ComparisonInterrupted(GatedformerError):
    exit_code = 130


def select_variants(recipe: Recipe, only: list[str] | None) -> list[Variant]:
    if not only:
        return recipe.variants
    chosen = [v for v in recipe.variants if v.name in only or slug(v.name) in only]
    missing = [n for n in only if n not in {v.name for v in chosen} | {slug(v.name) for v in chosen}]
    if missing:
        raise ConfigError(f"recipe {recipe.name} has no variant {missing[0]!r}; its variants: "
                          f"{', '.join(v.name for v in recipe.variants)}")
    return chosen


def _finetune_fields() -> set[str]:
    from gatedformer.config import FinetuneConfig

    return {f"finetune.{f.name}" for f in dataclasses.fields(FinetuneConfig)}


def _mean_std(values: list[float], scale: float, digits: int) -> str:
    values = [v * scale for v in values]
    if not values:
        return "—"
    if len(values) > 1:
        return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"
    return f"{values[0]:.{digits}f}"


def _published_column(variant: Variant, config: RunConfig) -> int | None:
    spec = config.model.gates.replace(" ", "").upper()
    return next((i for i, s in enumerate(PUBLISHED_SPECS) if s.upper() == spec), None)


def table_2(variants: list[Variant], configs: dict[str, RunConfig], scores: dict[tuple[str, str], list[float]],
            tasks: list[str]) -> str:
    """Table 2's layout: a row per task (its metric), a column per variant with the published number beside."""
    header = ["GLUE task", "metric"]
    for variant in variants:
        header += [variant.name, "published"]
    rows = []
    for task in tasks:
        metric, published = PUBLISHED_TABLE_2[task]
        scale, digits = (100.0, 2) if metric == "accuracy" else (1.0, 3)
        row = [glue_task(task).folder, _METRIC_LABELS[metric]]
        for variant in variants:
            row.append(_mean_std(scores.get((variant.name, task), []), scale, digits))
            column = _published_column(variant, configs[variant.name])
            row.append("—" if column is None else f"{published[column]:.{digits}f}")
        rows.append(row)
    if tasks:
        row = ["average", "(metrics × 100)"]
        for variant in variants:
            means = [statistics.fmean(scores[(variant.name, t)]) * 100 for t in tasks if scores.get((variant.name, t))]
            row.append(f"{statistics.fmean(means):.2f}" if len(means) == len(tasks) else "—")
            column = _published_column(variant, configs[variant.name])
            published = [PUBLISHED_TABLE_2[t][1][column] * (1 if PUBLISHED_TABLE_2[t][0] == "accuracy" else 100)
                         for t in tasks] if column is not None else []
            row.append(f"{statistics.fmean(published):.2f}" if published else "—")
        rows.append(row)
    return markdown_table(header, rows)


def _result_field(result: RunResult, key: str) -> float | None:
    """A field of a run's ``results.json`` beyond :class:`RunResult`'s (the masked-token accuracy), if it is there."""
    try:
        value = json.loads(read_limited(Path(result.run_dir) / "results.json", JSON_BYTES)).get(key)
    except (OSError, ValueError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def mlm_table(variants: list[Variant], pretrained: dict[str, list[RunResult]]) -> str:
    header = ["variant", "valid MLM loss", "valid ppl", "valid acc. (%)", "test MLM loss", "test ppl",
              "test acc. (%)", "params", "s/step (own run)"]  # runs one after another: load skews it
    rows = []
    for variant in variants:
        results = pretrained[variant.name]
        accuracy = {split: [v for r in results if (v := _result_field(r, f"{split}_accuracy")) is not None]
                    for split in ("valid", "test")}
        rows.append([variant.name, _mean_std([r.valid_loss for r in results], 1, 4),
                     _mean_std([r.valid_metric for r in results], 1, 2), _mean_std(accuracy["valid"], 100, 2),
                     _mean_std([r.test_loss for r in results], 1, 4),
                     _mean_std([r.test_metric for r in results], 1, 2), _mean_std(accuracy["test"], 100, 2),
                     f"{results[0].params:,}",
                     f"{statistics.fmean(r.seconds_per_step for r in results):.3f}"])
    return markdown_table(header, rows)


def figure_2(pretrained: dict[str, list[RunResult]], path: Path) -> Path:
    """The MLM loss of every variant against the training step: validation (the evaluations during training) and
    training loss; the mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, results in pretrained.items():
        evaluations = [eval_series(read_log(r.run_dir), "valid_loss") for r in results]
        trains = [series(read_log(r.run_dir), "train", "train_loss") for r in results]
        color = None
        for axis, runs in ((left, [curve for curve, _ in evaluations]), (right, trains)):
            runs = [run for run in runs if run[0]]
            if not runs:
                continue
            steps = runs[0][0][: min(len(run[0]) for run in runs)]
            mean = [statistics.fmean(run[1][i] for run in runs) for i in range(len(steps))]
            (line,) = axis.plot(steps, mean, marker="o" if axis is left else None, markersize=3, label=name)
            color = color or line.get_color()
        ends = [last for _, last in evaluations if last is not None]
        if ends:  # the last evaluation scores the whole split, the others its first windows: a point of its own
            left.plot(ends[0][0], statistics.fmean(end[1] for end in ends), marker="*", markersize=11,
                      linestyle="none", color=color)
    left.set(xlabel="step", ylabel="MLM loss (nats)",
             title="validation MLM loss (★: the whole split at the end)")
    right.set(xlabel="step", ylabel="MLM loss (nats)", title="training MLM loss")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend()
    fig.suptitle("Masked language modelling loss (the EAU/GRC paper's Figure 2)")
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png"))
    plt.close(fig)
    return path


@register_comparison("mlm")
def run_glue_comparison(recipe: Recipe, out_dir: Path, seeds: int = 1, overrides: list[str] | None = None,
                        data_dir: str | Path | None = None, progress: bool = True,
                        only: list[str] | None = None) -> ComparisonReport:
    """Pretrain every variant × seed of a masked-LM recipe, fine-tune each on the GLUE tasks present or fetched, write
    ``OUT/report.md``."""
    if seeds < 1:
        raise ConfigError(f"--seeds must be at least 1, got {seeds}")
    overrides = list(overrides or [])
    check_overrides_spare_variants(recipe, overrides)
    variants = select_variants(recipe, only)
    out_dir = check_comparison_folder(out_dir)  # never over the user's report.md
    configs = {v.name: build_config(recipe, overrides, v) for v in variants}
    base = next(iter(configs.values()))
    notes: list[str] = []
    tasks = []
    for name in base.finetune.tasks.split():
        task = glue_task(name)
        try:
            locate_glue(task, data_dir)
        except DataError:
            notes.append(f"{task.corpus}: no data (run `gatedformer data fetch {task.corpus}`); not fine-tuned")
            continue
        tasks.append(task.name)
    claim_comparison_folder(out_dir)
    ignore = _finetune_fields()  # they change the fine-tuning only
    shared = task_for(base).shared_data(base, data_dir)
    pretrained: dict[str, list[RunResult]] = {}
    scores: dict[tuple[str, str], list[float]] = {}
    for variant in variants:
        for seed in range(seeds):
            config = build_config(recipe, overrides, variant)
            config.train.seed += seed
            run = out_dir / slug(variant.name) / f"seed-{seed}"
            label = f"{variant.name} seed {seed}"
            result = train_or_keep(config, run / "pretrain", data_dir, progress, f"{label} pretraining", shared,
                                   ignore)
            pretrained.setdefault(variant.name, []).append(result)
            for task in tasks:
                ft_overrides = [o for o in overrides if o.partition("=")[0].strip() in ignore]
                ft = finetune_config(run / "pretrain", task, ft_overrides, data_dir)
                # The pretrained run it starts from is the one beside it, wherever OUT has moved since.
                done = train_or_keep(ft, run / task, data_dir, progress, f"{label} {task}", ignore={"train.init_from"})
                scores.setdefault((variant.name, task), []).append(done.valid_metric)
    figures: list[Path] = []
    try:
        figures.append(figure_2(pretrained, out_dir / "figure2_mlm_loss.png"))
    except ImportError:
        notes.append("Figure 2 skipped: matplotlib is missing (pip install 'gatedformer[plot]')")
    table = table_2(variants, configs, scores, tasks) if tasks else mlm_table(variants, pretrained)
    text = _report(recipe, variants, configs, pretrained, scores, tasks, figures, notes, out_dir, seeds)
    report_path = out_dir / "report.md"
    atomic_write_text(report_path, text)
    return ComparisonReport(table, report_path, figures, notes=notes)


def _report(recipe: Recipe, variants: list[Variant], configs: dict[str, RunConfig],
            pretrained: dict[str, list[RunResult]], scores: dict[tuple[str, str], list[float]], tasks: list[str],
            figures: list[Path], notes: list[str], out_dir: Path, seeds: int) -> str:
    base = configs[variants[0].name]
    m, ft = base.model, base.finetune
    cap = []
    if ft.max_train_examples:
        cap.append(f"at most {ft.max_train_examples:,} training examples per task")
    if ft.max_eval_examples:
        cap.append(f"at most {ft.max_eval_examples:,} validation examples")
    parts = [f"# {recipe.name}: BERT pretraining and GLUE fine-tuning", "", recipe.description, "",
             f"Pretraining: `{base.data.corpus}` masked LM, {m.n_layers} layers, d {m.d_model}, {m.n_heads} heads, "
             f"FFN {m.d_ffn}, sequences of {base.data.seq_len}, batch {base.data.batch_size}, {base.train.steps} "
             f"steps; {seeds} seed(s) per variant.", ""]
    if tasks:
        epochs = ft.epochs or "the paper's (3; CoLA 5, RTE 8)"
        parts += [f"Fine-tuning: batch {ft.batch_size}, sequences of at most {ft.seq_len}, AdamW lr {ft.lr:g} "
                  f"β2 {ft.beta2:g} weight decay {ft.weight_decay:g}, linear decay, {epochs} epochs"
                  + (f", {' and '.join(cap)} (drawn once with a fixed seed)" if cap else "") + ".", "",
                  "## Table 2: GLUE validation scores", "",
                  "The best validation evaluation of each fine-tuning run (one per epoch), mean ± std over seeds; "
                  "accuracies in %, correlations as fractions. `published` is Dhayalkar 2024's Table 2 for the same "
                  "gates (BERT-base, WikiText-103, full GLUE): compare directions of change, not values.", "",
                  table_2(variants, configs, scores, tasks), ""]
    parts += ["## Masked language modelling", "", "The MLM loss (nats per masked token), its perplexity and the "
              "accuracy of the masked tokens' predictions on the whole validation and test splits at the end of "
              "pretraining.", "", mlm_table(variants, pretrained), ""]
    for figure in figures:
        parts += ["## Figure 2: MLM loss", "", f"![{figure.stem}]({figure.relative_to(out_dir).as_posix()})", ""]
    if notes:
        parts += ["## Notes", ""] + [f"- {note}" for note in notes] + [""]
    return "\n".join(parts)

