"""Runs the code blocks of Markdown pages as a reader would: every ``bash``/``sh``/``shell`` and ``python`` block
of a page, in order, in one scratch folder that stands in for the checkout (its files linked in, ``.venv`` the
environment running the tests, ``../shared`` the shared data), each block a fresh process that must exit 0.

An HTML comment on the lines right above a block's fence says how to run it (a reader of the page never sees it):

- ``<!-- run: ARGS -->``: ARGS appended to every ``gatedformer`` command of the block that takes ``--set``
  (``train``, ``compare``, ``finetune``, ...), e.g. ``<!-- run: --set train.steps=3 -->``; so the page shows the
  real command and the test runs it small.
- ``<!-- run-replace: OLD => NEW -->``: OLD (which must occur in the block) replaced by NEW before the block runs,
  e.g. a Python block's ``"train.steps=300"``; several such lines apply in order.
- ``<!-- not run: REASON -->``: the block is skipped, REASON printed (a download of gigabytes, a GPU, a second
  machine, a set-up command that builds a fresh environment).

A page whose blocks take longer than a minute in all says so with ``<!-- doc-test: slow -->`` anywhere in it; its
test is then marked ``slow`` (CI runs those too). A block that activates the environment
(``source .venv/bin/activate``) puts ``.venv/bin`` on ``PATH`` for the blocks after it, as for a reader; before that
a bare ``gatedformer`` is not found, as it is not after the README's set-up.

pytest-markdown-docs runs Python blocks only and takes its markers in the fence's info string (which the rendered
page shows); the pages here are mostly shell commands whose steps must be shrunk, hence this small runner.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

SHELL = {"bash", "sh", "shell", "zsh"}
PYTHON = {"python", "py", "python3"}
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)")
_MARKER = re.compile(r"^\s*<!--\s*(run|run-replace|not run|doc-test)\s*:\s*(.*?)\s*-->\s*$")
_COMMENT = re.compile(r"^\s*<!--.*-->\s*$")
_ACTIVATE = re.compile(r"(^|[;&|]\s*|\s)(source|\.)\s+\S*\.venv/bin/activate\b", re.M)


class MarkerError(ValueError):
    """A marker the runner does not understand (a typo must not silently skip or run a block)."""


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str  # "shell" or "python"
    code: str
    args: str = ""
    replacements: list[tuple[str, str]] = field(default_factory=list)
    skip: str | None = None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse_page(path: Path, text: str | None = None) -> tuple[list[Block], bool]:
    """The page's shell and Python blocks with their markers, and whether the page is marked slow."""
    lines = (path.read_text(encoding="utf-8") if text is None else text).splitlines()
    blocks: list[Block] = []
    slow = False
    i = 0
    while i < len(lines):
        marker = _MARKER.match(lines[i])
        if marker and marker.group(1) == "doc-test":
            if marker.group(2) != "slow":
                raise MarkerError(f"{path}:{i + 1}: doc-test takes only 'slow', got {marker.group(2)!r}")
            slow = True
        fence = _FENCE.match(lines[i])
        if not fence:
            if re.match(r"^\s*<!--\s*(run|not run|run-replace|doc-test)\b", lines[i]) and not marker:
                raise MarkerError(f"{path}:{i + 1}: malformed marker {lines[i].strip()!r}")
            i += 1
            continue
        ticks, info = fence.group(1), fence.group(2).lower()
        end = i + 1
        while end < len(lines) and not re.match(rf"^ {{0,3}}{re.escape(ticks[0])}{{{len(ticks)},}}\s*$", lines[end]):
            end += 1
        language = "shell" if info in SHELL else "python" if info in PYTHON else None
        if language is not None:
            block = Block(path, i + 1, language, "\n".join(lines[i + 1:end]) + "\n")
            above = i - 1
            while above >= 0 and _COMMENT.match(lines[above]):
                _apply_marker(block, lines[above], above + 1)
                above -= 1
            block.replacements.reverse()  # read bottom-up: put back in the page's order
            blocks.append(block)
        i = end + 1
    return blocks, slow


def _apply_marker(block: Block, line: str, number: int) -> None:
    marker = _MARKER.match(line)
    if marker is None:
        return  # another comment
    kind, value = marker.groups()
    if kind == "not run":
        if not value:
            raise MarkerError(f"{block.page}:{number}: 'not run' needs a reason")
        block.skip = value
    elif kind == "run":
        block.args = (value + " " + block.args).strip()
    elif kind == "run-replace":
        old, arrow, new = value.partition("=>")
        if not arrow or not old.strip():
            raise MarkerError(f"{block.page}:{number}: run-replace takes 'OLD => NEW', got {value!r}")
        block.replacements.append((old.strip(), new.strip()))


