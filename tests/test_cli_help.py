"""Help that teaches: ``gatedformer --help`` lists every command on one line, every command's ``--help`` ends with
an example, and ``gatedformer recipes`` lists the recipes with the published table each mirrors."""

from __future__ import annotations

import argparse
import json

import pytest

from gatedformer.cli import COMMANDS, build_parser, main
from gatedformer.config import recipe_names


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_the_top_help_lists_every_command_on_one_line(capsys: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    commands = _subparsers()
    assert set(commands) == set(COMMANDS)  # a command without its line and example fails here
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ") and line.split()[0] in commands]
    assert listed == list(COMMANDS)
    for name, (summary, _) in COMMANDS.items():
        line = next(line for line in out.splitlines() if line.startswith(f"  {name} "))
        assert line.split(None, 1)[1].strip() == summary and len(line) <= 80, line
    assert "example:\n  gatedformer compare --recipe" in out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_help_ends_with_an_example(name: str, capsys: pytest.CaptureFixture) -> None:
    sub = _subparsers()[name]
    assert sub.epilog and sub.epilog.startswith("example:\n") and "gatedformer" in sub.epilog
    with pytest.raises(SystemExit):
        main([name, "--help"])
    out = capsys.readouterr().out.rstrip()
    example = sub.epilog.split("\n", 1)[1]
    assert out.endswith(example), out[-300:]
    assert example.lstrip().startswith(("gatedformer ", "echo ")) and f"gatedformer {name}" in example


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_example_parses(name: str) -> None:
    # An example whose flag was renamed fails here, as the docs' examples fail tests/test_doc_examples.py.
    import shlex

    example = COMMANDS[name][1].replace("\\\n", " ")
    for line in example.splitlines():
        words = shlex.split(line.split("|", 1)[1] if "|" in line else line)
        assert words[0] == "gatedformer"
        build_parser().parse_args(words[1:])


def test_recipes_lists_every_recipe_with_its_task_and_table(capsys: pytest.CaptureFixture) -> None:
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["recipe", "task", "corpus", "variants", "mirrors"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert sorted(rows) == recipe_names()
    assert rows["ptb-char-tiny"].split()[1:4] == ["lm", "ptb-char", "4"]
    assert "Table 1" in rows["ptb-char-tiny"]
    assert rows["multi30k-tiny"].split()[1:3] == ["translation", "multi30k"] and "Table 3" in rows["multi30k-tiny"]
    assert rows["squad-sru-paper"].split()[1] == "qa"
    assert rows["glue-tiny"].split()[1] == "mlm+glue" and rows["bert-mlm-tiny"].split()[1] == "mlm"
    assert main(["recipes", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in listed] == recipe_names()
    assert next(r for r in listed if r["name"] == "sentclass-sru-tiny")["task"] == "sentclass"
    assert all(r["mirrors"] for r in listed)  # every recipe says which table it mirrors, or that none exists
