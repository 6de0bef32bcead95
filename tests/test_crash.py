"""Faults: real training processes killed (SIGKILL, also inside a checkpoint write) or stopped (SIGTERM)
resume to the numbers of a run never interrupted; non-finite losses keep the last good checkpoint; an
interrupted ``compare`` keeps its finished runs; loading a checkpoint never runs code from it."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import one_error_line, sets, tiny_overrides

from gatedformer.cli import main
from gatedformer.config import build_config, load_recipe
from gatedformer.errors import CheckpointError
from gatedformer.tasks import lm as lm_task
from gatedformer.train import loop
from gatedformer.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from gatedformer.train.runlog import read_log

RECIPE = "ptb-char-tiny"
STEPS = 40  # 40 train records and 5 eval records (every 8 steps) in the log
TIMING = ("run_dir", "seconds_per_step", "train_seconds", "tokens_per_second", "setup_seconds", "wall_seconds")

# A training process that stops inside its second checkpoint write: after the weights file, before the
# carried state, trainer state and meta.json. It tells the test so by writing the file named in argv[1].
STALL_IN_CHECKPOINT = """
import os, sys, time
from pathlib import Path
import gatedformer.train.checkpoint as checkpoint
from gatedformer.cli import main

ready, real_save_file, calls = Path(sys.argv[1]), checkpoint.save_file, []

def save_file(tensors, filename, metadata=None):
    real_save_file(tensors, filename, metadata=metadata)
    calls.append(filename)
    if len(calls) == 3:  # each checkpoint writes model.safetensors, then carry.safetensors
        Path(f"{ready}.tmp").write_text(filename)
        os.replace(f"{ready}.tmp", ready)  # the test sees the whole name or nothing
        time.sleep(600)

