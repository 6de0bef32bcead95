"""Data-parallel training: two gloo processes compute what one process computes, and resume exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import sets, tiny_overrides
from safetensors.torch import load_file
from torch.nn import functional as F

from gatedformer.cli import _train_flags, build_parser, main
from gatedformer.config import build_config, load_recipe
from gatedformer.data import LMStream, load_corpus
from gatedformer.errors import ConfigError
from gatedformer.models import build_model
from gatedformer.train import distributed
from gatedformer.train.checkpoint import latest_checkpoint, load_checkpoint
from gatedformer.train.loop import train
from gatedformer.train.runlog import read_log, series

RECIPE = "ptb-char-tiny"
TIMING = ("run_dir", "seconds_per_step", "train_seconds", "tokens_per_second", "setup_seconds", "wall_seconds")

# Runs inside each torchrun worker: ``gatedformer train`` with dropout off (compared with one process), then
# an uninterrupted run with dropout and carried memory, and the same run stopped after 6 of 8 steps (the test
# resumes it with ``torchrun -m gatedformer train --resume``).
WORKER = """
import json, sys
from gatedformer.cli import main
from gatedformer.config import build_config, load_recipe
from gatedformer.train.loop import train

spec = json.loads(sys.argv[1])
assert main(["train", "--recipe", "ptb-char-tiny", "--out", spec["equal"], "--quiet", *spec["equal_args"]]) == 0
config = build_config(load_recipe("ptb-char-tiny"), spec["dropout_overrides"])
train(config, spec["whole"], progress=False)
assert train(config, spec["split"], progress=False, stop_after=6) is None
"""


pytestmark = pytest.mark.usefixtures("one_thread")


def torchrun(*args: str) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc_per_node 2 ARGS`` with one thread per process."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def train_losses(run_dir: Path) -> list[float]:
    return series(read_log(run_dir), "train", "train_loss")[1]


@pytest.mark.slow
def test_two_processes_train_like_one_and_resume_exactly(text_corpus: str, tmp_path: Path) -> None:
    # On the CPU (gloo) even where a GPU is present: one GPU could not hold two ranks.
    equal = tiny_overrides(text_corpus, steps=8) + ["model.dropout=0", "train.device=cpu"]
    dropout = tiny_overrides(text_corpus, steps=8) + ["model.dropout=0.1", "model.backbone=transformer-xl",
                                                     "model.mem_len=8", "train.device=cpu"]
    spec = {"equal": str(tmp_path / "ddp"), "equal_args": sets(equal), "dropout_overrides": dropout,
            "whole": str(tmp_path / "whole"), "split": str(tmp_path / "split")}
    script = tmp_path / "worker.py"
    script.write_text(WORKER, encoding="utf-8")
    launched = torchrun(str(script), json.dumps(spec))
    assert launched.stdout.count("valid loss") == 1  # rank 0 alone prints

    # Same global batch in one process: the same losses, within float tolerance.
    single = train(build_config(load_recipe(RECIPE), equal), tmp_path / "single", progress=False)
    ddp_log, single_log = read_log(tmp_path / "ddp"), read_log(tmp_path / "single")
    assert [r["step"] for r in ddp_log if r["event"] == "train"] == list(range(1, 9))  # logged once, by rank 0
    assert train_losses(tmp_path / "ddp") == pytest.approx(train_losses(tmp_path / "single"), rel=1e-5, abs=1e-6)
    assert [r.get("tokens") for r in ddp_log] == [r.get("tokens") for r in single_log]  # the global token count
    ddp = json.loads((tmp_path / "ddp" / "results.json").read_text())
    for key in ("valid_loss", "test_loss"):
        assert ddp[key] == pytest.approx(getattr(single, key), rel=1e-5)
    assert ddp["params"] == single.params and ddp["steps"] == 8

    # The stopped run holds every rank's RNG state and carried memory; resuming under DDP is exact.
    checkpoint = load_checkpoint(latest_checkpoint(tmp_path / "split"))
    assert checkpoint.meta["step"] == 6 and checkpoint.meta["world_size"] == 2
    rng = [part["rng_cpu"] for part in checkpoint.trainer_state["ranks"]]
    assert len(rng) == 2 and not torch.equal(rng[0], rng[1])
    assert len(checkpoint.carry) == 2 and checkpoint.carry[0] is not None
    resumed = torchrun("-m", "gatedformer", "train", "--recipe", RECIPE, "--out", spec["split"], "--resume",
                       "--quiet", *sets(dropout))
    assert resumed.stdout.count("valid loss") == 1  # rank 0 alone prints
    assert train_losses(tmp_path / "split") == train_losses(tmp_path / "whole")
    assert len(train_losses(tmp_path / "whole")) == 8
    whole = json.loads((tmp_path / "whole" / "results.json").read_text())
    split = json.loads((tmp_path / "split" / "results.json").read_text())
    assert {k: v for k, v in whole.items() if k not in TIMING} == {k: v for k, v in split.items() if k not in TIMING}
    final_a = load_file(str(tmp_path / "whole" / "model.safetensors"))
    final_b = load_file(str(tmp_path / "split" / "model.safetensors"))
    assert final_a.keys() == final_b.keys() and all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_shard_means_average_to_the_global_mean(text_corpus: str) -> None:
    """Why averaging per-rank mean losses (and DDP's averaged gradients) equals one process's."""
    config = build_config(load_recipe(RECIPE), tiny_overrides(text_corpus) + ["model.dropout=0"])
    corpus = load_corpus(config.data.corpus)
    torch.manual_seed(0)
    model = build_model(config.model, len(corpus.vocab))

    def loss_and_grads(stream: LMStream, k: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        x, y = stream.window(k)
        logits = model(x, None).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    whole = LMStream(corpus.train, 4, 16)
    shards = [LMStream(corpus.train, 4, 16, shard=(rank, 2)) for rank in range(2)]
    for k in (0, len(whole) - 1):  # a full window and the shorter last one
        loss, grads = loss_and_grads(whole, k)
        parts = [loss_and_grads(shard, k) for shard in shards]
        assert loss == pytest.approx(((parts[0][0] + parts[1][0]) / 2).item(), rel=1e-6)
        for i, grad in enumerate(grads):
            assert torch.allclose(grad, (parts[0][1][i] + parts[1][1][i]) / 2, atol=1e-6, rtol=1e-5)


def test_batch_must_split_across_processes(text_corpus: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    # What torchrun --nproc_per_node 2 puts in the environment; the check runs before any process group.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    args = ["train", "--recipe", RECIPE, "--out", str(tmp_path / "run"), "--quiet",
            *sets(tiny_overrides(text_corpus) + ["data.batch_size=5"])]
    assert main(args) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "data.batch_size=5 does not divide among 2 processes" in lines[0], lines
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # RANK and WORLD_SIZE set by hand, not by torchrun
    assert main([*args, "--set", "data.batch_size=4"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "could not join the process group of 2 processes" in lines[0], lines
    with pytest.raises(ConfigError, match="launch with torchrun"):
        monkeypatch.setenv("RANK", "2")
        distributed.env_ranks()


def test_more_processes_than_gpus_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=1 but this node has 1 CUDA device\(s\); use --nproc_per_node 1"):
        distributed.setup(4, torch.device("cuda"))


def test_single_process_helpers_are_plain() -> None:
    ctx = distributed.DistContext()
    assert not ctx.enabled and ctx.is_main
    assert distributed.mean_over_ranks(ctx, torch.tensor(2.5)) == 2.5
    assert distributed.any_rank(ctx, True) and not distributed.any_rank(ctx, False)
    assert distributed.broadcast_floats(ctx, [1.0, 2.0]) == [1.0, 2.0]
    assert distributed.gather_rank_states(ctx, None) is None
    assert len({distributed.rank_seed(0, r) for r in range(8)}) == 8


def test_bf16_trains_on_cpu(text_corpus: str, tmp_path: Path) -> None:
    config = build_config(load_recipe(RECIPE), tiny_overrides(text_corpus, steps=40) + [
        "train.precision=bf16", "train.log_every=10", "train.eval_every=40", "optim.warmup_steps=0"])
    result = train(config, tmp_path / "run", progress=False)
    losses = train_losses(tmp_path / "run")
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.3
    assert torch.isfinite(torch.tensor([result.valid_loss, result.test_loss])).all()


def test_bf16_and_compile_flags_are_shorthands() -> None:
    args = build_parser().parse_args(["train", "--recipe", RECIPE, "--out", "x", "--bf16", "--compile"])
    assert _train_flags(args) == ["train.precision=bf16", "train.compile=true"]
    config = build_config(load_recipe(RECIPE), _train_flags(args))
    assert config.train.precision == "bf16" and config.train.compile is True
    plain = build_parser().parse_args(["train", "--recipe", RECIPE, "--out", "x"])
    assert _train_flags(plain) == []
