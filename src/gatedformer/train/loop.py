"""The training loop: one readable function from config to results, for every task.

``train(config, out_dir)`` asks the run's task (:mod:`gatedformer.tasks`) for its data and model, trains for
``train.steps`` steps with evaluation and checkpoints every ``train.eval_every`` steps, and finally has the task
score the whole valid and test splits. Everything it writes into ``out_dir`` is written atomically, and
``resume=True`` continues bit for bit where a stopped run left off. The loop owns what every task shares: the run
folder, checkpoints and exact resume, RNG states, data parallelism, signals, non-finite losses, the log,
TensorBoard and the progress bar; the task owns its data, model, loss, metric and evaluation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gatedformer.config import RunConfig, validate
from gatedformer.data.verify import FILES_KEY, files_checksums
from gatedformer.devices import check_precision, resolve_device
from gatedformer.errors import CheckpointError, ConfigError, GatedformerError
from gatedformer.io import atomic_write_json, atomic_write_text, make_folder, number, read_limited
from gatedformer.tasks import Task, task_for
from gatedformer.train import distributed
from gatedformer.train.checkpoint import (
    JSON_BYTES,
    check_architecture,
    check_slots,
    config_mismatch,
    latest_checkpoint,
    load_checkpoint,
    load_model_weights,
    recorded_run_config,
    restoring,
    save_checkpoint,
    save_model_weights,
    save_tensors_atomically,
    weights_metadata,
)
from gatedformer.train.clock import TrainingClock
from gatedformer.train.compiling import compile_model
from gatedformer.train.gate_stats import GateStatistics, gate_biases
from gatedformer.train.init import initialise
from gatedformer.train.loggers import check_loggers, open_loggers
from gatedformer.train.lossplot import write_loss_curve
from gatedformer.train.optim import build_optimizer, build_scheduler, clip_gradients, follow_changed_lr
from gatedformer.train.progress import progress_bar
from gatedformer.train.rundir import claim_run_folder, release_run_folder
from gatedformer.train.runlog import log_records

# Fields that may change between a run and its resumption without changing what is computed.
RESUMABLE_CHANGES = {"train.steps", "train.eval_every", "train.log_every", "train.device", "train.threads",
                     "train.eval_windows", "data.eval_batch_size", "data.eval_seq_len", "train.tensorboard",
                     "train.wandb", "train.wandb_project",
                     # the ways out of a non-finite loss, from the last good checkpoint
                     "train.nonfinite", "optim.lr", "optim.clip"}
"""Fields ``--resume`` may change: how long, how often and where the run goes on, and how it steps."""
FINISHED_RUN_CHANGES = {"train.device", "train.threads", "train.log_every", "train.tensorboard", "train.compile",
                        "train.wandb", "train.wandb_project"}
"""Fields a finished run may differ in and still be the same experiment: where and how fast it ran, how often it
logged. ``compare`` keeps such a run rather than training it again."""


@dataclass
class RunResult:
    """Final numbers of a finished run (also written to ``results.json``)."""

    run_dir: str
    corpus: str
    metric: str
    valid_loss: float
    valid_metric: float
    test_loss: float
    test_metric: float
    params: int
    steps: int
    seconds_per_step: float
    """The mean training step after the first of each start (see :class:`~gatedformer.train.clock.TrainingClock`)."""
    train_seconds: float
    """Those steps' time: forward, backward and optimiser, no evaluation."""
    tokens_per_second: float
    setup_seconds: float = 0.0
    """The first step of each start: kernels built on first use, compilation, allocator warm-up."""
    wall_seconds: float = 0.0
    """The whole run, evaluations and checkpoints included (0 in results from before it was kept)."""
    steps_per_epoch: int = 0
    """Training steps in one pass over the training split (0: not known)."""

    @classmethod
    def load(cls, run_dir: Path) -> RunResult:
        """The results a finished run wrote; a damaged file is a :class:`CheckpointError` naming it and the fix."""
        path = Path(run_dir) / "results.json"
        try:
            data = json.loads(read_limited(path, JSON_BYTES))
            # Fields with a default came later: results written before them lack them. A float written as null had
            # no finite value (a GLUE test loss: the labels are not public).
            return cls(**{f.name: number(data[f.name]) if f.type == "float" else data[f.name]
                          for f in dataclasses.fields(cls) if f.name in data or f.default is dataclasses.MISSING})
        except (OSError, ValueError, KeyError, TypeError) as err:
            reason = f"missing {err}" if isinstance(err, KeyError) else type(err).__name__
            raise CheckpointError(f"{path} is damaged ({reason}); delete {Path(run_dir)} to train that run "
                                  "again") from None


