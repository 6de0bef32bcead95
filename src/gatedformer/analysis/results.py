"""The documentation's results page, built from ``compare`` folders.

``python -m gatedformer.analysis.results DIR... --out docs/results.md`` writes one page with every comparison's
report (its tables and figures, the figures copied beside the page) under a stamp: the date its report was written,
and the machine and commit that ``--stamp`` recorded in the folder right after the comparison ran. Every shipped
``-tiny`` recipe without a folder is listed with the command that produces its table, so the page never hides what
has not been run. ``python -m gatedformer.analysis.results --stamp DIR`` records the stamp (``provenance.json``):
the comparison's own files do not say where they ran, and a stamp guessed later could name the wrong machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gatedformer.analysis.bench.report import cpu_model
from gatedformer.config import recipe_names
from gatedformer.errors import ConfigError, GatedformerError
from gatedformer.io import atomic_write_json, atomic_write_text
from gatedformer.train.rundir import folder_kind

PROVENANCE = "provenance.json"
COMMAND = "python -m gatedformer.analysis.results"
_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)\)")
# Every kind of report opens so: "# NAME: comparison", "# NAME: BERT pretraining and GLUE fine-tuning", ...
_TITLE = re.compile(r"^# (\S+?): .+$", re.MULTILINE)


def _git(args: list[str]) -> str | None:
    # The package's own checkout: an installed wheel has none, and then the stamp says so rather than guessing.
    try:
        done = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def machine_description() -> str:
    """The CPU model, its core count and the torch build: what the step times and the MFU depend on."""
    import torch

    return f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def current_commit() -> str:
    """HEAD of the checkout the package runs from, marked where its working tree has changes."""
    head = _git(["rev-parse", "--short=12", "HEAD"])
    if head is None:
        return "not a git checkout"
    dirty = _git(["status", "--porcelain", "--untracked-files=no"])
    return f"{head} (with uncommitted changes)" if dirty else head


def _check_comparison(folder: Path) -> Path:
    if not (folder / "report.md").is_file():
        raise ConfigError(f"{folder} holds no report.md; give a folder written by `gatedformer compare --out`")
    if folder_kind(folder) != "comparison":
        raise ConfigError(f"{folder} is not marked as a comparison folder (gatedformer.json); give a folder "
                          "written by `gatedformer compare --out`")
    return folder


def stamp(folder: str | Path, commit: str | None = None) -> dict[str, str]:
    """Record in ``folder`` the machine it ran on and the code's commit (``commit`` where the run began on another)."""
    path = _check_comparison(Path(folder))
    record = {"machine": machine_description(), "commit": commit or current_commit(),
              "stamped": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    atomic_write_json(path / PROVENANCE, record)
    return record


@dataclass
class Comparison:
    """One ``compare`` folder as the page shows it."""

    folder: Path
    recipe: str
    report: str
    date: str
    machine: str
    commit: str


def read_comparison(folder: str | Path) -> Comparison:
    path = _check_comparison(Path(folder))
    report = (path / "report.md").read_text(encoding="utf-8")
    title = _TITLE.search(report)
    recipe = title.group(1).strip() if title else path.name
    written = datetime.datetime.fromtimestamp((path / "report.md").stat().st_mtime, datetime.timezone.utc)
    machine = commit = "not recorded (run `" + COMMAND + " --stamp DIR` where the comparison ran)"
    record_path = path / PROVENANCE
    if record_path.is_file():
        try:
            record = json.loads(record_path.read_text(encoding="utf-8"))
            machine, commit = str(record["machine"]), str(record["commit"])
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{record_path} is not a stamp written by `{COMMAND} --stamp`; delete it and stamp "
                              "the folder again") from None
    return Comparison(path, recipe, report, written.strftime("%Y-%m-%d %H:%M UTC"), machine, commit)


def _figure_name(recipe: str, source: str) -> str:
    return f"{re.sub(r'[^A-Za-z0-9._-]+', '-', recipe)}/{source.replace('/', '-')}"


def _body(comparison: Comparison, figures: dict[Path, str], figure_prefix: str) -> str:
    """The report without its title, its headings one level down, its figures pointing at their copies."""
    text = _TITLE.sub("", comparison.report, count=1).strip()
    text = re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", text, flags=re.MULTILINE)

    def image(match: re.Match[str]) -> str:
        source = comparison.folder / match.group(2)
        if not source.is_file():  # the report names a figure it could not draw: keep its words, drop the link
            return f"*(figure `{match.group(2)}` was not drawn)*"
        name = _figure_name(comparison.recipe, match.group(2))
        figures[source] = name
        return f"![{match.group(1)}]({figure_prefix}{name})"

    return _IMAGE.sub(image, text)


