"""Every shell and Python block of README.md and docs/**/*.md runs (steps shrunk where its marker says, or skipped
with the reason its marker gives): a renamed flag or a changed API in an example fails here. The runner and its
markers are described in tests/doc_examples.py."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from doc_examples import Block, MarkerError, Runner, commands_taking_set, pages, parse_page, prepared, scratch_checkout

REPO = Path(__file__).resolve().parents[1]


def _page_params() -> list:
    params = []
    for page in pages(REPO):
        _, slow = parse_page(page)
        marks = [pytest.mark.slow] if slow else []
        params.append(pytest.param(page, marks=marks, id=str(page.relative_to(REPO))))
    return params


@pytest.mark.parametrize("page", _page_params())
def test_the_page_examples_run(page: Path, tmp_path: Path) -> None:
    blocks, _ = parse_page(page)
    if not blocks:
        pytest.skip("no shell or Python block")
    runner = Runner(scratch_checkout(REPO, tmp_path))
    for block in blocks:
        if block.skip is not None:
            warnings.warn(f"{block.where}: not run: {block.skip}", stacklevel=1)
            continue
        outcome = runner.run(block)
        if not outcome.ok:
            pytest.fail(f"the example at {block.where} failed; it ran:\n{outcome.code}\n{outcome.output[-4000:]}",
                        pytrace=False)


# --- the runner itself ------------------------------------------------------------------------------------------


def _page(tmp_path: Path, text: str) -> list[Block]:
    path = tmp_path / "page.md"
    path.write_text(text, encoding="utf-8")
    return parse_page(path)[0]


def test_a_renamed_flag_fails_the_page(tmp_path: Path) -> None:
    good, bad = _page(tmp_path, "Train it:\n\n<!-- run: --set train.steps=1 -->\n```bash\n"
                                ".venv/bin/gatedformer params --recipe ptb-char-tiny --vocab-size 50\n```\n\n"
                                "<!-- run: --set train.steps=1 -->\n```bash\n"
                                ".venv/bin/gatedformer params --recipee ptb-char-tiny --vocab-size 50\n```\n")
    runner = Runner(scratch_checkout(REPO, tmp_path / "scratch"))
    ran = runner.run(good)
    assert ran.ok, ran.output
    assert "--set train.steps=1" in ran.code and "params" in ran.output.lower()
    failed = runner.run(bad)
    assert not failed.ok and "--recipe" in failed.output and "exit status 2" in failed.output


def test_a_failing_python_block_fails(tmp_path: Path) -> None:
    ok, broken = _page(tmp_path, "```python\nimport gatedformer\nassert gatedformer.SDU\n```\n"
                                 "```python\nfrom gatedformer import NoSuchThing\n```\n")
    runner = Runner(scratch_checkout(REPO, tmp_path / "scratch"))
    assert runner.run(ok).ok
    outcome = runner.run(broken)
    assert not outcome.ok and "NoSuchThing" in outcome.output


def test_a_bare_gatedformer_needs_the_environment_activated(tmp_path: Path) -> None:
    env_path = "/usr/bin:/bin"  # no gatedformer on it, as after the README's set-up
    bare, activate, after = _page(tmp_path, "```bash\ngatedformer --version\n```\n"
                                            "```bash\nsource .venv/bin/activate\n```\n"
                                            "```bash\ngatedformer --version\n```\n")
    import os

    runner = Runner(scratch_checkout(REPO, tmp_path / "scratch"), env={**os.environ, "PATH": env_path})
    first = runner.run(bare)
    assert not first.ok and "not found" in first.output
    assert runner.run(activate).ok
    assert runner.run(after).ok


def test_markers(tmp_path: Path) -> None:
    blocks = _page(tmp_path, "<!-- doc-test: slow -->\n<!-- not run: needs a GPU -->\n```bash\nnvidia-smi\n```\n"
                             "<!-- a comment -->\n<!-- run-replace: 300 => 3 -->\n"
                             "<!-- run-replace: runs/a => runs/b -->\n"
                             "```python\ntrain(steps=300, out='runs/a')\n```\n```text\nnot a block\n```\n")
    assert [b.language for b in blocks] == ["shell", "python"]
    assert blocks[0].skip == "needs a GPU" and blocks[0].line == 3
    assert prepared(blocks[1], frozenset()) == "train(steps=3, out='runs/b')\n"
    assert parse_page(tmp_path / "page.md")[1]
    for bad in ("<!-- not run: -->\n```bash\nx\n```\n", "<!-- run-replace: nothing here -->\n```bash\nx\n```\n",
                "<!-- doc-test: fast -->\n", "<!-- run --set train.steps=3 -->\n```bash\nx\n```\n"):
        with pytest.raises(MarkerError):
            _page(tmp_path, bad)
    stale = _page(tmp_path, "<!-- run-replace: 300 => 3 -->\n```python\ntrain(steps=30)\n```\n")[0]
    with pytest.raises(MarkerError, match="does not occur"):
        prepared(stale, frozenset())
    idle = _page(tmp_path, "<!-- run: --set train.steps=3 -->\n```bash\ngatedformer data list\n```\n")[0]
    with pytest.raises(MarkerError, match="no gatedformer command of the block takes --set"):
        prepared(idle, commands_taking_set())


def test_run_arguments_go_at_the_end_of_each_training_command(tmp_path: Path) -> None:
    block = _page(tmp_path, "<!-- run: --set train.steps=3 -->\n```bash\n"
                            "gatedformer train --recipe r --out runs/x   # a comment\n"
                            "gatedformer compare --recipe r \\\n    --out runs/y --set model.gates='+σ | x'\n"
                            "gatedformer generate --run runs/x --prompt 'the ' | head -1\n"
                            "torchrun --nproc_per_node 2 -m gatedformer train --recipe r --out runs/d && echo done\n"
                            "gatedformer finetune --run runs/x --task mrpc --out runs/f > log.txt\n```\n")[0]
    assert prepared(block, commands_taking_set()).splitlines() == [
        "gatedformer train --recipe r --out runs/x --set train.steps=3   # a comment",
        "gatedformer compare --recipe r      --out runs/y --set model.gates='+σ | x' --set train.steps=3",
        "gatedformer generate --run runs/x --prompt 'the ' | head -1",
        "torchrun --nproc_per_node 2 -m gatedformer train --recipe r --out runs/d --set train.steps=3 && echo done",
        "gatedformer finetune --run runs/x --task mrpc --out runs/f --set train.steps=3 > log.txt",
    ]