def detach_state(state: Any) -> Any:
    """Stop gradients at the window boundary for whatever a model carries between windows."""
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return state.detach()
    return type(state)(detach_state(item) for item in state)


def _state_to(state: Any, device: torch.device) -> Any:
    if state is None:
        return None
    if isinstance(state, torch.Tensor):
        return state.to(device)
    return type(state)(_state_to(item, device) for item in state)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


class _Abandoned(BaseException):
    """A stop signal cut short work that a resumed run redoes (an evaluation). A ``BaseException``, like
    ``KeyboardInterrupt``, so that no ``except Exception`` on the way swallows it."""


class _StopSignal:
    """Turns SIGINT/SIGTERM into a flag the loop checks, so it can checkpoint before leaving.

    With ``interrupt=(step, out_dir)`` (the checkpoint of ``step`` already written) a signal raises
    :class:`TrainingInterrupted` at once instead. Inside :meth:`abandonable` a signal (or one received before it)
    raises :class:`_Abandoned` at once: an evaluation of the whole split may take many minutes, longer than a
    scheduler waits between its stop signal and its SIGKILL.
    """

    def __init__(self, interrupt: tuple[int, Path] | None = None) -> None:
        self.received: int | None = None
        self._interrupt = interrupt
        self._abandon = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignal:
        for sig in (signal.SIGINT, signal.SIGTERM):
            # Outside the main thread signals cannot be caught; leave them alone there.
            with contextlib.suppress(ValueError):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signum
        if self._interrupt is not None:
            raise TrainingInterrupted(signum, *self._interrupt)
        if self._abandon:
            self._abandon = False
            raise _Abandoned()

    @contextlib.contextmanager
    def abandonable(self) -> Iterator[None]:
        """Work a stop signal ends at once (raising :class:`_Abandoned`), to be redone by a resumed run."""
        if self.received is not None:
            raise _Abandoned()
        self._abandon = True
        try:
            yield
        finally:
            self._abandon = False

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class TrainingInterrupted(GatedformerError):
    """Raised after a SIGINT/SIGTERM once the checkpoint is written. Its exit status is the shell's for a process a
    signal ended, 128 + the signal (130 for SIGINT, 143 for SIGTERM; 143 for a signal another rank received)."""

    def __init__(self, signal: int | str, step: int, out_dir: Path) -> None:
        super().__init__(f"stopped by signal {signal} at step {step}; checkpoint saved — "
                         f"continue with --resume --out {out_dir}")
        self.signal, self.step, self.out_dir = signal, step, out_dir
        self.exit_code = 128 + (int(signal) if isinstance(signal, int) else 15)


class NonFiniteLoss(GatedformerError):
    """The loss or the gradients stopped being finite."""

    exit_code = 3


class EvaluationFailed(GatedformerError):
    """An evaluation during training failed on a user error (a missing file, module or setting): the error's own
    line, with where the steps trained before it are kept. Its exit status is the error's."""

    def __init__(self, error: GatedformerError, step: int, out_dir: Path) -> None:
        super().__init__(f"{error} (the evaluation at step {step} failed; the {step} steps before it are kept in a "
                         f"checkpoint: once that is fixed, continue with --resume --out {out_dir})")
        self.exit_code = error.exit_code


def _diverged(step: int, out_dir: Path, valid_loss: float) -> NonFiniteLoss:
    """The run stopped at the evaluation of ``step``, whose validation loss was not finite."""
    kept = latest_checkpoint(out_dir) if out_dir.exists() else None
    fixes = "a lower optim.lr or optim.clip set"
    return NonFiniteLoss(
        f"the validation loss at step {step} is {valid_loss} (the model diverged, even where the training loss "
        "stayed finite); " + (f"the last checkpoint of a finite validation loss ({kept.name}) is kept: continue from "
                              f"it with --resume and {fixes}" if kept is not None
                              else f"no checkpoint was written before it: train again with {fixes}"))


