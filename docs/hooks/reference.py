"""MkDocs hook: the pages generated at build time from the code and the repository's other Markdown files.

The CLI reference comes from ``gatedformer.cli.build_parser`` and the recipes reference from the shipped
``recipes/*.toml``, so neither can drift from what the program does; ``ARCHITECTURE.md`` and the benchmarks'
README and history are served as pages of the site, their links between one another pointed at those pages.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# Repository files served as pages: where they live, the page they become, and the links that point at them.
INCLUDED = {
    "architecture.md": ROOT / "ARCHITECTURE.md",
    "performance/benchmarks.md": ROOT / "benchmarks" / "README.md",
    "performance/history.md": ROOT / "benchmarks" / "HISTORY.md",
}
LINKS = {
    "architecture.md": {},
    "performance/benchmarks.md": {"HISTORY.md": "history.md"},
    "performance/history.md": {"README.md": "benchmarks.md"},
}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_reference() -> str:
    """Every command's and subcommand's ``--help``, in the order ``gatedformer --help`` lists them."""
    from gatedformer.cli import build_parser

    # argparse wraps to the terminal's width: a fixed one makes the page the same wherever it is built.
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        parser = build_parser()
        lines = ["# Command line reference", "",
                 "Generated from the program's own argument parser (`gatedformer.cli.build_parser`) when the site is "
                 "built: each section is what `gatedformer COMMAND --help` prints.", "",
                 "```text", parser.format_help().rstrip(), "```"]
        for name, sub in _subcommands(parser).items():
            lines += ["", f"## `gatedformer {name}`", "", "```text", sub.format_help().rstrip(), "```"]
            for inner, subsub in _subcommands(sub).items():
                lines += ["", f"### `gatedformer {name} {inner}`", "", "```text", subsub.format_help().rstrip(),
                          "```"]
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def recipes_reference() -> str:
    """Every shipped recipe: what it is, the published table it mirrors, its settings, variants and numbers."""
    from gatedformer.config import load_recipe, recipe_names

    names = recipe_names()
    lines = ["# Recipes reference", "",
             "Generated from `src/gatedformer/recipes/*.toml` when the site is built. A recipe is one run's settings "
             "plus the variants `gatedformer compare` trains side by side; `-tiny` recipes run on 2 CPU cores, "
             "`-paper` ones hold the published settings (a GPU). `gatedformer train --recipe NAME --out DIR` trains "
             "the first variant; `gatedformer compare --recipe NAME --out DIR` trains them all.", "",
             "| recipe | mirrors | corpus | backbone | variants |", "|---|---|---|---|---|"]
    recipes = [load_recipe(name) for name in names]
    for recipe in recipes:
        config = recipe.config
        lines.append(f"| [`{recipe.name}`](#{recipe.name}) | {_cell(recipe.published_source or '—')} | "
                     f"`{config.data.corpus}` | `{config.model.backbone}` | {len(recipe.variants)} |")
    for recipe in recipes:
        config = recipe.config
        model = config.model
        lines += ["", f"## {recipe.name}", "", recipe.description.strip(), ""]
        if recipe.published_source:
            lines += [f"**Mirrors**: {recipe.published_source}"
                      + (f" (published metric: {recipe.published_metric})" if recipe.published_metric else ""), ""]
        lines += [f"**Settings**: corpus `{config.data.corpus}`, backbone `{model.backbone}`, {model.n_layers} layers, "
                  f"d_model {model.d_model}, d_ffn {model.d_ffn}, {config.train.steps} steps of batch "
                  f"{config.data.batch_size}, optimiser `{config.optim.name}` at lr {config.optim.lr:g}.", "",
                  "| variant | settings | published |", "|---|---|---|"]
        for variant in recipe.variants:
            settings = ", ".join(f"`{_cell(o)}`" for o in variant.overrides) or "the recipe's"
            if variant.match_params:
                settings += f"; feed-forward widened to the parameter count of {_cell(variant.match_params)}"
            published = "—" if variant.published is None else f"{variant.published:g}"
            lines.append(f"| {_cell(variant.name)} | {settings} | {published} |")
        lines += ["", "```bash", f"gatedformer compare --recipe {recipe.name} --out runs/{recipe.name}", "```"]
    return "\n".join(lines) + "\n"


def _included(page: str) -> str:
    text = INCLUDED[page].read_text(encoding="utf-8")
    for target, replacement in LINKS[page].items():
        text = text.replace(f"]({target})", f"]({replacement})").replace(f"]({target}#", f"]({replacement}#")
    return text


GENERATED = {
    "reference/cli.md": cli_reference,
    "reference/recipes.md": recipes_reference,
    **{page: (lambda page=page: _included(page)) for page in INCLUDED},
}


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for page, make in GENERATED.items():
        files.append(File.generated(config, page, content=make()))
    return files

