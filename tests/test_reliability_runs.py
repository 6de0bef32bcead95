"""Run folders and resume, from the second reliability audit (issue 51): a folder is a run by the marker gatedformer
writes, not by its names, and ``compare`` refuses the user's files as ``train`` does; a missing optional module is
found before the first step and a failed evaluation keeps the steps before it; an edited ``meta.json``, a missing
``config.json`` and a diverged run are refused rather than silently wrong; links in checkpoint slots and Ctrl-C at
start-up are one line; a checkpoint replaced while it is read is read again; advice about a damaged checkpoint works
when followed; a read-only file system is named as one."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import one_error_line, sets, tiny_overrides

from gatedformer.cli import main
from gatedformer.config import build_config, load_recipe
from gatedformer.errors import GatedformerError
from gatedformer.io import cannot_write
from gatedformer.runs import load_trained
from gatedformer.tasks.lm import LanguageModelTask
from gatedformer.train import checkpoint as checkpoint_module
from gatedformer.train.checkpoint import latest_checkpoint, load_checkpoint
from gatedformer.train.loop import train
from gatedformer.train.rundir import MARKER_FILE, is_run_folder
from gatedformer.train.runlog import read_log

RECIPE = "ptb-char-tiny"
pytestmark = pytest.mark.usefixtures("one_thread")


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


# ---------------------------------------------------------------------------------------------
# 3. Optional modules before the first step; a failed evaluation keeps the steps before it


@pytest.mark.parametrize("recipe, overrides, module, extra", [
    ("multi30k-convs2s-tiny", [], "sacrebleu", "translate"),
    ("wmt14-convs2s-tiny", [], "sacremoses", "translate"),
    ("glue-tiny", ["data.task=", "data.corpus=glue-sst2"], "sklearn", "bert"),  # a GLUE fine-tuning run
    ("bert-mlm-tiny", [], "tokenizers", "bert"),
])
def test_a_missing_optional_module_is_named_before_the_first_step(
        recipe: str, overrides: list[str], module: str, extra: str, tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # what an environment without it imports
    out = tmp_path / "run"
    empty = tmp_path / "no-data"  # had the check come after the data were read, the corpus would be missing
    empty.mkdir()
    assert main(["train", "--recipe", recipe, "--out", str(out), "--data-dir", str(empty), "--quiet",
                 *sets([*overrides, "train.steps=2", "train.eval_every=1"])]) == 2
    line = one_error_line(capsys)
    assert f"runs need {module}, which is not installed here" in line
    assert f"pip install 'gatedformer[{extra}]'" in line
    assert not out.exists()


def test_an_evaluation_that_fails_mid_run_keeps_the_steps_before_it(
        runs: dict, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    real_evaluate, calls = LanguageModelTask.evaluate, []

    def evaluate(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == 2:  # step 8's
            raise GatedformerError("BLEU needs sacrebleu; install it with pip install 'gatedformer[translate]'")
        return real_evaluate(self, *args, **kwargs)

    monkeypatch.setattr(LanguageModelTask, "evaluate", evaluate)
    run = tmp_path / "run"
    assert main(train_args(runs, run)) == 2
    line = one_error_line(capsys)
    assert "BLEU needs sacrebleu" in line and "the evaluation at step 8 failed; the 8 steps before it are kept" in line
    assert f"continue with --resume --out {run}" in line
    checkpoint = load_checkpoint(latest_checkpoint(run))
    assert checkpoint.meta["step"] == 8 and checkpoint.meta["evaluation_pending"] is True

    monkeypatch.setattr(LanguageModelTask, "evaluate", real_evaluate)
    assert main(train_args(runs, run, "--resume")) == 0
    finished = json.loads((run / "results.json").read_text())
    assert finished["test_loss"] == runs["result"].test_loss and finished["steps"] == 12
    assert [r["step"] for r in read_log(run) if r["event"] == "eval"] == [4, 8, 12]


# ---------------------------------------------------------------------------------------------
# 4, 5, 6. Silently wrong: an edited meta.json, a resume without config.json, a diverged run


def test_an_edited_checkpoint_meta_is_refused(runs: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = copy_run(runs, "half", tmp_path)
    meta_file = latest_checkpoint(run) / "meta.json"
    original = meta_file.read_text()
    for step in (900, 10):
        meta_file.write_text(original.replace('"step": 4,', f'"step": {step},'))
        assert main(train_args(runs, run, "--resume")) == 2
        line = one_error_line(capsys)
        assert f"meta.json is damaged: its step ({step}) is not its folder's (4)" in line
    meta_file.write_text(original.replace('"tokens_seen": ', '"tokens_seen": 1'))  # more tokens than it saw
    assert main(train_args(runs, run, "--resume")) == 2
    assert "meta.json is damaged: it does not match the checksum it recorded" in one_error_line(capsys)
    assert not (run / "results.json").exists()
    meta_file.write_text(original)
    assert main(train_args(runs, run, "--resume")) == 0
    assert json.loads((run / "results.json").read_text())["steps"] == 12


def test_a_resume_without_config_json_refuses_changed_fields(runs: dict, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    run = copy_run(runs, "half", tmp_path)
    (run / "config.json").unlink()
    assert main(train_args(runs, run, "--resume", "--set", "optim.weight_decay=0.5")) == 2
    line = one_error_line(capsys)
    assert f"cannot resume {run}: the config differs from the saved one in optim.weight_decay (" in line
    assert ", 0.5 now)" in line and not (run / "config.json").exists()
    assert main(train_args(runs, run, "--resume")) == 0
    assert json.loads((run / "config.json").read_text()) == runs["config"].to_dict()


def test_a_diverged_run_stops_at_a_non_finite_validation_loss_and_eval_prints_strict_json(
        runs: dict, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    real_evaluate, calls = LanguageModelTask.evaluate, []

    def diverged(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        fields = real_evaluate(self, *args, **kwargs)
        calls.append(1)
        return {**fields, "valid_loss": math.nan, "valid_bpc": math.nan} if len(calls) >= 2 else fields

    monkeypatch.setattr(LanguageModelTask, "evaluate", diverged)
    run = tmp_path / "run"
    assert main(train_args(runs, run)) == 3
    line = one_error_line(capsys)
    assert "the validation loss at step 8 is nan (the model diverged" in line
    assert "(step-00000004) is kept: continue from it with --resume and a lower optim.lr" in line
    assert latest_checkpoint(run).name == "step-00000004" and not (run / "results.json").exists()

    monkeypatch.setattr(LanguageModelTask, "evaluate_split", lambda *args, **kwargs: {"loss": math.nan,
                                                                                      "bpc": math.inf})
    assert main(["eval", "--run", str(runs["finished"])]) == 0

    def refuse(constant: str) -> None:
        raise ValueError(f"not strict JSON: {constant}")

    printed = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert printed["loss"] is None and printed["bpc"] is None


# ---------------------------------------------------------------------------------------------
# 7, 8. One line, not a traceback: a link at a checkpoint slot, Ctrl-C at start-up


def test_a_link_or_file_at_a_later_checkpoint_slot_is_one_line(runs: dict, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    run = copy_run(runs, "half", tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("keep me")
    slot = run / "ckpt" / "step-00000008"
    slot.symlink_to(elsewhere, target_is_directory=True)
    assert main(train_args(runs, run, "--resume")) == 2
    line = one_error_line(capsys)
    assert f"{slot} is a symbolic link, not a checkpoint folder the run wrote; move it out of" in line
    assert tree(elsewhere) == {"precious.txt": b"keep me"} and latest_checkpoint(run).name == "step-00000004"
    slot.unlink()
    slot.write_text("a file")
    assert main(train_args(runs, run, "--resume")) == 2
    assert f"{slot} is a file, not a checkpoint folder" in one_error_line(capsys)
    slot.unlink()
    assert main(train_args(runs, run, "--resume")) == 0


INTERRUPTED_IMPORT = """
import importlib.abc, sys

