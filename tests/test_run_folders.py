"""Run folders no one can corrupt or clobber, bounded inputs, and stops that come when asked: one owner per run
folder, no training into a folder that is not a run, a stop signal that ends a long evaluation, bounded readers,
one error line with the right advice for damaged run files, and weights that carry a checksum."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import one_error_line, sets, tiny_overrides

from gatedformer.cli import _one_line_warning, main
from gatedformer.config import build_config, load_recipe
from gatedformer.data import corpora
from gatedformer.errors import CheckpointError, DataError
from gatedformer.io import FolderLock
from gatedformer.runs import load_trained
from gatedformer.tasks.lm import generate_stream
from gatedformer.train.checkpoint import latest_checkpoint, load_checkpoint, write_tensors
from gatedformer.train.loop import TrainingInterrupted, prepare_run_dir, train
from gatedformer.train.rundir import is_run_folder
from gatedformer.train.runlog import read_log

RECIPE = "ptb-char-tiny"
TIMING = ("run_dir", "seconds_per_step", "train_seconds", "tokens_per_second", "setup_seconds", "wall_seconds")
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "park", "in", "sun"]


def write_corpus(path: Path, lines: int) -> str:
    picks = torch.randint(0, len(WORDS), (lines * 8,), generator=torch.Generator().manual_seed(0)).tolist()
    text = "\n".join(" ".join(WORDS[i] for i in picks[j: j + 8]) + "." for j in range(0, len(picks), 8))
    path.write_text(text + "\n", encoding="utf-8")
    return f"text:{path}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A finished tiny run and one stopped after step 8 (checkpoint at 8), trained once in this process."""
    folder = tmp_path_factory.mktemp("runs")
    corpus = write_corpus(folder / "corpus.txt", 375)
    overrides = tiny_overrides(corpus)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GATEDFORMER_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        config = build_config(load_recipe(RECIPE), overrides)
        result = train(config, folder / "finished", progress=False)
        assert train(config, folder / "half", progress=False, stop_after=8) is None
    return {"overrides": overrides, "finished": folder / "finished", "half": folder / "half", "result": result}


def copy_run(runs: dict, which: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(runs[which], tmp_path / which))


def train_args(runs: dict, out: Path | str, *extra: str) -> list[str]:
    return ["train", "--recipe", RECIPE, "--out", str(out), "--quiet", *sets(runs["overrides"]), *extra]