def commands_taking_set() -> frozenset[str]:
    """The ``gatedformer`` subcommands with a ``--set`` option, which ``<!-- run: ARGS -->`` extends."""
    import argparse

    from gatedformer.cli import build_parser

    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return frozenset(name for name, sub in action.choices.items() if "--set" in sub._option_string_actions)


def _command_end(line: str, start: int) -> int:
    """Where the shell command that begins at ``start`` ends: an unquoted ``|``, ``;``, ``&``, redirection or
    comment, else the end of the line (trailing blanks left out)."""
    quote = None
    i = start
    while i < len(line):
        ch = line[i]
        if quote:
            if ch == quote:
                quote = None
            elif ch == "\\" and quote == '"':
                i += 1
        elif ch in "'\"":
            quote = ch
        elif ch == "\\":
            i += 1
        elif ch in "|;&<>" or (ch == "#" and line[i - 1].isspace()):
            return len(line[:i].rstrip())
        i += 1
    return len(line.rstrip())


def prepared(block: Block, takes_set: frozenset[str]) -> str:
    """The code that runs: replacements made, continuation lines joined, ``args`` on each ``gatedformer`` command
    that takes ``--set``."""
    code = block.code
    for old, new in block.replacements:
        if old not in code:
            raise MarkerError(f"{block.where}: run-replace {old!r} does not occur in the block")
        code = code.replace(old, new)
    if not block.args or block.language != "shell":
        if block.args:
            raise MarkerError(f"{block.where}: 'run:' arguments apply to shell blocks; use run-replace")
        return code
    code = code.replace("\\\n", " ")
    out, extended = [], False
    for line in code.splitlines():
        for match in reversed(list(re.finditer(r"\bgatedformer\s+([a-z][a-z-]*)", line))):
            if match.group(1) in takes_set:
                end = _command_end(line, match.end())
                line = line[:end] + " " + block.args + line[end:]
                extended = True
        out.append(line)
    if not extended:
        raise MarkerError(f"{block.where}: 'run: {block.args}' but no gatedformer command of the block takes --set")
    return "\n".join(out) + "\n"


@dataclass
class Outcome:
    ok: bool
    output: str
    code: str


class Runner:
    """Runs one page's blocks in order in ``work`` (made by :func:`scratch_checkout`)."""

    def __init__(self, work: Path, env: dict[str, str] | None = None, timeout: float = 900) -> None:
        self.work = work
        self.env = dict(os.environ if env is None else env)
        self.timeout = timeout
        self.activated = False
        self.takes_set = commands_taking_set()
        self.count = 0

    def run(self, block: Block) -> Outcome:
        code = prepared(block, self.takes_set)
        env = dict(self.env)
        if self.activated:
            env["PATH"] = f"{self.work / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
            env["VIRTUAL_ENV"] = str(self.work / ".venv")
        self.count += 1
        script = self.work.parent / "blocks" / f"{block.page.stem}-{block.line}-{self.count}"
        script.parent.mkdir(exist_ok=True)
        if block.language == "shell":
            script = script.with_suffix(".sh")
            script.write_text(code, encoding="utf-8")
            argv = ["bash", "-e", "-o", "pipefail", str(script)]
        else:
            script = script.with_suffix(".py")
            script.write_text(code, encoding="utf-8")
            argv = [str(self.work / ".venv" / "bin" / "python"), str(script)]
        try:
            done = subprocess.run(argv, cwd=self.work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired as err:
            return Outcome(False, f"timed out after {self.timeout} s\n{err.stdout or ''}{err.stderr or ''}", code)
        if done.returncode == 0 and block.language == "shell" and _ACTIVATE.search(code):
            self.activated = True
        return Outcome(done.returncode == 0, f"exit status {done.returncode}\n{done.stdout}{done.stderr}", code)


def scratch_checkout(repo: Path, at: Path) -> Path:
    """A folder that reads as the checkout ``repo`` (its top-level files and folders linked in, but not its runs or
    git folder), with ``.venv`` this Python's environment and ``../shared`` the checkout's shared data; returns the
    folder, ``at/work``."""
    work = at / "work"
    work.mkdir(parents=True)
    for entry in repo.iterdir():
        if entry.name in {".git", ".venv", "runs", "export"} or entry.name.startswith(".pytest"):
            continue
        (work / entry.name).symlink_to(entry)
    (work / ".venv").symlink_to(Path(sys.prefix))
    shared = repo.parent / "shared"
    if shared.exists():
        (at / "shared").symlink_to(shared)
    return work


def pages(repo: Path) -> list[Path]:
    """README.md and every page under docs/."""
    found = [repo / "README.md"] if (repo / "README.md").is_file() else []
    return found + sorted((repo / "docs").rglob("*.md")) if (repo / "docs").is_dir() else found