class Interrupt(importlib.abc.MetaPathFinder):  # Ctrl-C while PyTorch loads, at the same point every time
    def find_spec(self, name, path, target=None):
        if name == "torch":
            raise KeyboardInterrupt

sys.meta_path.insert(0, Interrupt())
sys.argv = ["gatedformer", *sys.argv[1:]]
from gatedformer.cli import main  # what the gatedformer command runs
sys.exit(main())
"""


def test_ctrl_c_at_start_up_is_one_line_and_leaves_nothing(runs: dict, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED_IMPORT)
    process = subprocess.run([sys.executable, str(script), *train_args(runs, out)], capture_output=True, text=True,
                             timeout=120)
    assert process.returncode in (130, -2)  # Python ends by SIGINT: the shell sees 130
    assert process.stderr.splitlines() == ["gatedformer: interrupted while starting; nothing was written"]
    assert not out.exists()

    def interrupted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise KeyboardInterrupt

    monkeypatch.setattr(LanguageModelTask, "load_data", interrupted)  # after the folder was claimed
    assert main(train_args(runs, out)) == 130
    assert capsys.readouterr().err.splitlines() == ["gatedformer: interrupted"]
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# 9, 10, 11. Advice that names the real cause, and works when followed


def test_a_checkpoint_replaced_while_it_is_read_is_read_again_from_the_newer_one(
        runs: dict, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    run = copy_run(runs, "half", tmp_path)
    newer = runs["later"] / "ckpt" / "step-00000008"
    real_read, replaced = checkpoint_module.read_limited, []

    def read_limited(path, limit):  # noqa: ANN001, ANN202
        data = real_read(path, limit)
        if Path(path) == run / "ckpt" / "step-00000004" / "meta.json" and not replaced:
            # Between this read and the next, the trainer checkpoints step 8 and deletes step 4, as it does.
            replaced.append(1)
            shutil.copytree(newer, run / "ckpt" / newer.name)
            (run / "ckpt" / "LATEST").write_text(newer.name + "\n")
            shutil.rmtree(run / "ckpt" / "step-00000004")
        return data

    monkeypatch.setattr(checkpoint_module, "read_limited", read_limited)
    loaded = load_trained(run, device="cpu")
    assert replaced
    expected = load_checkpoint(newer, with_trainer=False).model_state
    assert all(torch.equal(tensor, expected[name]) for name, tensor in
               checkpoint_module.model_state_for_saving(loaded.model).items())

    # A checkpoint that is still the newest and damaged is still refused.
    (run / "ckpt" / "step-00000008" / "model.safetensors").unlink()
    assert main(["eval", "--run", str(run)]) == 2
    line = one_error_line(capsys)
    assert "model.safetensors is missing" in line and "delete it and start over" not in line


def follow(advice: str) -> None:
    """Delete what a line of advice says to delete, as a user would."""
    match = (re.search(r"delete (\S+) and (\S+), then run", advice)
             or re.search(r"delete (\S+) and run the same train command", advice))
    assert match, advice
    for path in map(Path, match.groups()):
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:200])


def test_advice_about_a_damaged_trainer_state_works_when_followed(runs: dict, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    # The run's only checkpoint: it starts over in its folder.
    run = copy_run(runs, "half", tmp_path)
    truncate(latest_checkpoint(run) / "trainer.pt")
    assert main(train_args(runs, run, "--resume")) == 2
    line = one_error_line(capsys)
    assert "trainer.pt is truncated or corrupt" in line
    assert f"delete {run / 'ckpt'} and run the same train command again" in line
    follow(line)
    assert main(train_args(runs, run, "--resume")) == 0
    assert json.loads((run / "results.json").read_text())["test_loss"] == runs["result"].test_loss

    # With an earlier checkpoint kept: it goes on from there.
    capsys.readouterr()  # the note that the run starts anew
    run = copy_run(runs, "later", tmp_path)
    shutil.copytree(runs["half"] / "ckpt" / "step-00000004", run / "ckpt" / "step-00000004")
    truncate(latest_checkpoint(run) / "trainer.pt")
    assert main(train_args(runs, run, "--resume")) == 2
    line = one_error_line(capsys)
    assert f"delete {run / 'ckpt' / 'step-00000008'} and {run / 'ckpt' / 'LATEST'}, then run the command again" in line
    follow(line)
    assert main(train_args(runs, run, "--resume")) == 0
    assert json.loads((run / "results.json").read_text())["test_loss"] == runs["result"].test_loss


def test_a_read_only_file_system_is_named_as_one(runs: dict, tmp_path: Path, capsys: pytest.CaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    real_replace = os.replace

    def read_only(source, target, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if str(source).startswith(str(tmp_path)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_replace(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "replace", read_only)
    assert main(train_args(runs, tmp_path / "run")) == 2
    line = one_error_line(capsys)
    assert "(Read-only file system); choose a folder on a writable file system" in line and "free space" not in line
    assert "Permission denied); choose a folder you can write to;" in str(
        cannot_write(Path("x"), PermissionError(errno.EACCES, os.strerror(errno.EACCES))))
    assert "(No space left on device); free space there" in str(
        cannot_write(Path("x"), OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