def stop_here(step: int, final: bool, signal: int | str | None, stop_after: int | None, out_dir: Path,
              checkpoint_now: Callable[[], None], bar: Any) -> bool:
    """After optimisation step ``step``: on a stop ``signal``, checkpoint and raise :class:`TrainingInterrupted`;
    at ``stop_after`` (before the last step), checkpoint and return True so the loop ends without results."""
    if signal is not None:
        checkpoint_now()
        bar.close()
        raise TrainingInterrupted(signal, step, out_dir)
    if stop_after is not None and step >= stop_after and not final:
        checkpoint_now()
        bar.close()
        return True
    return False


def optimise(loss: torch.Tensor, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             config: RunConfig, step: int, out_dir: Path,
             loss_value: Callable[[torch.Tensor], float] = lambda loss: loss.item(),
             accumulated: torch.Tensor | None = None,
             scaler: torch.amp.GradScaler | None = None) -> tuple[float, bool]:
    """The update of training step ``step + 1`` from its ``loss``: backward, gradient clipping
    (``optim.clip``), the optimiser and scheduler steps. Returns ``loss_value(loss)`` (the loss the log
    records; e.g. its mean over ranks) and whether the weights were updated. A non-finite loss or gradient
    raises :class:`NonFiniteLoss`, or with ``train.nonfinite=skip`` drops the gradients and leaves the weights
    as they are.

    With gradient accumulation (``train.grad_accum``), ``loss`` is the last micro-batch's, already weighted, and
    ``accumulated`` the (detached) weighted sum of the earlier ones', whose gradients the parameters hold: this backward
    adds to them, and the loss recorded is the whole step's.

    With an enabled gradient ``scaler`` (``train.precision=fp16``) the backward pass runs on the scaled loss and the
    gradients are unscaled before clipping; gradients that overflowed float16 skip the update and lower the scale
    (the scaler's business, not an error), a non-finite loss is one as above."""
    scaling = scaler is not None and scaler.is_enabled()
    if accumulated is None:
        optimizer.zero_grad(set_to_none=True)
    (scaler.scale(loss) if scaling else loss).backward()
    if accumulated is not None:
        loss = loss.detach() + accumulated
    if scaling:
        scaler.unscale_(optimizer)
    clip = config.optim.clip if config.optim.clip > 0 else float("inf")
    grad_norm = clip_gradients(model, optimizer, clip)
    value = loss_value(loss)
    stepped = math.isfinite(value) and math.isfinite(grad_norm.item())
    if scaling:
        if math.isfinite(value):
            scaler.step(optimizer)  # skipped where the unscaled gradients hold an inf or a NaN
        scaler.update()
        if math.isfinite(value):
            scheduler.step()
            return value, stepped
    if stepped:
        optimizer.step()
    elif config.train.nonfinite == "stop":
        fixes = "a lower optim.lr, optim.clip set, or train.nonfinite=skip"
        kept = latest_checkpoint(out_dir) if out_dir.exists() else None
        raise NonFiniteLoss(
            f"non-finite loss or gradient at step {step + 1} (loss {value}); "
            + (f"the last good checkpoint ({kept.name}) is kept: continue from it with --resume and {fixes}"
               if kept is not None else f"no checkpoint was written before it: train again with {fixes}")
        )
    else:
        optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return value, stepped


def prepare_run_dir(out_dir: Path, config: RunConfig, resume: bool) -> Path | None:
    """Check that ``out_dir`` may receive this run; return the checkpoint to resume from, if any."""
    out_dir = Path(out_dir)
    if (out_dir / "results.json").is_file():
        raise ConfigError(f"{out_dir} already holds a finished run; choose another --out or delete it")
    check_slots(out_dir)  # a link or file where a later checkpoint goes: refused now, not at that checkpoint
    checkpoint = latest_checkpoint(out_dir) if out_dir.exists() else None
    if checkpoint is not None and not resume:
        raise ConfigError(f"{out_dir} holds an unfinished run; pass --resume to continue it or choose another --out")
    if checkpoint is not None:
        # Without config.json (deleted, say) the checkpoint's recorded config stands in, so a changed field is
        # refused all the same rather than recorded as if the run had been trained with it.
        differences = saved_config_differences(out_dir, config, RESUMABLE_CHANGES)
        if differences:
            raise CheckpointError(
                f"cannot resume {out_dir}: the config differs from the saved one in "
                f"{'; '.join(differences[:5])}; resume with the same recipe and --set values"
            )
    return checkpoint


