"""The trainer: same seed same numbers, exact resume, safe checkpoints, gates seen while training."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides
from safetensors.torch import load_file

from gatedformer.config import RunConfig, apply_overrides, validate
from gatedformer.errors import CheckpointError, ConfigError
from gatedformer.runs import load_trained
from gatedformer.tasks import lm as lm_task
from gatedformer.train.checkpoint import META_CHECKSUM_KEY, latest_checkpoint, load_checkpoint, meta_checksum
from gatedformer.train.loop import NonFiniteLoss, train
from gatedformer.train.optim import lr_factor
from gatedformer.train.runlog import read_log, series


def config_for(corpus: str, *extra: str, steps: int = 12) -> RunConfig:
    return validate(apply_overrides(RunConfig(), tiny_overrides(corpus, steps) + list(extra)))


def train_losses(run_dir: Path) -> list[float]:
    return series(read_log(run_dir), "train", "train_loss")[1]


def test_same_seed_same_numbers(text_corpus: str, tmp_path: Path) -> None:
    a = train(config_for(text_corpus, "model.gates=+σ SDU"), tmp_path / "a", progress=False)
    b = train(config_for(text_corpus, "model.gates=+σ SDU"), tmp_path / "b", progress=False)
    assert train_losses(tmp_path / "a") == train_losses(tmp_path / "b")
    assert (a.valid_loss, a.test_loss) == (b.valid_loss, b.test_loss)
    c = train(config_for(text_corpus, "model.gates=+σ SDU", "train.seed=1"), tmp_path / "c", progress=False)
    assert c.test_loss != a.test_loss


@pytest.mark.parametrize("stop", [3, 4, 9])
def test_resume_is_bit_exact(text_corpus: str, tmp_path: Path, stop: int) -> None:
    extra = ("model.gates=+tanh L2", "model.dropout=0.2", "optim.clip=0.5")
    whole = train(config_for(text_corpus, *extra), tmp_path / "whole", progress=False)
    assert train(config_for(text_corpus, *extra), tmp_path / "split", progress=False, stop_after=stop) is None
    assert latest_checkpoint(tmp_path / "split").name == f"step-{stop:08d}"
    resumed = train(config_for(text_corpus, *extra), tmp_path / "split", progress=False, resume=True)
    assert train_losses(tmp_path / "split") == train_losses(tmp_path / "whole")
    assert len(train_losses(tmp_path / "whole")) == 12
    assert (resumed.valid_loss, resumed.test_loss) == (whole.valid_loss, whole.test_loss)
    final_a = load_file(str(tmp_path / "whole" / "model.safetensors"))
    final_b = load_file(str(tmp_path / "split" / "model.safetensors"))
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_run_dir_is_never_overwritten(text_corpus: str, tmp_path: Path) -> None:
    train(config_for(text_corpus), tmp_path / "run", progress=False)
    with pytest.raises(ConfigError, match="already holds a finished run"):
        train(config_for(text_corpus), tmp_path / "run", progress=False)
    train(config_for(text_corpus), tmp_path / "half", progress=False, stop_after=4)
    with pytest.raises(ConfigError, match="pass --resume"):
        train(config_for(text_corpus), tmp_path / "half", progress=False)


def test_resume_with_another_config_names_the_fields(text_corpus: str, tmp_path: Path) -> None:
    train(config_for(text_corpus), tmp_path / "run", progress=False, stop_after=4)
    with pytest.raises(CheckpointError, match=r"model\.d_model \(16 saved, 32 now\)"):
        train(config_for(text_corpus, "model.d_model=32"), tmp_path / "run", progress=False, resume=True)


def test_truncated_checkpoint_is_refused(text_corpus: str, tmp_path: Path) -> None:
    train(config_for(text_corpus), tmp_path / "run", progress=False, stop_after=4)
    weights = latest_checkpoint(tmp_path / "run") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        train(config_for(text_corpus), tmp_path / "run", progress=False, resume=True)


def _damage_meta(key: str, value: object):
    def damage(checkpoint: Path) -> None:
        meta = json.loads((checkpoint / "meta.json").read_text())
        if value is None:
            del meta[key]
        else:
            meta[key] = value
        # Checksummed anew: each field's own check must hold where the meta's checksum does not tell (a meta written
        # with a wrong value; the checksum's own test is in test_reliability_runs.py).
        meta[META_CHECKSUM_KEY] = meta_checksum(meta)
        (checkpoint / "meta.json").write_text(json.dumps(meta))
    return damage


@pytest.mark.parametrize("damage, fragment", [
    (lambda c: (c / "trainer.pt").write_bytes(b""), r"trainer.pt is truncated or corrupt \("),
    (_damage_meta("step", None), "'step' is None, not a count"),
    (_damage_meta("step", "x"), "'step' is 'x', not a count"),
    (_damage_meta("tokens_seen", -3), "'tokens_seen' is -3, not a count"),
    (_damage_meta("loss_sum", None), r"is damaged \(KeyError: 'loss_sum'\)"),
    (_damage_meta("carry", {"kind": "nonsense"}), "does not describe its carried state"),
    (lambda c: torch.save({"scheduler": {}}, c / "trainer.pt"), "trainer.pt is damaged: no optimizer state"),
    # State that loads but does not fit, as a checkpoint without a recorded checksum could hold (with one, the
    # checksum already tells the file changed).
    (lambda c: (torch.save({"optimizer": {}, "scheduler": {}}, c / "trainer.pt"),
                _damage_meta("trainer_sha256", None)(c)), r"is damaged \("),
])
def test_a_damaged_checkpoint_is_one_clear_error(text_corpus: str, tmp_path: Path, damage, fragment: str) -> None:
    train(config_for(text_corpus), tmp_path / "run", progress=False, stop_after=4)
    damage(latest_checkpoint(tmp_path / "run"))
    with pytest.raises(CheckpointError, match=fragment) as raised:
        train(config_for(text_corpus), tmp_path / "run", progress=False, resume=True)
    assert "\n" not in str(raised.value) and ("delete" in str(raised.value) or "resume from" in str(raised.value))


def test_a_lost_latest_pointer_resumes_from_the_newest_complete_checkpoint(text_corpus: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(config_for(text_corpus), run, progress=False, stop_after=8)
    kept = latest_checkpoint(run)
    (run / "ckpt" / "LATEST").unlink()
    (run / "ckpt" / ".step-00000009.partial").mkdir()  # a write the crash cut short is no checkpoint
    assert latest_checkpoint(run) == kept
    resumed = train(config_for(text_corpus), run, progress=False, resume=True)
    reference = train(config_for(text_corpus), tmp_path / "reference", progress=False)
    assert resumed is not None and reference is not None and resumed.test_loss == reference.test_loss
    (run / "log.jsonl").write_bytes((run / "log.jsonl").read_bytes() + b"\xff\xfe not text\n")
    assert len(read_log(run)) > 0


def test_a_latest_pointer_that_is_a_folder_is_one_clear_error(text_corpus: str, tmp_path: Path) -> None:
    train(config_for(text_corpus), tmp_path / "run", progress=False, stop_after=4)
    pointer = tmp_path / "run" / "ckpt" / "LATEST"
    pointer.unlink()
    pointer.mkdir()
    with pytest.raises(CheckpointError, match="LATEST cannot be read .*; delete it and resume"):
        train(config_for(text_corpus), tmp_path / "run", progress=False, resume=True)


def test_a_full_disk_while_checkpointing_is_one_line_and_keeps_the_last_checkpoint(
        text_corpus: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors import SafetensorError

    from gatedformer.errors import OutputError
    from gatedformer.train import checkpoint

    run = tmp_path / "run"
    train(config_for(text_corpus), run, progress=False, stop_after=4)
    kept = latest_checkpoint(run)
    save_file = checkpoint.save_file

    def full_after_the_first(tensors, path, metadata=None):
        if "step-00000004" not in str(path):
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                                  "message: \"No space left on device\" })")
        save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(checkpoint, "save_file", full_after_the_first)
    with pytest.raises(OutputError, match=r"cannot write .*step-00000008 \(Error while serializing.*No space left"):
        train(config_for(text_corpus), run, progress=False, resume=True)
    assert latest_checkpoint(run) == kept and not list((run / "ckpt").glob(".*partial"))
    monkeypatch.undo()
    assert train(config_for(text_corpus), run, progress=False, resume=True) is not None


def test_a_signal_while_the_finished_run_is_scored_stops_and_resume_scores_it(
        text_corpus: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import signal

    from gatedformer.train import loop
    from gatedformer.train.loop import TrainingInterrupted

    save = loop.save_model_weights

    def terminated_while_saving(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # as `kill PID` during the test evaluation or the final writes
        save(*args, **kwargs)

    monkeypatch.setattr(loop, "save_model_weights", terminated_while_saving)
    run = tmp_path / "run"
    with pytest.raises(TrainingInterrupted, match=r"stopped by signal 15 at step 12; checkpoint saved"):
        train(config_for(text_corpus), run, progress=False)
    assert not (run / "results.json").exists() and latest_checkpoint(run).name == "step-00000012"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are given back
    monkeypatch.undo()
    resumed = train(config_for(text_corpus), run, progress=False, resume=True)
    reference = train(config_for(text_corpus), tmp_path / "reference", progress=False)
    assert resumed is not None and reference is not None and resumed.test_loss == reference.test_loss


class _Exploit:
    def __reduce__(self):
        return (print, ("this ran code",))


def test_pickled_code_in_trainer_state_is_refused(text_corpus: str, tmp_path: Path) -> None:
    train(config_for(text_corpus), tmp_path / "run", progress=False, stop_after=4)
    trainer_file = latest_checkpoint(tmp_path / "run") / "trainer.pt"
    torch.save({"optimizer": _Exploit()}, trainer_file, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(CheckpointError, match="refused to load"):
        load_checkpoint(latest_checkpoint(tmp_path / "run"))


def test_a_crash_during_a_checkpoint_write_keeps_the_previous_one(text_corpus: str, tmp_path: Path) -> None:
    train(config_for(text_corpus), tmp_path / "run", progress=False, stop_after=4)
    ckpt_root = tmp_path / "run" / "ckpt"
    # What a process killed mid-write leaves behind: a partial folder the pointer does not name.
    partial = ckpt_root / ".step-00000008.partial"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\x00\x01")
    assert latest_checkpoint(tmp_path / "run").name == "step-00000004"
    result = train(config_for(text_corpus), tmp_path / "run", progress=False, resume=True)
    assert result is not None and not partial.exists()


def test_gate_statistics_and_biases_are_recorded(text_corpus: str, tmp_path: Path) -> None:
    train(config_for(text_corpus, "model.gates=+σ SDU + EAU"), tmp_path / "run", progress=False)
    evals = [r for r in read_log(tmp_path / "run") if r["event"] == "eval"]
    assert len(evals) == 3
    gates = evals[-1]["gates"]
    assert set(gates) == {f"layers.{i}.{s}.sdu" for i in (0, 1) for s in ("attn", "ffn")} | {
        f"layers.{i}.attn.eau" for i in (0, 1)}
    for name, stat in gates.items():
        assert 0.0 < stat["mean"] < 1.0 and stat["std"] >= 0.0, name
    biases = load_file(str(tmp_path / "run" / "gate_biases.safetensors"))
    assert set(biases) == set(gates)
    assert all(b.shape == (16,) for b in biases.values())
    assert any(b.abs().sum() > 0 for b in biases.values())  # trained away from their zero start


def test_log_records_every_evaluation_point(text_corpus: str, tmp_path: Path) -> None:
    result = train(config_for(text_corpus), tmp_path / "run", progress=False)
    evals = [r for r in read_log(tmp_path / "run") if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [4, 8, 12]
    for record in evals:
        assert {"tokens", "time", "tokens_per_s", "valid_loss", "valid_bpc"} <= set(record)
        assert record["valid_bpc"] == pytest.approx(record["valid_loss"] / 0.6931471805599453)
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["test_metric"] == pytest.approx(result.test_loss / 0.6931471805599453)
    assert saved["steps"] == 12 and saved["params"] > 0


def test_loss_goes_down(text_corpus: str, tmp_path: Path) -> None:
    train(config_for(text_corpus, "train.log_every=10", steps=60), tmp_path / "run", progress=False)
    losses = train_losses(tmp_path / "run")
    assert losses[-1] < losses[0] - 0.5


def test_nonfinite_loss_stops_with_the_step_named(text_corpus: str, tmp_path: Path) -> None:
    with pytest.raises(NonFiniteLoss, match=r"non-finite loss or gradient at step \d+"):
        train(config_for(text_corpus, "optim.lr=1e30", "optim.name=sgd", steps=40), tmp_path / "run",
              progress=False)


def test_a_diverged_run_goes_on_from_its_last_good_checkpoint_with_what_the_error_names(
        text_corpus: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:

    build_model = lm_task.build_model

    def diverging(config, vocab_size):  # from the 7th training forward on, the loss is NaN
        model = build_model(config, vocab_size)
        forward, calls = model.forward, []

        def nan_forward(x, state=None, **kwargs):
            out = forward(x, state, **kwargs)
            calls.append(model.training)
            if sum(calls) >= 7:
                out.loss = out.loss * float("nan")
            return out

        model.forward = nan_forward
        return model

    settings = ("optim.schedule=constant", "train.eval_every=2")
    run = tmp_path / "run"
    monkeypatch.setattr(lm_task, "build_model", diverging)
    with pytest.raises(NonFiniteLoss, match=r"at step 7 \(loss nan\); the last good checkpoint \(step-00000006\) is "
                                            r"kept: continue from it with --resume and a lower optim.lr, optim.clip "
                                            r"set, or train.nonfinite=skip"):
        train(config_for(text_corpus, *settings), run, progress=False)
    monkeypatch.undo()
    # Each way out the message names is accepted on --resume; the schedule goes on from the lower rate.
    result = train(config_for(text_corpus, *settings, "optim.lr=0.004", "optim.clip=0.5", "train.nonfinite=skip"),
                   run, resume=True, progress=False)
    assert result is not None and math.isfinite(result.test_loss)
    rates = {r["step"]: r["lr"] for r in read_log(run) if r["event"] == "train"}
    assert rates[6] == pytest.approx(0.01) and all(rates[s] == pytest.approx(0.004) for s in range(7, 13))


def test_a_run_that_diverges_before_any_checkpoint_says_so(text_corpus: str, tmp_path: Path) -> None:
    with pytest.raises(NonFiniteLoss, match="no checkpoint was written before it: train again with a lower optim.lr"):
        train(config_for(text_corpus, "optim.lr=1e30", "optim.name=sgd", "train.eval_every=40", steps=40),
              tmp_path / "run", progress=False)
    assert latest_checkpoint(tmp_path / "run") is None


def test_nonfinite_steps_can_be_skipped(text_corpus: str, tmp_path: Path) -> None:
    result = train(config_for(text_corpus, "optim.lr=1e30", "optim.name=sgd", "train.nonfinite=skip", steps=8),
                   tmp_path / "run", progress=False)
    assert result is not None
    assert any(r.get("skipped_steps") for r in read_log(tmp_path / "run"))


def test_load_trained_round_trip(text_corpus: str, tmp_path: Path) -> None:
    train(config_for(text_corpus, "model.gates=+highway gate"), tmp_path / "run", progress=False)
    run = load_trained(tmp_path / "run", device="cpu")
    assert run.config.model.gates == "+highway gate" and run.task.name == "lm"
    assert run.model.layers[0].attn.highway is not None and not run.model.training
    assert len(run.data.vocab) == run.model.output.out_features


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine", "noam"])
def test_schedules(schedule: str) -> None:
    cfg = apply_overrides(RunConfig(), [f"optim.schedule={schedule}", "optim.warmup_steps=10",
                                        "optim.min_lr_ratio=0.1"]).optim
    factors = [lr_factor(s, 100, cfg) for s in range(100)]
    assert factors[0] == pytest.approx(0.1)
    assert max(factors) == pytest.approx(1.0)
    assert factors[9] == pytest.approx(1.0)
    if schedule in ("linear", "cosine"):
        assert factors[-1] == pytest.approx(0.1, abs=0.02)
        assert all(a >= b for a, b in zip(factors[10:], factors[11:], strict=False))
    if schedule == "noam":
        assert factors[-1] == pytest.approx((10 / 100) ** 0.5)


def test_compiled_training_follows_eager_training(text_corpus: str, tmp_path: Path) -> None:
    # Under torch.compile dropout and attention run as PyTorch operations (Inductor traces those, not the
    # compiled C++ kernels); without dropout the two runs must agree up to floating-point reordering.
    extra = ("model.dropout=0.0", "model.gates=+σ SDU")
    eager = train(config_for(text_corpus, *extra, steps=4), tmp_path / "eager", progress=False)
    compiled = train(config_for(text_corpus, *extra, "train.compile=true", steps=4), tmp_path / "compiled",
                     progress=False)
    assert train_losses(tmp_path / "compiled") == pytest.approx(train_losses(tmp_path / "eager"), rel=1e-4)
    assert compiled.test_loss == pytest.approx(eager.test_loss, rel=1e-4)


def _drop_checksum(path: Path) -> None:
    """Rewrite a weights file with the same tensors and config but no recorded checksum."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as handle:
        metadata = {k: v for k, v in handle.metadata().items() if k != "weights_sha256"}
    save_file(load_file(str(path)), str(path), metadata=metadata)


def test_weights_without_their_checksum_are_refused_by_eval_and_resume(text_corpus: str, tmp_path: Path) -> None:
    from gatedformer.runs import evaluate_run

    train(config_for(text_corpus), tmp_path / "whole", progress=False)
    _drop_checksum(tmp_path / "whole" / "model.safetensors")
    with pytest.raises(CheckpointError, match="records no checksum") as refused:
        evaluate_run(tmp_path / "whole", "test", device="cpu")
    assert "\n" not in str(refused.value)
    assert train(config_for(text_corpus), tmp_path / "split", progress=False, stop_after=4) is None
    _drop_checksum(latest_checkpoint(tmp_path / "split") / "model.safetensors")
    with pytest.raises(CheckpointError, match="records no checksum"):
        train(config_for(text_corpus), tmp_path / "split", progress=False, resume=True)