def render_page(comparisons: list[Comparison], figure_prefix: str = "results/") -> tuple[str, dict[Path, str]]:
    """The page's Markdown and the figures it shows (source file → name under the figure folder)."""
    figures: dict[Path, str] = {}
    done = {c.recipe for c in comparisons}
    lines = ["# Results", "",
             "Every comparison below is a `gatedformer compare` report, shown whole: its tables (ours beside the "
             "published numbers where the recipe mirrors a published table) and its figures. The `-tiny` recipes "
             "are miniatures on 2 CPU cores, not the papers' scale: read the changes between variants, not the "
             "absolute numbers against the papers'. This page is generated; to regenerate it:", "",
             "<!-- not run: regenerates this page from the compare folders named -->", "```bash",
             f"{COMMAND} {' '.join(str(c.folder) for c in comparisons) or 'DIR ...'} --out docs/results.md",
             "```"]
    if comparisons:
        lines += ["", "| recipe | report written | machine | commit |", "|---|---|---|---|"]
        lines += [f"| [`{c.recipe}`](#{_anchor(c.recipe)}) | {c.date} | {c.machine} | {c.commit} |"
                  for c in comparisons]
    missing = [name for name in recipe_names() if name.endswith("-tiny") and name not in done]
    if missing:
        lines += ["", "## Not yet run here", "",
                  "These `-tiny` comparisons have no report on this page yet; each line produces one (then stamp "
                  "its folder and regenerate the page):", "",
                  "<!-- not run: each line trains a whole comparison -->", "```bash"]
        lines += [f"gatedformer compare --recipe {name} --out runs/{name} && {COMMAND} --stamp runs/{name}"
                  for name in missing]
        lines += ["```"]
    for comparison in comparisons:
        lines += ["", f"## {comparison.recipe}", "",
                  f"*Report written {comparison.date}; machine: {comparison.machine}; commit: {comparison.commit}.*",
                  "", _body(comparison, figures, figure_prefix)]
    return "\n".join(lines) + "\n", figures


def _anchor(title: str) -> str:
    # MkDocs' default slug (Python-Markdown's toc): lower case, punctuation dropped, spaces and runs of hyphens kept.
    slug = re.sub(r"[^\w\s-]", "", title).strip().lower()
    return re.sub(r"[-\s]+", "-", slug)


def write_page(folders: Sequence[str | Path], out: str | Path) -> Path:
    """Write the page to ``out`` and its figures into ``results/`` beside it (replacing that folder's contents)."""
    comparisons = [read_comparison(f) for f in folders]
    recipes = [c.recipe for c in comparisons]
    twice = sorted({r for r in recipes if recipes.count(r) > 1})
    if twice:
        raise ConfigError(f"two folders hold a comparison of {', '.join(twice)}; give one folder per recipe")
    out_path = Path(out)
    text, figures = render_page(comparisons)
    figure_root = out_path.parent / "results"
    fresh = out_path.parent / ".results.tmp"
    shutil.rmtree(fresh, ignore_errors=True)
    for source, name in figures.items():
        (fresh / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, fresh / name)
    fresh.mkdir(parents=True, exist_ok=True)
    # The page and its figures change together: the old figures go only once the new ones are all copied.
    shutil.rmtree(figure_root, ignore_errors=True)
    fresh.rename(figure_root)
    atomic_write_text(out_path, text)
    return out_path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Write the documentation's results page from "
                                     "compare folders, or stamp a folder with the machine and commit it ran on.")
    parser.add_argument("folders", nargs="*", metavar="DIR", help="folders written by `gatedformer compare --out`")
    parser.add_argument("--out", help="the page to write (its figures go into results/ beside it)")
    parser.add_argument("--stamp", action="store_true", help="record this machine and commit in each DIR "
                        "(run it where and right after the comparison ran)")
    parser.add_argument("--commit", help="with --stamp: the commit the comparison ran at, where HEAD has moved since")
    args = parser.parse_args(argv)
    try:
        if args.stamp:
            if not args.folders:
                raise ConfigError("give the compare folders to stamp: --stamp DIR ...")
            for folder in args.folders:
                record = stamp(folder, args.commit)
                print(f"{folder}: {record['machine']}; commit {record['commit']}")
            return 0
        if not args.out:
            raise ConfigError("give --out docs/results.md (the page to write), or --stamp")
        print(write_page(args.folders, args.out))
        return 0
    except GatedformerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