checkpoint.save_file = save_file
sys.exit(main(sys.argv[2:]))
"""


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One uninterrupted run, in this process; every faulted run must end with its numbers."""
    folder = tmp_path_factory.mktemp("crash")
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "park", "in", "sun"]
    picks = torch.randint(0, len(words), (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    text = "\n".join(" ".join(words[i] for i in picks[j : j + 8]) + "." for j in range(0, len(picks), 8))
    (folder / "corpus.txt").write_text(text + "\n", encoding="utf-8")
    overrides = tiny_overrides(f"text:{folder / 'corpus.txt'}", steps=STEPS) + [
        "train.eval_every=8", "train.eval_windows=1", "model.dropout=0.1"]
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GATEDFORMER_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        torch.set_num_threads(1)
        loop.train(build_config(load_recipe(RECIPE), overrides), folder / "run", progress=False)
        torch.set_num_threads(threads)
    return {"overrides": overrides, "run": folder / "run"}


def train_args(reference: dict, out: Path) -> list[str]:
    return ["train", "--recipe", RECIPE, "--out", str(out), "--quiet", *sets(reference["overrides"])]


def launch(args: list[str], folder: Path, script: str | None = None) -> subprocess.Popen:
    """A real ``python -m gatedformer`` (or ``python -c script``) process, one thread, output to files."""
    command = [sys.executable, *(["-c", script] if script else ["-m", "gatedformer"]), *args]
    return subprocess.Popen(command, stdout=open(folder / "stdout.txt", "w"), stderr=open(folder / "stderr.txt", "w"),
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_for(condition: Callable[[], bool], process: subprocess.Popen, folder: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"the process ended ({process.returncode}) before the moment to interrupt it: "
                        f"{(folder / 'stderr.txt').read_text()[-2000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("timed out waiting for the moment to interrupt the process")
        time.sleep(0.005)


def log_lines(run_dir: Path) -> int:
    try:
        return (run_dir / "log.jsonl").read_text(encoding="utf-8").count("\n")
    except OSError:
        return 0


def assert_same_as_reference(run_dir: Path, reference: dict) -> None:
    records, expected = read_log(run_dir), read_log(reference["run"])
    drop = ("time", "tokens_per_s")  # wall-clock fields
    assert [{k: v for k, v in r.items() if k not in drop} for r in records] == [
        {k: v for k, v in r.items() if k not in drop} for r in expected]
    assert sum(r["event"] == "train" for r in records) == STEPS
    results = json.loads((run_dir / "results.json").read_text())
    wanted = json.loads((reference["run"] / "results.json").read_text())
    assert {k: v for k, v in results.items() if k not in TIMING} == {k: v for k, v in wanted.items() if k not in TIMING}


@pytest.mark.slow
def test_sigkill_at_a_random_moment_then_resume(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    moment = random.randint(1, 30)  # kill once the log has this many lines: before, in, between checkpoints
    process = launch(train_args(reference, out), tmp_path)
    try:
        wait_for(lambda: log_lines(out) >= moment, process, tmp_path)
    finally:
        process.kill()
        process.wait()
    assert not (out / "results.json").exists(), f"the run finished before the kill (moment {moment})"
    assert main([*train_args(reference, out), "--resume"]) == 0, f"moment {moment}"
    assert_same_as_reference(out, reference)


@pytest.mark.slow
def test_sigkill_inside_a_checkpoint_write_keeps_the_previous_checkpoint(reference: dict, tmp_path: Path) -> None:
    out, ready = tmp_path / "run", tmp_path / "ready"
    process = launch([str(ready), *train_args(reference, out)], tmp_path, script=STALL_IN_CHECKPOINT)
    try:
        wait_for(ready.is_file, process, tmp_path)
    finally:
        process.kill()
        process.wait()
    partial = out / "ckpt" / ".step-00000016.partial"
    assert ready.read_text() == str(partial / "model.safetensors")
    assert (partial / "model.safetensors").is_file() and not (partial / "meta.json").exists()
    assert latest_checkpoint(out).name == "step-00000008"
    assert load_checkpoint(latest_checkpoint(out)).meta["step"] == 8
    assert main([*train_args(reference, out), "--resume"]) == 0
    assert not partial.exists()
    assert_same_as_reference(out, reference)


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_with_one_line(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    moment = random.randint(1, 30)
    process = launch(train_args(reference, out), tmp_path)
    try:
        wait_for(lambda: log_lines(out) >= moment, process, tmp_path)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 143, f"moment {moment}"  # 128 + SIGTERM, as the shell reports it
    finally:
        process.kill()
        process.wait()
    lines = [line for line in (tmp_path / "stderr.txt").read_text().splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("gatedformer: error: stopped by signal 15 at step ") and "--resume" in lines[0]
    step = int(lines[0].split(" at step ")[1].split(";")[0])
    assert latest_checkpoint(out).name == f"step-{step:08d}"
    assert main([*train_args(reference, out), "--resume"]) == 0
    assert_same_as_reference(out, reference)


def test_nonfinite_loss_keeps_the_last_good_checkpoint(reference: dict, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    build_model = lm_task.build_model

    def poisoned(config, vocab_size):  # from the 11th training forward on, the loss (or the logits) is NaN
        model = build_model(config, vocab_size)
        forward, calls = model.forward, []

        def nan_forward(x, state=None, **kwargs):
            out = forward(x, state, **kwargs)
            if model.training:
                calls.append(1)
                if len(calls) >= 11:
                    out.loss = out.loss * float("nan")
            return out

        model.forward = nan_forward
        return model

    monkeypatch.setattr(lm_task, "build_model", poisoned)
    config = build_config(load_recipe(RECIPE), reference["overrides"])
    with pytest.raises(loop.NonFiniteLoss, match=r"at step 11 \(loss nan\); the last good checkpoint "
                                                 r"\(step-00000008\) is kept: continue from it with --resume"):
        loop.train(config, tmp_path / "run", progress=False)
    checkpoint = load_checkpoint(latest_checkpoint(tmp_path / "run"))
    assert checkpoint.meta["step"] == 8
    assert all(torch.isfinite(t).all() for t in checkpoint.model_state.values())
    monkeypatch.undo()
    # The kept checkpoint is the good state of step 8: resuming from it ends exactly like the reference.
    assert main([*train_args(reference, tmp_path / "run"), "--resume"]) == 0
    assert_same_as_reference(tmp_path / "run", reference)


@pytest.mark.slow
def test_interrupted_compare_keeps_finished_runs(reference: dict, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "cmp"
    args = ["compare", "--recipe", RECIPE, "--out", str(out), "--variants", "baseline", "+σ SDU",
            *sets(reference["overrides"])]
    second = out / "sigma-SDU" / "seed-0"
    process = launch([*args, "--quiet"], tmp_path)
    try:
        wait_for(lambda: (second / "ckpt" / "LATEST").is_file(), process, tmp_path)
    finally:
        process.kill()
        process.wait()
    first = out / "baseline" / "seed-0" / "results.json"
    stamp, content = first.stat().st_mtime_ns, first.read_bytes()
    assert not (second / "results.json").exists()

    assert main(args) == 0
    messages = capsys.readouterr().err
    assert "[1/2] baseline seed 0: finished earlier, kept" in messages
    assert "[2/2] +σ SDU seed 0 (resuming" in messages
    assert first.stat().st_mtime_ns == stamp and first.read_bytes() == content
    assert_same_as_reference(first.parent, reference)  # the baseline variant is the reference config
    steps = [r["step"] for r in read_log(second) if r["event"] == "train"]
    assert steps == list(range(1, STEPS + 1)) and (second / "results.json").is_file()


# ---------------------------------------------------------------------------------------------
# Loading never executes code from a file, and refuses weights of another architecture


class _Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_code_carrying_files_are_refused_without_running(reference: dict, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    shutil.copytree(reference["run"], run)
    marker = tmp_path / "payload-ran"
    pickle.loads(pickle.dumps(_Payload(marker)))  # the payload works when unpickled...
    assert marker.exists()
    marker.unlink()

    # ...but not as final weights,
    (run / "model.safetensors").write_bytes(pickle.dumps({"weight": _Payload(marker)}))
    assert main(["eval", "--run", str(run)]) == 2
    assert "truncated or corrupt" in one_error_line(capsys)
    # as checkpoint weights,
    checkpoint = latest_checkpoint(run)
    (run / "model.safetensors").unlink()
    (checkpoint / "model.safetensors").write_bytes(pickle.dumps(_Payload(marker)))
    assert main(["eval", "--run", str(run)]) == 2
    assert "truncated or corrupt" in one_error_line(capsys)
    # nor as trainer state, whether written by torch.save or a bare pickle.
    shutil.copy(reference["run"] / "ckpt" / checkpoint.name / "model.safetensors", checkpoint)
    torch.save({"optimizer": _Payload(marker)}, checkpoint / "trainer.pt")
    with pytest.raises(CheckpointError, match="refused to load"):
        load_checkpoint(checkpoint)
    (checkpoint / "trainer.pt").write_bytes(pickle.dumps({"optimizer": _Payload(marker)}))
    with pytest.raises(CheckpointError, match="refused to load|truncated or corrupt"):
        load_checkpoint(checkpoint)
    assert not marker.exists()


def test_weights_of_another_architecture_are_refused_by_name(reference: dict, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture) -> None:
    run = tmp_path / "run"
    shutil.copytree(reference["run"], run)
    config = json.loads((run / "config.json").read_text())
    config["model"].update(n_layers=3, d_ffn=48, dropout=0.3)  # dropout does not change the weights
    (run / "config.json").write_text(json.dumps(config))
    assert main(["eval", "--run", str(run)]) == 2
    line = one_error_line(capsys)
    assert "model.d_ffn (32 saved, 48 now); model.n_layers (2 saved, 3 now)" in line and "dropout" not in line
    (run / "model.safetensors").unlink()  # the checkpoint's recorded config is checked the same way
    assert main(["eval", "--run", str(run)]) == 2
    assert "model.n_layers (2 saved, 3 now)" in one_error_line(capsys)


def test_killed_between_the_last_checkpoint_and_the_results(reference: dict, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(reference["run"], run)
    (run / "results.json").unlink()  # what a kill after the final checkpoint, before results.json, leaves
    assert latest_checkpoint(run).name == f"step-{STEPS:08d}"
    assert main([*train_args(reference, run), "--resume"]) == 0
    assert_same_as_reference(run, reference)  # with one test record in the log, not two


def test_the_latest_checkpoint_is_never_rewritten_in_place(reference: dict, tmp_path: Path) -> None:
    # A stop signal at an evaluation step saves that step again; deleting the folder LATEST names to rewrite
    # it would leave, for a moment, a pointer to nothing.
    run = tmp_path / "run"
    shutil.copytree(reference["run"], run)
    checkpoint = latest_checkpoint(run)
    before = {f.name: f.stat().st_mtime_ns for f in checkpoint.iterdir()}
    loaded = load_checkpoint(checkpoint)
    model = torch.nn.Linear(2, 2)
    assert save_checkpoint(run, STEPS, model, loaded.trainer_state, loaded.meta) == checkpoint
    assert {f.name: f.stat().st_mtime_ns for f in checkpoint.iterdir()} == before
    assert save_checkpoint(run, STEPS + 1, model, loaded.trainer_state, loaded.meta).name == f"step-{STEPS + 1:08d}"
    assert latest_checkpoint(run).name == f"step-{STEPS + 1:08d}" and not checkpoint.exists()
