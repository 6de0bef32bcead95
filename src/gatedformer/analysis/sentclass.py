"""The SRU paper's sentence classification in one command (§4.1, appendix B.1): every variant of a recipe on every
set of ``sentclass.sets``, each fold of the cross-validated sets (MR, CR, SUBJ, MPQA) and ``--seeds`` seeds of the
others (TREC, SST); the report puts the mean ± std test accuracy (at the best validation accuracy) of each set and
variant beside the published SRU accuracies.

Runs live in ``OUT/<variant>/<set>/fold-<k>`` or ``OUT/<variant>/<set>/seed-<k>``; a finished run is kept (for the
same settings), an interrupted one resumes.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from gatedformer.analysis.compare import slug
from gatedformer.analysis.glue import select_variants, train_or_keep
from gatedformer.analysis.report import ComparisonReport, markdown_table
from gatedformer.analysis.text_tasks import register_comparison
from gatedformer.config import Recipe, build_config, check_overrides_spare_variants
from gatedformer.data.sentclass import sentence_set
from gatedformer.errors import ConfigError
from gatedformer.io import atomic_write_text
from gatedformer.train.loop import RunResult
from gatedformer.train.rundir import claim_comparison_folder

__all__ = ["PUBLISHED_SRU", "PUBLISHED_SRU_SOURCE", "run_sentclass_comparison"]

PUBLISHED_SRU: dict[str, float] = {"cr": 86.4, "subj": 93.8, "mr": 83.1, "trec": 94.8, "sst": 89.6}
"""Test accuracies (%) of the SRU paper's Table 1, the best of its SRU rows (2, 4, 8 layers) for each set."""

PUBLISHED_SRU_SOURCE = ("Lei et al. 2018 (SRU), Table 1 (main text): the best SRU row of each set, as Papers with Code "
                        "transcribes it; that transcription has no MPQA number and this checkout's copy of the paper "
                        "(appendix only) has no Table 1, so MPQA's is left empty rather than guessed")
"""Where :data:`PUBLISHED_SRU` comes from; the ``sentclass-sru-*`` recipes' ``published_source`` and the report say
the same."""


def _mean_std(values: list[float]) -> str:
    values = [v * 100 for v in values]
    if len(values) > 1:
        return f"{statistics.fmean(values):.2f} ± {statistics.stdev(values):.2f}"
    return f"{values[0]:.2f}" if values else "—"


@register_comparison("sentclass")
def run_sentclass_comparison(recipe: Recipe, out_dir: Path, seeds: int = 1, overrides: list[str] | None = None,
                             data_dir: str | Path | None = None, progress: bool = True,
                             only: list[str] | None = None) -> ComparisonReport:
    """Train every variant on every set (every fold, or every seed), write ``OUT/report.md``."""
    if seeds < 1:
        raise ConfigError(f"--seeds must be at least 1, got {seeds}")
    overrides = list(overrides or [])
    check_overrides_spare_variants(recipe, overrides)
    for key in ("data.corpus", "sentclass.fold"):
        if any(o.partition("=")[0].strip() == key for o in overrides):
            raise ConfigError(f"--set {key}: the comparison runs every set of sentclass.sets and every fold; set "
                              "sentclass.sets (or use `gatedformer train` for one run)")
    variants = select_variants(recipe, only)
    base = build_config(recipe, overrides, variants[0])
    sets = [sentence_set(name).name for name in base.sentclass.sets.split()]
    if not sets:
        raise ConfigError("sentclass.sets names no set; list some of mr cr subj mpqa trec sst")
    out_dir = claim_comparison_folder(out_dir)  # never over the user's report.md
    results: dict[tuple[str, str], list[RunResult]] = {}
    for variant in variants:
        for name in sets:
            cross_validated = sentence_set(name).cross_validated
            runs = range(base.sentclass.folds) if cross_validated else range(seeds)
            for k in runs:
                extra = [f"data.corpus={name}", f"sentclass.fold={k}"] if cross_validated else [f"data.corpus={name}"]
                config = build_config(recipe, overrides + extra, variant)
                if not cross_validated:
                    config.train.seed += k
                where = f"fold-{k}" if cross_validated else f"seed-{k}"
                result = train_or_keep(config, out_dir / slug(variant.name) / name / where, data_dir, progress,
                                       f"{variant.name} {name} {where}")
                results.setdefault((variant.name, name), []).append(result)
    header = ["set", "runs"]
    for variant in variants:
        header += [f"{variant.name} test acc. (%)", "valid acc. (%)"]
    header.append("published SRU (%)")
    rows = []
    for name in sets:
        runs = results[(variants[0].name, name)]
        how = f"{len(runs)} folds" if sentence_set(name).cross_validated else f"{len(runs)} seed(s)"
        row = [sentence_set(name).title, how]
        for variant in variants:
            done = results[(variant.name, name)]
            row += [_mean_std([r.test_metric for r in done]), _mean_std([r.valid_metric for r in done])]
        row.append(f"{PUBLISHED_SRU[name]:.1f}" if name in PUBLISHED_SRU else "—")
        rows.append(row)
    table = markdown_table(header, rows)
    m, sc = base.model, base.sentclass
    vectors = f"word vectors from {sc.word_vectors}" if sc.word_vectors else \
        f"random {sc.embedding_dim}-d word vectors (no sentclass.word_vectors given), trained"
    text = "\n".join([
        f"# {recipe.name}: sentence classification", "", recipe.description, "",
        f"{m.n_layers} SRU layer(s) of {m.d_model} units, dropout {m.dropout}, {vectors}; batch "
        f"{base.data.batch_size}, {base.train.steps} steps, an evaluation every {base.train.eval_every}. MR, CR, SUBJ "
        f"and MPQA by {sc.folds}-fold cross-validation (each fold the test split once), TREC and SST on their own "
        f"splits over {seeds} seed(s).", "",
        "## Results", "",
        "Test accuracy at the best validation accuracy of each run (as the SRU paper reports it), mean ± std over "
        "the folds or seeds, and that best validation accuracy. `published SRU` is the paper's best SRU "
        "configuration (pretrained word2vec vectors, its full training): compare directions, not values.", "",
        table, "", f"Published: {PUBLISHED_SRU_SOURCE}.", ""])
    report_path = out_dir / "report.md"
    atomic_write_text(report_path, text)
    return ComparisonReport(table, report_path)