def saved_config_differences(run_dir: Path, config: RunConfig, ignore: set[str]) -> list[str]:
    """The fields (outside ``ignore``) in which ``config`` differs from the one ``run_dir`` was started with,
    each as ``section.field (saved, now)``. Where ``config.json`` is damaged or missing, the config the run's weights
    record (final or checkpoint) stands in for it; without such a record it is a :class:`CheckpointError`."""
    path = Path(run_dir) / "config.json"
    try:
        saved = json.loads(read_limited(path, JSON_BYTES))
    except (OSError, ValueError) as err:
        saved, reason = None, (err.strerror if isinstance(err, OSError) and err.strerror else str(err)[:80]
                               or type(err).__name__)
    else:
        reason = "not a config"
    if not isinstance(saved, dict) or not all(isinstance(section, dict) for section in saved.values()):
        recorded = recorded_run_config(Path(run_dir))
        if recorded is None or not all(isinstance(section, dict) for section in recorded[0].values()):
            raise CheckpointError(f"{path} is missing or damaged ({reason}) and no weights of the run record its "
                                  f"config; restore it from a copy of the run, or delete {Path(run_dir)} to train "
                                  "that run again")
        saved = recorded[0]
    return config_mismatch(saved, config.to_dict(), ignore)


def train(config: RunConfig, out_dir: str | Path, data_dir: str | Path | None = None, resume: bool = False,
          progress: bool = True, stop_after: int | None = None, shared: Any = None,
          on_record: Callable[[dict[str, Any]], None] | None = None) -> RunResult | None:
    """Train ``config`` into ``out_dir``; return the final results, or ``None`` if ``stop_after``
    ended the run early (it can then be resumed). ``shared`` is data runs on the same corpus share (see
    :meth:`gatedformer.tasks.base.Task.shared_data`); ``on_record`` sees every log record as it is written."""
    validate(config)
    task = task_for(config)
    check_loggers(config)  # fail before any work, not after it
    task.check_modules(config)  # an optional module its evaluation needs: missing now, not after hours of steps
    # One process trains a run folder: rank 0 (or the only process) holds its lock until the run returns or dies.
    created = not Path(out_dir).exists()
    lock = claim_run_folder(out_dir) if distributed.is_main_process() else None
    try:
        return _train(config, task, Path(out_dir), data_dir, resume, progress, stop_after, shared, on_record)
    finally:
        if lock is not None:
            release_run_folder(lock, created)


