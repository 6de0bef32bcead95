"""The documentation site: its generated references, the results page, the README as the site's front door, and
a strict MkDocs build of the whole site where MkDocs is installed (``pip install -e '.[docs]'``)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gatedformer.analysis import results
from gatedformer.cli import build_parser
from gatedformer.config import load_recipe, recipe_names

ROOT = Path(__file__).resolve().parents[1]


def _hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", ROOT / "docs" / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_reference_holds_every_command_as_its_help_prints_it() -> None:
    page = _hook().cli_reference()
    parser = build_parser()
    commands = _hook()._subcommands(parser)
    assert len(commands) >= 15
    for name, sub in commands.items():
        assert f"## `gatedformer {name}`" in page
        for action in sub._actions:  # every option of every command, under its own name
            for option in action.option_strings:
                assert option in page, (name, option)


def test_the_recipes_reference_holds_every_recipe_its_table_and_published_numbers() -> None:
    page = _hook().recipes_reference()
    for name in recipe_names():
        recipe = load_recipe(name)
        assert f"\n## {name}\n" in page
        if recipe.published_source:
            assert recipe.published_source in page
        for variant in recipe.variants:
            assert variant.name.replace("|", "\\|") in page
            if variant.published is not None:
                assert f"| {variant.published:g} |" in page


def test_included_pages_point_their_links_at_pages_of_the_site() -> None:
    hook = _hook()
    for page in hook.INCLUDED:
        text = hook._included(page)
        for target in re.findall(r"\]\(([^)#\s]+\.md)", text):
            assert (Path(page).parent / target).as_posix() in hook.INCLUDED or target.startswith("http"), (page, target)


def _comparison(folder: Path, recipe: str = "ptb-char-tiny") -> Path:
    folder.mkdir(parents=True)
    (folder / "gatedformer.json").write_text(json.dumps({"folder": "comparison", "gatedformer": "0.1.0"}))
    (folder / "gates").mkdir()
    (folder / "convergence.png").write_bytes(b"\x89PNG convergence")
    (folder / "gates" / "sigma-SDU-gate_biases.png").write_bytes(b"\x89PNG biases")
    (folder / "report.md").write_text(
        f"# {recipe}: comparison\n\nWhat it is.\n\n## Results\n\n| variant | test bpc |\n|---|---|\n"
        "| baseline | 2.344 |\n\n## Convergence\n\n![convergence](convergence.png)\n\n## Gates\n\n### +σ SDU\n\n"
        "![b](gates/sigma-SDU-gate_biases.png)\n![t](gates/sigma-SDU-gate_tsne.png)\n", encoding="utf-8")
    return folder


def test_the_results_page_shows_each_report_whole_stamped_with_its_figures(tmp_path: Path) -> None:
    folder = _comparison(tmp_path / "runs" / "cmp")
    record = results.stamp(folder, commit="abc123")
    assert record["commit"] == "abc123" and "cores" in record["machine"]
    page = results.write_page([folder], tmp_path / "docs" / "results.md")
    text = page.read_text(encoding="utf-8")
    assert "## ptb-char-tiny\n" in text and "### Results" in text and "#### +σ SDU" in text
    assert f"machine: {record['machine']}; commit: abc123" in text
    assert "| baseline | 2.344 |" in text
    # The figures are copied beside the page, and a figure the report names but never drew is said to be missing.
    assert "![convergence](results/ptb-char-tiny/convergence.png)" in text
    assert (tmp_path / "docs" / "results" / "ptb-char-tiny" / "gates-sigma-SDU-gate_biases.png").read_bytes() \
        == b"\x89PNG biases"
    assert "`gates/sigma-SDU-gate_tsne.png` was not drawn" in text
    # Every other -tiny recipe is listed with the command that produces its table.
    for name in recipe_names():
        if name.endswith("-tiny") and name != "ptb-char-tiny":
            assert f"gatedformer compare --recipe {name} --out runs/{name}" in text
    assert "--recipe ptb-char-tiny " not in text
    # Its commands train for hours: the test that runs the docs' code blocks skips them, saying why.
    assert text.count("<!-- not run: ") == text.count("```bash") == 2
    # Regenerating replaces the figures: none of the old page's is left behind.
    (folder / "convergence.png").unlink()
    (folder / "report.md").write_text("# ptb-char-tiny: comparison\n\nno figures\n", encoding="utf-8")
    results.write_page([folder], tmp_path / "docs" / "results.md")
    assert sorted(p.name for p in (tmp_path / "docs" / "results").rglob("*") if p.is_file()) == []
    # The tasks with comparisons of their own title their reports otherwise; the recipe is still the first word.
    glue = _comparison(tmp_path / "glue", recipe="glue-tiny")
    (glue / "report.md").write_text("# glue-tiny: BERT pretraining and GLUE fine-tuning\n\n## Table 2\n",
                                    encoding="utf-8")
    text = results.write_page([folder, glue], tmp_path / "docs" / "results.md").read_text(encoding="utf-8")
    assert "## glue-tiny\n" in text and "### Table 2" in text and "--recipe glue-tiny " not in text


def test_an_unstamped_report_says_so_and_bad_folders_are_one_error_line(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture) -> None:
    folder = _comparison(tmp_path / "cmp")
    assert "not recorded (run `python -m gatedformer.analysis.results --stamp DIR`" in \
        results.render_page([results.read_comparison(folder)])[0]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("# my notes\n")
    twice = _comparison(tmp_path / "again")
    for argv, message in (([str(mine), "--out", str(tmp_path / "p.md")], "is not marked as a comparison folder"),
                          ([str(tmp_path / "nothing"), "--out", str(tmp_path / "p.md")], "holds no report.md"),
                          ([str(folder), str(twice), "--out", str(tmp_path / "p.md")], "give one folder per recipe"),
                          (["--stamp"], "give the compare folders to stamp"),
                          ([str(folder)], "give --out docs/results.md")):
        assert results.main(argv) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and message in error, error
    assert not (tmp_path / "p.md").exists() and not (mine / results.PROVENANCE).exists()
    (folder / results.PROVENANCE).write_text("not json")
    assert results.main([str(folder), "--out", str(tmp_path / "p.md")]) == 2
    assert "delete it and stamp the folder again" in capsys.readouterr().err


def test_the_readme_is_the_front_door() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 180
    for section in ("## Set-up commands", "## Results", "## Python API"):
        assert section in readme
    # Every link into the docs names a page that exists.
    links = re.findall(r"\]\((docs/[^)#\s]+)", readme)
    assert len(links) >= 8
    for link in links:
        assert (ROOT / link).is_file(), link


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    pytest.importorskip("material")
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(site)], capture_output=True, text=True,
                          check=False, cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    cli = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    assert "gatedformer compare" in cli and "--matched-baseline" in cli
    recipes_page = (site / "reference" / "recipes" / "index.html").read_text(encoding="utf-8")
    assert all(name in recipes_page for name in recipe_names())
    api = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    assert "ModelOutput" in api and "fuse" in api
    for page in ("getting-started", "guides/question-answering", "results", "architecture", "performance/benchmarks"):
        assert (site / page / "index.html").is_file(), page
