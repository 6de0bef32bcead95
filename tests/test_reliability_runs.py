"""Run folders and resume, from the second reliability audit (issue 51): a folder is a run by the marker gatedformer
writes, not by its names, and ``compare`` refuses the user's files as ``train`` does; a missing optional module is
found before the first step and a failed evaluation keeps the steps before it; an edited ``meta.json``, a missing
``config.json`` and a diverged run are refused rather than silently wrong; links in checkpoint slots and Ctrl-C at
start-up are one line; a checkpoint replaced while it is read is read again; advice about a damaged checkpoint works
when followed; a read-only file system is named as one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides

from gatedformer.cli import main
from gatedformer.config import build_config, load_recipe
from gatedformer.train.loop import train
from gatedformer.train.rundir import MARKER_FILE, is_run_folder

RECIPE = "ptb-char-tiny"
pytestmark = pytest.mark.usefixtures("one_thread")


def sets(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def one_error_line(capsys: pytest.CaptureFixture) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("gatedformer: error: ") and "Traceback" not in lines[0]
    return lines[0]


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` with a file's bytes (``None`` for a folder)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, one_thread_module: None) -> dict:
    """A finished tiny run (12 steps), one stopped at step 4 and one stopped at step 8: the same run at three points."""
    folder = tmp_path_factory.mktemp("runs")
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "park", "in", "sun"]
    picks = torch.randint(0, len(words), (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    (folder / "corpus.txt").write_text("\n".join(" ".join(words[i] for i in picks[j: j + 8]) + "."
                                                 for j in range(0, len(picks), 8)) + "\n", encoding="utf-8")
    overrides = tiny_overrides(f"text:{folder / 'corpus.txt'}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GATEDFORMER_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        config = build_config(load_recipe(RECIPE), overrides)
        result = train(config, folder / "finished", progress=False)
        assert train(config, folder / "half", progress=False, stop_after=4) is None
        shutil.copytree(folder / "half", folder / "later")
        assert train(config, folder / "later", progress=False, resume=True, stop_after=8) is None
    return {"overrides": overrides, "config": config, "result": result,
            **{name: folder / name for name in ("finished", "half", "later")}}


def copy_run(runs: dict, which: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(runs[which], tmp_path / which))


def train_args(runs: dict, out: Path | str, *extra: str) -> list[str]:
    return ["train", "--recipe", RECIPE, "--out", str(out), "--quiet", *sets(runs["overrides"]), *extra]


# ---------------------------------------------------------------------------------------------
# 1, 2. A folder is a run (or a comparison) by the marker gatedformer writes, never by its names


def test_a_folder_of_another_tool_is_not_taken_for_a_run(runs: dict, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    other = tmp_path / "X"
    for step in ("step-1000", "step-2000", "step-00001000"):
        (other / "ckpt" / step).mkdir(parents=True)
        (other / "ckpt" / step / "weights.bin").write_bytes(b"another tool's checkpoint")
    (other / "ckpt" / "LATEST").write_text("step-00001000\n")
    (other / "hparams.yaml").write_text("lr=0.1\n")
    (other / "config.json").write_text(json.dumps(runs["config"].to_dict()))  # even one that reads as a run's
    before = tree(other)
    for extra in ((), ("--resume",)):
        assert main(train_args(runs, other, *extra)) == 2
        line = one_error_line(capsys)
        assert f"{other} already holds files that are not a gatedformer run (ckpt, config.json, hparams.yaml)" in line
        assert "choose another --out" in line
    assert tree(other) == before and not is_run_folder(other)

    # A run this project wrote is one, by its marker, and goes on; a copy without the marker is not one.
    run = copy_run(runs, "half", tmp_path)
    assert json.loads((run / MARKER_FILE).read_text())["folder"] == "run" and is_run_folder(run)
    unmarked = Path(shutil.copytree(run, tmp_path / "unmarked"))
    (unmarked / MARKER_FILE).unlink()
    assert main(train_args(runs, unmarked, "--resume")) == 2
    assert "holds files that are not a gatedformer run" in one_error_line(capsys)
    assert main(train_args(runs, run, "--resume")) == 0
    assert json.loads((run / "results.json").read_text())["test_loss"] == runs["result"].test_loss

    # A comparison's folder is not a run's either.
    comparison = tmp_path / "comparison"
    comparison.mkdir()
    (comparison / MARKER_FILE).write_text('{"folder": "comparison"}')
    (comparison / "report.md").write_text("# report\n")
    assert main(train_args(runs, comparison)) == 2
    assert f"{comparison} is a gatedformer comparison folder, not a run folder" in one_error_line(capsys)


def test_compare_refuses_a_folder_of_the_users_files_and_picks_up_its_own(
        runs: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    users = tmp_path / "U"
    users.mkdir()
    (users / "report.md").write_text("my own report\n")
    (users / "convergence.png").write_bytes(b"my own figure")
    before = tree(users)
    compare = ["compare", "--out", str(users), "--quiet"]
    for recipe in (RECIPE, "bert-mlm-tiny", "sentclass-sru-tiny"):  # the generic, GLUE and sentence-class. ones
        overrides = sets(runs["overrides"]) if recipe == RECIPE else []
        assert main([*compare, "--recipe", recipe, *overrides]) == 2, recipe
        line = one_error_line(capsys)
        assert f"{users} already holds files that are not a gatedformer comparison (convergence.png, report.md)" in line
        assert "choose another --out" in line
    assert tree(users) == before
    assert main([*compare[:2], str(runs["half"]), "--quiet", "--recipe", RECIPE, *sets(runs["overrides"])]) == 2
    assert f"{runs['half']} is a gatedformer run folder, not a comparison folder" in one_error_line(capsys)

    # A comparison's own folder is picked up again: its finished run is kept, its report rewritten.
    own = ["compare", "--recipe", RECIPE, "--out", str(tmp_path / "cmp"), "--quiet", "--variants", "baseline",
           "--no-step-timing", *sets([*runs["overrides"], "train.steps=4"])]
    assert main(own) == 0
    assert json.loads((tmp_path / "cmp" / MARKER_FILE).read_text())["folder"] == "comparison"
    results = (tmp_path / "cmp" / "baseline" / "seed-0" / "results.json").read_bytes()
    capsys.readouterr()
    assert main(own) == 0
    assert (tmp_path / "cmp" / "baseline" / "seed-0" / "results.json").read_bytes() == results