def _train(config: RunConfig, task: Task, out_dir: Path, data_dir: str | Path | None, resume: bool, progress: bool,
           stop_after: int | None, shared: Any, on_record: Callable[[dict[str, Any]], None] | None
           ) -> RunResult | None:
    """:func:`train`, in a run folder this process holds."""
    checkpoint_path = prepare_run_dir(out_dir, config, resume)
    tcfg = config.train
    if tcfg.threads:
        torch.set_num_threads(tcfg.threads)
    # Under torchrun: join the process group; each rank trains on its share of every batch.
    ddp = distributed.setup(config.data.batch_size, resolve_device(tcfg.device, "train.device"))
    if ddp.enabled and not task.supports_ddp:
        raise ConfigError(f"the {task.name} task trains in one process; run it without torchrun (or with "
                          "--nproc_per_node 1)")
    device = ddp.device
    check_precision(device, tcfg.precision)
    # fp16 scales the loss so that small gradients survive float16; the scale goes on from checkpoint to checkpoint.
    scaler = torch.amp.GradScaler(device.type, enabled=tcfg.precision == "fp16")

    data = task.load_data(config, data_dir, (ddp.rank, ddp.world), progress and ddp.is_main, shared)
    metric = task.metric(data)
    torch.manual_seed(tcfg.seed)
    model = task.build_model(config, data)
    initialise(model, config.init)
    if checkpoint_path is None:  # a resumed run has its weights in the checkpoint
        task.start_weights(model, config, data)
    distributed.seed_rank(ddp, tcfg.seed)  # every rank starts equal; dropout masks then differ per rank
    model.to(device)
    params = count_parameters(model)
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, tcfg.steps, config.model.d_model)

    make_folder(out_dir, "run folder")
    files_sha256: dict[str, str] = {}
    if ddp.is_main:
        atomic_write_json(out_dir / "config.json", config.to_dict())
        run_files = task.run_files(data)
        for name, content in run_files.items():
            (atomic_write_text if isinstance(content, str) else atomic_write_json)(out_dir / name, content)
        files_sha256 = files_checksums(out_dir, run_files)  # recorded with the weights, checked when they load
        task.open_run(data, out_dir, checkpoint_path is not None)
    log_path = out_dir / "log.jsonl"
    step, tokens_seen, carry, meta = 0, 0, None, None
    evaluation_pending = False  # the checkpoint's step was to be evaluated when a stop signal came
    clock = TrainingClock()
    loss_sum, loss_count, skipped = 0.0, 0, 0
    if checkpoint_path is not None:
        ckpt = load_checkpoint(checkpoint_path)
        check_architecture(ckpt.meta.get("config"), config.to_dict(), str(checkpoint_path))
        load_model_weights(model, ckpt.model_state, str(checkpoint_path))
        with restoring(checkpoint_path):
            optimizer.load_state_dict(ckpt.trainer_state["optimizer"])
            scheduler.load_state_dict(ckpt.trainer_state["scheduler"])
            if scaler.is_enabled():
                scaler.load_state_dict(ckpt.trainer_state["scaler"])
            follow_changed_lr(optimizer, scheduler, config.optim.lr)
            meta = ckpt.meta
            step, tokens_seen = meta["step"], meta["tokens_seen"]
            clock = TrainingClock(meta, step, tokens_seen)
            loss_sum, loss_count, skipped = meta["loss_sum"], meta["loss_count"], meta.get("skipped", 0)
            # This rank's RNG states and carried state (each rank saved its own).
            carry = _state_to(distributed.restore_rank_state(ddp, ckpt.trainer_state, meta, ckpt.carry, tcfg.seed),
                              device)
            # Where the data stood comes from the meta too: take the first batch here, so a damaged position is
            # one error now rather than a traceback from the generator later.
            batches = task.train_batches(data, config, step * tcfg.grad_accum, meta)  # micro-batches so far
            batches = itertools.chain([next(batches)], batches)
            steps_per_epoch = -(-task.steps_per_epoch(data, config, meta) // tcfg.grad_accum)
            evaluation_pending = meta.get("evaluation_pending") is True
        if ddp.is_main:
            _truncate_log(log_path, step, drop_evaluation=evaluation_pending)
    else:
        batches = task.train_batches(data, config, 0, meta)
        steps_per_epoch = -(-task.steps_per_epoch(data, config, meta) // tcfg.grad_accum)
        if ddp.is_main:
            log_path.unlink(missing_ok=True)

    net = distributed.wrap(model, ddp)  # DistributedDataParallel when torchrun started several processes
    compiled = compile_model(net) if tcfg.compile else net
    stats = GateStatistics(model)
    position: dict[str, int] = {}  # where the data stands, as the task says it (saved in the checkpoint's meta)

    def checkpoint_now(evaluation_pending: bool = False) -> None:  # every rank calls it; rank 0 writes
        ranks = distributed.gather_rank_states(ddp, carry)
        if ddp.is_main:
            trainer_state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                             **distributed.rng_state(device)}
            if scaler.is_enabled():
                trainer_state["scaler"] = scaler.state_dict()
            meta = {**position, "tokens_seen": tokens_seen, **clock.state(), "loss_sum": loss_sum,
                    "loss_count": loss_count, "skipped": skipped, "config": config.to_dict(), FILES_KEY: files_sha256}
            if evaluation_pending:  # a stop signal cut the evaluation of this step short: --resume redoes it
                meta["evaluation_pending"] = True
            trainer_state, saved_carry, extra = distributed.checkpoint_parts(ddp, trainer_state, carry, ranks)
            save_checkpoint(out_dir, step, model, trainer_state, {**meta, **extra}, saved_carry)
        distributed.barrier(ddp)  # no rank leaves before the checkpoint is complete

    # log.jsonl, TensorBoard, W&B and the caller's on_record, through one interface (train/loggers.py)
    loggers = open_loggers(config, out_dir, log_path, on_record) if ddp.is_main else []

    def log(record: dict[str, Any]) -> None:
        for logger in loggers:
            logger.record(record)

    def log_evaluation(fields: dict[str, Any]) -> None:  # rank 0 alone
        log({"event": "eval", "step": step, "tokens": tokens_seen, "time": clock.step_seconds,
             "tokens_per_s": clock.tokens_per_second, **fields, "gates": stats.summary()})

    def observe(fields: dict[str, Any] | None, abandoned: bool = False) -> None:  # every rank, after an evaluation
        """Rank 0's validation loss to the schedule on every rank (``optim.schedule=plateau`` anneals on it)."""
        if config.optim.schedule != "plateau":
            return
        loss, cut_short = distributed.broadcast_floats(
            ddp, [fields["valid_loss"] if fields is not None else math.nan, 1.0 if abandoned else 0.0])
        if not cut_short:  # an evaluation a stop signal cut short is done, and observed, on resume
            scheduler.observe(loss)

    if checkpoint_path is None:
        for record in task.start_records(data, params):
            log(record)
    final_eval: dict[str, Any] | None = None
    if evaluation_pending and ddp.is_main:
        # The evaluation a stop signal cut short, before anything else; the checkpoint of this step is on disk, so
        # another signal stops at once.
        with _StopSignal(interrupt=(step, out_dir)):
            fields = task.evaluate(model, data, config, device, step >= tcfg.steps, stats.recording)
        log_evaluation(fields)
        final_eval = fields if step >= tcfg.steps else None
        model.train()
    if evaluation_pending:
        observe(fields if ddp.is_main else None)
    bar = _progress_bar(progress and ddp.is_main, tcfg.steps, step, out_dir.name)
    model.train()
    with _StopSignal() as stop_signal:
        while step < tcfg.steps:
            started = time.perf_counter()
            micro = [next(batches) for _ in range(tcfg.grad_accum)]  # a step's micro-batches (one, by default)
            step_tokens = sum(batch.tokens for batch in micro)
            accumulated = None
            if len(micro) > 1:
                optimizer.zero_grad(set_to_none=True)  # optimise() clears them only without accumulation
            for index, batch in enumerate(micro):
                if batch.new_epoch:
                    carry = None  # a new epoch starts from a fresh state
                last = index == len(micro) - 1
                # Gradients add up over the micro-batches (synchronised across ranks once, with the last): each
                # loss, a mean over its tokens, weighs by its share of the step's tokens.
                with contextlib.nullcontext() if last or not ddp.enabled else net.no_sync():
                    loss, new_carry = task.loss(compiled, batch, carry, config, device)
                    if len(micro) > 1:
                        loss = loss * (batch.tokens / max(step_tokens, 1))
                    if not last:
                        (scaler.scale(loss) if scaler.is_enabled() else loss).backward()
                        accumulated = loss.detach() if accumulated is None else accumulated + loss.detach()
                carry = detach_state(new_carry)
            # The log records the loss of the global batch: the mean over the ranks.
            loss_value, stepped = optimise(loss, model, optimizer, scheduler, config, step, out_dir,
                                           lambda loss: distributed.mean_over_ranks(ddp, loss), accumulated, scaler)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step += 1
            position = batch.position
            tokens_seen += step_tokens
            clock.add_step(time.perf_counter() - started, step_tokens)
            if not stepped:
                skipped += 1
            if math.isfinite(loss_value):
                loss_sum += loss_value
                loss_count += 1
            bar.update(1)

            if step % tcfg.log_every == 0:
                record = {"event": "train", "step": step, "lr": scheduler.get_last_lr()[0], "tokens": tokens_seen,
                          "time": clock.step_seconds, "tokens_per_s": clock.tokens_per_second,
                          **task.log_fields(position)}
                if loss_count:
                    record["train_loss"] = loss_sum / loss_count
                    bar.set_postfix(loss=f"{loss_sum / loss_count:.3f}")
                if skipped:
                    record["skipped_steps"] = skipped
                log(record)
                loss_sum, loss_count = 0.0, 0

            final = step == tcfg.steps
            if step % tcfg.eval_every == 0 or final:
                abandoned = False
                if ddp.is_main:  # rank 0 evaluates; the others wait in checkpoint_now
                    try:
                        # A stop signal ends the evaluation at once (a whole split can take many minutes); the
                        # checkpoint says so, and --resume evaluates this step again first.
                        with stop_signal.abandonable():
                            fields = task.evaluate(model, data, config, device, final, stats.recording)
                    except _Abandoned:
                        abandoned = True
                        model.train()
                    except Exception as err:
                        # The steps before it are sound: keep them, as a stop signal would, and --resume evaluates
                        # this step again first once the cause is fixed.
                        observe(None, abandoned=True)
                        checkpoint_now(evaluation_pending=True)
                        bar.close()
                        if isinstance(err, GatedformerError):
                            raise EvaluationFailed(err, step, out_dir) from None
                        raise
                    else:
                        log_evaluation(fields)
                        bar.set_postfix(valid=f"{fields[f'valid_{metric}']:.3f} {metric}")
                        final_eval = fields if final else None
                # train.nonfinite=skip rides through non-finite values, in validation as in training.
                diverged = distributed.any_rank(ddp, ddp.is_main and not abandoned and tcfg.nonfinite == "stop"
                                                and not math.isfinite(fields["valid_loss"]))
                if diverged:  # no checkpoint of these weights: the last one, of finite validation loss, stays
                    bar.close()
                    raise _diverged(step, out_dir, fields["valid_loss"] if ddp.is_main else math.nan)
                observe(fields if ddp.is_main and not abandoned else None, abandoned)
                checkpoint_now(evaluation_pending=abandoned)
            signal = (stop_signal.received or "on another rank") if distributed.any_rank(
                ddp, stop_signal.received is not None) else None
            if stop_here(step, final, signal, stop_after, out_dir, checkpoint_now, bar):
                for logger in loggers:
                    logger.close()
                return None
    bar.close()

    # The last checkpoint is on disk: a signal while the run is scored stops at once, and --resume scores it.
    with _StopSignal(interrupt=(step, out_dir)):
        if ddp.is_main:
            scores = task.score(model, data, config, device, out_dir, final_eval)
            save_model_weights(model, out_dir / "model.safetensors", weights_metadata(config.to_dict(), files_sha256))
            biases = gate_biases(model)
            if biases:
                save_tensors_atomically(biases, out_dir / "gate_biases.safetensors")
        else:
            scores = (math.nan,) * 4
        valid_loss, valid_metric, test_loss, test_metric = distributed.broadcast_floats(ddp, list(scores))
        result = RunResult(
            run_dir=str(out_dir), corpus=config.data.corpus, metric=metric, valid_loss=valid_loss,
            valid_metric=valid_metric, test_loss=test_loss, test_metric=test_metric, params=params, steps=step,
            seconds_per_step=clock.seconds_per_step(step), train_seconds=clock.step_seconds,
            tokens_per_second=clock.tokens_per_second, setup_seconds=clock.setup_seconds,
            wall_seconds=clock.wall_seconds, steps_per_epoch=steps_per_epoch,
        )
        log({"event": "test", "step": step, "test_loss": test_loss, f"test_{metric}": test_metric})
        if ddp.is_main:
            atomic_write_json(out_dir / "results.json", {**task.result_fields(data), **result.__dict__})
    if ddp.is_main:
        write_loss_curve(out_dir, metric)  # loss.png, from Python as from the command line (with matplotlib)
    distributed.barrier(ddp)  # every rank returns once the results are written
    for logger in loggers:
        logger.close()
    return result


def _truncate_log(log_path: Path, step: int, drop_evaluation: bool = False) -> None:
    """Drop log lines written after the checkpoint we resume from (a killed run may have logged on), and with
    ``drop_evaluation`` the evaluation of its step (which the resumed run does again)."""
    if not log_path.is_file():
        return
    kept = []
    for record in log_records(log_path):  # lines cut short by a crash, or damaged, are left out
        at = record.get("step", 0)
        if at > step or record.get("event") == "test":  # test: written after the loop
            continue
        if drop_evaluation and at == step and record.get("event") == "eval":
            continue
        kept.append(json.dumps(record, sort_keys=True))
    atomic_write_text(log_path, "".join(line + "\n" for line in kept))


def _progress_bar(enabled: bool, total: int, initial: int, name: str) -> Any:
    # a bar on a terminal, plain lines elsewhere (a script's log, a scheduler's job), never silence
    return progress_bar(enabled, total, initial, name)