# ---------------------------------------------------------------------------------------------
# 1, 2. One owner per run folder; never a folder that is not a run


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.write(fd, b'{"pid": %d, "host": "elsewhere", "purpose": "train"}' % os.getpid())
print("locked", flush=True)
time.sleep(120)
"""


def test_a_held_run_folder_is_refused_with_its_holder_and_a_dead_holder_leaves_it_free(
        runs: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = copy_run(runs, "half", tmp_path)
    log = (run / "log.jsonl").read_bytes()
    lock = FolderLock(run / "run.lock", "train")
    assert lock.acquire()
    try:
        assert main(train_args(runs, run, "--resume")) == 2
        line = one_error_line(capsys)
        assert f"is in use by process {os.getpid()} on host {socket.gethostname()} (train since " in line
        assert "choose another --out" in line
        assert main(train_args(runs, run)) == 2  # nor a new run over it
        one_error_line(capsys)
    finally:
        lock.release()
    assert (run / "log.jsonl").read_bytes() == log and latest_checkpoint(run).name == "step-00000008"

    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run / "run.lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(train_args(runs, run, "--resume")) == 2
        assert f"in use by process {holder.pid} on host elsewhere" in one_error_line(capsys)
    finally:
        holder.kill()  # SIGKILL: no clean-up runs, the kernel drops the lock
        holder.wait()
    assert main(train_args(runs, run, "--resume")) == 0
    assert json.loads((run / "results.json").read_text())["test_loss"] == runs["result"].test_loss


def test_train_refuses_a_folder_that_is_not_a_run_an_empty_out_and_a_name_too_long(
        runs: dict, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    files = {"config.json": b'{"lr": 3}', "model.safetensors": b"my weights", "loss.png": b"png", "log.jsonl": b"{}\n"}
    for name, content in files.items():
        (mine / name).write_bytes(content)
    assert main(train_args(runs, mine)) == 2
    line = one_error_line(capsys)
    assert "holds files that are not a gatedformer run (config.json, log.jsonl, loss.png, model.safetensors)" in line
    assert {p.name: p.read_bytes() for p in mine.iterdir()} == files  # nothing written, nothing deleted

    monkeypatch.chdir(tmp_path / "mine")
    assert main(train_args(runs, "")) == 2
    assert "--out is empty" in one_error_line(capsys)
    assert main(train_args(runs, "runs/" + "x" * 300)) == 2
    assert "is 300 bytes long, over the 255-byte limit" in one_error_line(capsys)
    assert {p.name for p in mine.iterdir()} == set(files)

    empty = tmp_path / "empty"
    empty.mkdir()  # an empty folder is fine; once trained into, it is a run by the marker train wrote
    assert train(build_config(load_recipe(RECIPE), runs["overrides"]), empty, progress=False, stop_after=4) is None
    (empty / "run.lock").unlink()
    shutil.rmtree(empty / "ckpt")
    assert is_run_folder(empty) and not is_run_folder(mine)  # not by its checkpoints, its lock or its config.json
    (empty / "gatedformer.json").unlink()
    assert not is_run_folder(empty)

    # A train refused on its corpus after the claim leaves the disk as it found it: a folder it made is gone, a
    # user's empty folder stays, and neither holds a stray run.lock or marker that would mark it as a run.
    bad = build_config(load_recipe(RECIPE), [*runs["overrides"], "data.corpus=text:" + str(tmp_path / "absent.txt")])
    for out, existed in ((tmp_path / "new" / "run", False), (tmp_path / "users-empty", True)):
        if existed:
            out.mkdir()
        with pytest.raises(DataError):
            train(bad, out, progress=False)
        assert out.exists() == existed and (not existed or list(out.iterdir()) == [])


# ---------------------------------------------------------------------------------------------
# 3. A stop signal ends a long evaluation; the resumed run redoes it


@pytest.mark.slow
def test_a_stop_signal_ends_a_whole_split_evaluation_and_resume_redoes_it(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every valid token its own window: the whole-split evaluation at step 4 takes seconds.
    overrides = tiny_overrides(write_corpus(tmp_path / "corpus.txt", 1500), steps=4) + [
        "data.eval_batch_size=1", "data.eval_seq_len=1", "train.eval_windows=0"]
    config = build_config(load_recipe(RECIPE), overrides)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the one-thread process below, so the numbers compare bit for bit
    try:
        reference = train(config, tmp_path / "reference", progress=False)
        out = tmp_path / "run"
        args = ["train", "--recipe", RECIPE, "--out", str(out), "--quiet", *sets(overrides)]
        process = subprocess.Popen([sys.executable, "-m", "gatedformer", *args], stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            deadline = time.monotonic() + 240
            while not any(r.get("step") == 4 for r in read_log(out)):  # logged just before the evaluation
                assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
                time.sleep(0.005)
            # While it evaluates, the folder is its own: a concurrent --resume is refused, naming it.
            assert main([*args, "--resume"]) == 2
            assert f"in use by process {process.pid}" in one_error_line(capsys)
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) == 143  # 128 + SIGTERM
        finally:
            process.kill()
            process.wait()
        lines = [line for line in process.stderr.read().splitlines() if line.strip()]
        assert lines == [f"gatedformer: error: stopped by signal 15 at step 4; checkpoint saved — continue with "
                         f"--resume --out {out}"]
        checkpoint = load_checkpoint(latest_checkpoint(out))
        assert checkpoint.meta["step"] == 4 and checkpoint.meta["evaluation_pending"] is True
        assert not any(r["event"] == "eval" for r in read_log(out))

        resumed = train(config, out, progress=False, resume=True)
    finally:
        torch.set_num_threads(threads)
    drop = ("time", "tokens_per_s")
    assert [{k: v for k, v in r.items() if k not in drop} for r in read_log(out)] == [
        {k: v for k, v in r.items() if k not in drop} for r in read_log(tmp_path / "reference")]
    assert {k: v for k, v in resumed.__dict__.items() if k not in TIMING} == {
        k: v for k, v in reference.__dict__.items() if k not in TIMING}
    # Same weights and config, same bytes: the weights file's hash vouches for the run.
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "reference" / "model.safetensors").read_bytes()
    assert TrainingInterrupted(2, 1, out).exit_code == 130 and TrainingInterrupted("on another rank", 1, out
                                                                                   ).exit_code == 143


# ---------------------------------------------------------------------------------------------
# 4. Bounded generation; 6. options that were tracebacks


def test_generation_streams_in_bounded_memory_and_checks_its_options(
        runs: dict, capsys: pytest.CaptureFixture) -> None:
    run = load_trained(runs["finished"], device="cpu")
    pieces = generate_stream(run.model, run.data.vocab, "the cat", max_tokens=10**12, seed=3)
    first = list(itertools.islice(pieces, 6))  # a trillion tokens asked for; the first ones come at once
    assert first[0] == "the cat" and len(first) == 6
    assert "".join(first) == "".join(generate_stream(run.model, run.data.vocab, "the cat", max_tokens=5, seed=3))
    for option, value, fragment in [("--temperature", "nan", "--temperature must be a finite number above 0"),
                                    ("--temperature", "inf", "--temperature must be a finite number above 0"),
                                    ("--seed", str(10**23), "--seed must be a whole number from 0 to 2**64 - 1"),
                                    ("--tokens", "0", "--tokens must be a whole number of at least 1")]:
        assert main(["generate", "--run", str(runs["finished"]), option, value]) == 2
        assert fragment in one_error_line(capsys)


# ---------------------------------------------------------------------------------------------
# 6, 7. Damaged run files: one line each, with advice that loses nothing


def test_damaged_run_files_are_one_line_with_advice_that_keeps_the_run(
        runs: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = copy_run(runs, "half", tmp_path)
    meta_file = latest_checkpoint(run) / "meta.json"
    meta = meta_file.read_text()
    meta_file.write_text(meta.replace('"loss_sum": ', '"loss_sum": "many", "was": '))
    assert main(train_args(runs, run, "--resume")) == 2
    line = one_error_line(capsys)
    assert "'loss_sum' is 'many', not a finite number" in line and "no earlier checkpoint" in line
    meta_file.write_text(meta)

    pointer = run / "ckpt" / "LATEST"
    for name, problem in [("step-00000099", "names a checkpoint 'step-00000099' that does not exist"),
                          ("../../finished/ckpt/step-00000012", "which is not a checkpoint folder of this run")]:
        pointer.write_text(name + "\n")
        assert main(train_args(runs, run, "--resume")) == 2
        line = one_error_line(capsys)
        assert problem in line and f"delete {pointer}" in line and "(step-00000008) is then used" in line
    pointer.write_text("step-00000008\n")

    (run / "log.jsonl").rename(run / "log.jsonl.kept")
    (run / "log.jsonl").mkdir()
    assert main(train_args(runs, run, "--resume")) == 2
    assert "log.jsonl is a folder, not a regular file as the run keeps there; move it out" in one_error_line(capsys)
    (run / "log.jsonl").rmdir()
    records = (run / "log.jsonl.kept").read_text().splitlines()
    record = json.loads(records[3])
    damaged_step, record["step"] = record["step"], str(record["step"])
    (run / "log.jsonl").write_text("\n".join([*records[:3], json.dumps(record), *records[4:]]) + "\n")
    gates = {"event": "eval", "step": 8, "gates": ["not", "a", "mapping"]}
    with open(run / "log.jsonl", "a") as handle:
        handle.write(json.dumps(gates) + "\n")
    assert main(["analyze", "--run", str(run)]) == 0  # a record it cannot use is left out
    assert "no gates" in capsys.readouterr().out

    (run / "config.json").write_text('{"model": ')  # damaged; the checkpoint records the config
    config = build_config(load_recipe(RECIPE), runs["overrides"])
    assert prepare_run_dir(run, config, resume=True) == latest_checkpoint(run)
    with pytest.warns(UserWarning, match=r"config.json is damaged \(.*\); using the config recorded in .*meta.json"
                      ) as caught:
        assert main(["eval", "--run", str(run), "--split", "test"]) == 0
    warning = caught[0]
    assert _one_line_warning(warning.message, warning.category, warning.filename, warning.lineno).startswith(
        f"gatedformer: warning: {run / 'config.json'} is damaged")
    assert main(train_args(runs, run, "--resume")) == 0  # rewrites config.json; drops the damaged log record
    assert json.loads((run / "config.json").read_text()) == config.to_dict()
    steps = [r["step"] for r in read_log(run) if r["event"] == "train"]
    assert steps == [s for s in range(1, 13) if s != damaged_step]


def test_text_corpora_that_are_no_files_or_too_big_and_a_damaged_token_cache(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in [(folder, "a folder"), (fifo, "a FIFO"), (Path("/dev/zero"), "a device")]:
        with pytest.raises(DataError, match=f"text: {path} is {kind}, not a text file") as info:
            corpora.load_corpus(f"text:{path}")
        assert "\n" not in str(info.value)
    monkeypatch.setenv("GATEDFORMER_CACHE", str(tmp_path / "cache"))
    corpus = write_corpus(tmp_path / "corpus.txt", 100)
    first = corpora.load_corpus(corpus)
    (array,) = (tmp_path / "cache" / "tokens").glob("*.train.npy")
    np.save(array, np.full_like(np.load(array), 250))  # ids the vocabulary does not have
    again = corpora.load_corpus(corpus)
    assert torch.equal(again.train, first.train) and len(again.vocab) == len(first.vocab)
    monkeypatch.setattr(corpora, "TEXT_BYTES_PER_CHARACTER", 10**12)
    with pytest.raises(DataError, match=r"too big to read here: .* more than this machine's .* use a part of it"):
        corpora.load_corpus(corpus)


# ---------------------------------------------------------------------------------------------
# 8. Integrity: checksums, LATEST inside its run, byte-reproducible weights


def flip_a_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_flipped_bytes_in_weights_or_trainer_state_are_refused(runs: dict, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    run = copy_run(runs, "finished", tmp_path)
    flip_a_byte(run / "model.safetensors")
    for command in (["eval", "--run", str(run)], ["generate", "--run", str(run), "--tokens", "3"]):
        assert main(command) == 2
        line = one_error_line(capsys)
        assert "model.safetensors is truncated or corrupt (its contents do not match the checksum" in line
        assert "delete it to use the run's latest checkpoint" in line
    (run / "model.safetensors").unlink()
    checkpoint = latest_checkpoint(run)
    flip_a_byte(checkpoint / "model.safetensors")
    assert main(["eval", "--run", str(run)]) == 2
    assert "do not match the checksum" in one_error_line(capsys)
    flip_a_byte(checkpoint / "model.safetensors")
    state = torch.load(checkpoint / "trainer.pt", weights_only=True)
    state["optimizer"]["param_groups"][0]["lr"] *= 2  # loads as well as the real one
    torch.save(state, checkpoint / "trainer.pt")
    with pytest.raises(CheckpointError, match="trainer.pt is damaged: it does not match the checksum"):
        load_checkpoint(checkpoint)

    tensors = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.ones(2, dtype=torch.bfloat16),
               "c": torch.tensor(3)}
    metadata = {f"key{i}": str(i) for i in range(12)}
    written = []
    for k in range(4):
        write_tensors(tensors, tmp_path / f"w{k}.safetensors", metadata)
        written.append((tmp_path / f"w{k}.safetensors").read_bytes())
    assert all(w == written[0] for w in written)  # safetensors alone writes the metadata in a random order
    header = json.loads(written[0][8: 8 + int.from_bytes(written[0][:8], "little")])
    assert list(header["__metadata__"]) == sorted(header["__metadata__"]) and "weights_sha256" in header["__metadata__"]
