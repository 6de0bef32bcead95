"""The training loop, from config to results, for every task.

``train(config, out_dir)`` asks the run's task (:mod:`gatedformer.tasks`) for its data and model, trains for
``train.steps`` steps with evaluation and checkpoints every ``train.eval_every`` steps, and finally has the task
score the whole valid and test splits. :func:`_train` reads as the run's phases in order: :func:`set_up`,
:func:`start` or :func:`resume_from`, :func:`before_steps`, then per step :func:`train_step` (whose one backward
call is :func:`backward`, whose update is :func:`optimise`), :func:`log_training`, :func:`evaluate` and
:func:`checkpoint`, and :func:`finish`; what they share is one :class:`RunState`, passed explicitly. Everything it
writes into ``out_dir`` is written atomically, and ``resume=True`` continues bit for bit where a stopped run left off.
The loop owns what every task shares: the run folder, checkpoints and exact resume, RNG states, data parallelism,
signals, non-finite losses, the log, TensorBoard and the progress bar; the task owns its data, model, loss, metric
and evaluation.
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
from dataclasses import dataclass, field
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
    """:func:`train`, in a run folder this process holds: the phases of a run, in order."""
    checkpoint_path = prepare_run_dir(out_dir, config, resume)
    run = set_up(config, task, out_dir, data_dir, progress, shared, resumed=checkpoint_path is not None)
    if checkpoint_path is None:
        start(run)
    else:
        resume_from(run, checkpoint_path)
    before_steps(run, on_record, fresh=checkpoint_path is None)
    if run.evaluation_pending:
        evaluate_cut_short(run)
    run.bar = progress_bar(progress and run.ddp.is_main, config.train.steps, run.step, out_dir.name)
    run.model.train()
    with _StopSignal() as stop_signal:
        while run.step < config.train.steps:
            train_step(run)
            if run.step % config.train.log_every == 0:
                log_training(run)
            final = run.step == config.train.steps
            if run.step % config.train.eval_every == 0 or final:
                abandoned = evaluate(run, stop_signal, final)
                checkpoint(run, evaluation_pending=abandoned)
            signal = (stop_signal.received or "on another rank") if distributed.any_rank(
                run.ddp, stop_signal.received is not None) else None
            if stop_here(run, final, signal, stop_after):
                run.close_loggers()
                return None
    run.bar.close()
    return finish(run)


@dataclass
class RunState:
    """One training run from set-up to finish, passed explicitly from phase to phase: what it trains with (fixed by
    :func:`set_up`), where it stands (advanced by :func:`train_step`, saved by :func:`checkpoint`, restored by
    :func:`resume_from`), and what it reports through."""

    config: RunConfig
    task: Task
    out_dir: Path
    ddp: distributed.DistContext
    data: Any
    metric: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    """Scales the loss under ``train.precision=fp16``; disabled otherwise."""
    params: int
    files_sha256: dict[str, str]
    """The run folder's files' checksums, recorded with the weights and checked when they load."""

    # Where the run stands; a checkpoint saves it, a resume restores it.
    step: int = 0
    tokens_seen: int = 0
    carry: Any = None
    """What the model carries from window to window (a recurrent state, a memory), on this rank."""
    position: dict[str, int] = field(default_factory=dict)
    """Where the data stands, as the task says it (saved in the checkpoint's meta)."""
    clock: TrainingClock = field(default_factory=TrainingClock)
    loss_sum: float = 0.0
    loss_count: int = 0
    """The finite training losses since the last ``train`` record: their sum and number."""
    skipped: int = 0
    """Steps whose update ``train.nonfinite=skip`` (or the fp16 scaler) left out."""
    evaluation_pending: bool = False
    """The checkpoint resumed from was to be evaluated when a stop signal came: :func:`evaluate_cut_short` does it."""
    final_eval: dict[str, Any] | None = None
    """The evaluation of the last step, which the final scoring may reuse."""

    # Set by start / resume_from, before_steps and _train.
    batches: Iterator[Any] = field(default_factory=lambda: iter(()))
    steps_per_epoch: int = 0
    net: Any = None
    """The model wrapped for data parallelism (DistributedDataParallel under torchrun; the model itself otherwise)."""
    compiled: Any = None
    """``net`` as the steps run it: compiled under ``train.compile``."""
    stats: Any = None
    """The gates' statistics (a :class:`GateStatistics`), which each evaluation records."""
    loggers: list[Any] = field(default_factory=list)
    bar: Any = None

    @property
    def device(self) -> torch.device:
        return self.ddp.device

    @property
    def log_path(self) -> Path:
        return self.out_dir / "log.jsonl"

    def log(self, record: dict[str, Any]) -> None:
        """To log.jsonl, TensorBoard, W&B and the caller's ``on_record``, on rank 0 (the others have no loggers)."""
        for logger in self.loggers:
            logger.record(record)

    def close_loggers(self) -> None:
        for logger in self.loggers:
            logger.close()


def set_up(config: RunConfig, task: Task, out_dir: Path, data_dir: str | Path | None, progress: bool, shared: Any,
           resumed: bool) -> RunState:
    """The run's process (threads, data parallelism, device, precision), its data, model, optimiser and schedule,
    and the run folder's files. The run stands at step 0; :func:`resume_from` moves it on."""
    tcfg = config.train
    if tcfg.threads:
        torch.set_num_threads(tcfg.threads)
    # Under torchrun: join the process group; each rank trains on its share of every batch.
    ddp = distributed.setup(config.data.batch_size, resolve_device(tcfg.device, "train.device"))
    if ddp.enabled and not task.supports_ddp:
        raise ConfigError(f"the {task.name} task trains in one process; run it without torchrun (or with "
                          "--nproc_per_node 1)")
    check_precision(ddp.device, tcfg.precision)
    # fp16 scales the loss so that small gradients survive float16; the scale goes on from checkpoint to checkpoint.
    scaler = torch.amp.GradScaler(ddp.device.type, enabled=tcfg.precision == "fp16")

    data = task.load_data(config, data_dir, (ddp.rank, ddp.world), progress and ddp.is_main, shared)
    metric = task.metric(data)
    torch.manual_seed(tcfg.seed)
    model = task.build_model(config, data)
    initialise(model, config.init)
    if not resumed:  # a resumed run has its weights in the checkpoint
        task.start_weights(model, config, data)
    distributed.seed_rank(ddp, tcfg.seed)  # every rank starts equal; dropout masks then differ per rank
    model.to(ddp.device)
    params = count_parameters(model)
    optimizer = build_optimizer(model, config.optim)
    scheduler = build_scheduler(optimizer, config.optim, tcfg.steps, config.model.d_model)
    files_sha256 = _write_run_files(config, task, data, out_dir, ddp, resumed)
    return RunState(config=config, task=task, out_dir=out_dir, ddp=ddp, data=data, metric=metric, model=model,
                    optimizer=optimizer, scheduler=scheduler, scaler=scaler, params=params,
                    files_sha256=files_sha256)


def _write_run_files(config: RunConfig, task: Task, data: Any, out_dir: Path, ddp: distributed.DistContext,
                     resumed: bool) -> dict[str, str]:
    """The run folder with ``config.json`` and the task's files (a vocabulary, say); their checksums."""
    make_folder(out_dir, "run folder")
    if not ddp.is_main:
        return {}
    atomic_write_json(out_dir / "config.json", config.to_dict())
    run_files = task.run_files(data)
    for name, content in run_files.items():
        (atomic_write_text if isinstance(content, str) else atomic_write_json)(out_dir / name, content)
    files_sha256 = files_checksums(out_dir, run_files)
    task.open_run(data, out_dir, resumed)
    return files_sha256


def start(run: RunState) -> None:
    """A fresh run: the data from its first batch, and no log from an earlier run."""
    run.batches = run.task.train_batches(run.data, run.config, 0, None)
    run.steps_per_epoch = -(-run.task.steps_per_epoch(run.data, run.config, None) // run.config.train.grad_accum)
    if run.ddp.is_main:
        run.log_path.unlink(missing_ok=True)


def resume_from(run: RunState, checkpoint_path: Path) -> None:
    """Where the checkpoint left the run, bit for bit: weights, optimiser, schedule, scaler, counters, clock, this
    rank's RNG states and carried state, and where the data stood; the log cut back to the checkpoint's step."""
    config, task, tcfg = run.config, run.task, run.config.train
    ckpt = load_checkpoint(checkpoint_path)
    check_architecture(ckpt.meta.get("config"), config.to_dict(), str(checkpoint_path))
    load_model_weights(run.model, ckpt.model_state, str(checkpoint_path))
    with restoring(checkpoint_path):
        run.optimizer.load_state_dict(ckpt.trainer_state["optimizer"])
        run.scheduler.load_state_dict(ckpt.trainer_state["scheduler"])
        if run.scaler.is_enabled():
            run.scaler.load_state_dict(ckpt.trainer_state["scaler"])
        follow_changed_lr(run.optimizer, run.scheduler, config.optim.lr)
        meta = ckpt.meta
        run.step, run.tokens_seen = meta["step"], meta["tokens_seen"]
        run.clock = TrainingClock(meta, run.step, run.tokens_seen)
        run.loss_sum, run.loss_count, run.skipped = meta["loss_sum"], meta["loss_count"], meta.get("skipped", 0)
        # This rank's RNG states and carried state (each rank saved its own).
        run.carry = _state_to(distributed.restore_rank_state(run.ddp, ckpt.trainer_state, meta, ckpt.carry,
                                                             tcfg.seed), run.device)
        # Where the data stood comes from the meta too: take the first batch here, so a damaged position is
        # one error now rather than a traceback from the generator later.
        batches = task.train_batches(run.data, config, run.step * tcfg.grad_accum, meta)  # micro-batches so far
        run.batches = itertools.chain([next(batches)], batches)
        run.steps_per_epoch = -(-task.steps_per_epoch(run.data, config, meta) // tcfg.grad_accum)
        run.evaluation_pending = meta.get("evaluation_pending") is True
    if run.ddp.is_main:
        _truncate_log(run.log_path, run.step, drop_evaluation=run.evaluation_pending)


def before_steps(run: RunState, on_record: Callable[[dict[str, Any]], None] | None, fresh: bool) -> None:
    """The model as the steps run it, the gate statistics, and the loggers (log.jsonl, TensorBoard, W&B and
    ``on_record``, through one interface: train/loggers.py), which a fresh run's first records open."""
    # Wrapped once the weights are final: DistributedDataParallel broadcasts rank 0's (restored) weights.
    run.net = distributed.wrap(run.model, run.ddp)
    run.compiled = compile_model(run.net) if run.config.train.compile else run.net
    run.stats = GateStatistics(run.model)
    run.loggers = open_loggers(run.config, run.out_dir, run.log_path, on_record) if run.ddp.is_main else []
    if fresh:
        for record in run.task.start_records(run.data, run.params):
            run.log(record)


def evaluate_cut_short(run: RunState) -> None:
    """The evaluation a stop signal cut short before the checkpoint resumed from, before anything else. That
    checkpoint is on disk, so another signal stops at once."""
    fields = None
    final = run.step >= run.config.train.steps
    if run.ddp.is_main:
        with _StopSignal(interrupt=(run.step, run.out_dir)):
            fields = run.task.evaluate(run.model, run.data, run.config, run.device, final, run.stats.recording)
        log_evaluation(run, fields)
        run.final_eval = fields if final else None
        run.model.train()
    observe(run, fields)
    run.evaluation_pending = False


def train_step(run: RunState) -> None:
    """One optimisation step: forward and backward over its micro-batches, then the update; the run moves on."""
    started = time.perf_counter()
    tcfg = run.config.train
    micro = [next(run.batches) for _ in range(tcfg.grad_accum)]  # a step's micro-batches (one, by default)
    step_tokens = sum(batch.tokens for batch in micro)
    run.optimizer.zero_grad(set_to_none=True)
    loss = _forward_backward(run, micro, step_tokens)
    loss_value, stepped = optimise(run, loss)
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    run.step += 1
    run.position = micro[-1].position
    run.tokens_seen += step_tokens
    run.clock.add_step(time.perf_counter() - started, step_tokens)
    if not stepped:
        run.skipped += 1
    if math.isfinite(loss_value):
        run.loss_sum += loss_value
        run.loss_count += 1
    run.bar.update(1)


def _forward_backward(run: RunState, micro: list[Any], step_tokens: int) -> torch.Tensor:
    """The forward and backward passes of a step's micro-batches; returns the step's loss, detached.

    Gradients add up over the micro-batches (synchronised across ranks once, with the last): each loss, a mean over
    its tokens, weighs by its share of the step's tokens. Under ``train.precision=fp16`` the backward pass runs on the
    scaled loss (:func:`optimise` unscales the gradients)."""
    total: torch.Tensor | None = None
    for index, batch in enumerate(micro):
        if batch.new_epoch:
            run.carry = None  # a new epoch starts from a fresh state
        last = index == len(micro) - 1
        with contextlib.nullcontext() if last or not run.ddp.enabled else run.net.no_sync():
            loss, new_carry = run.task.loss(run.compiled, batch, run.carry, run.config, run.device)
            if len(micro) > 1:
                loss = loss * (batch.tokens / max(step_tokens, 1))
            backward(loss, run.scaler)
        total = loss.detach() if total is None else total + loss.detach()
        run.carry = detach_state(new_carry)
    assert total is not None  # train.grad_accum >= 1: validate holds it
    return total


def backward(loss: torch.Tensor, scaler: torch.amp.GradScaler) -> None:
    """A micro-batch's backward pass, which adds its gradients to the step's: on the scaled loss where ``scaler`` is
    enabled (``train.precision=fp16``), so that small gradients survive float16."""
    (scaler.scale(loss) if scaler.is_enabled() else loss).backward()


def optimise(run: RunState, loss: torch.Tensor) -> tuple[float, bool]:
    """The update of step ``run.step + 1`` once its gradients are in: gradient clipping (``optim.clip``), the
    optimiser and scheduler steps. ``loss`` is the step's (detached); returns its mean over the ranks (the loss the
    log records) and whether the weights were updated. A non-finite loss or gradient raises :class:`NonFiniteLoss`,
    or with ``train.nonfinite=skip`` drops the gradients and leaves the weights as they are.

    With an enabled gradient scaler (``train.precision=fp16``) the gradients are unscaled before clipping; gradients
    that overflowed float16 skip the update and lower the scale (the scaler's business, not an error), a non-finite
    loss is one as above."""
    optimizer, scheduler, scaler, config = run.optimizer, run.scheduler, run.scaler, run.config
    scaling = scaler.is_enabled()
    if scaling:
        scaler.unscale_(optimizer)
    clip = config.optim.clip if config.optim.clip > 0 else float("inf")
    grad_norm = clip_gradients(run.model, optimizer, clip)
    value = distributed.mean_over_ranks(run.ddp, loss)
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
        kept = latest_checkpoint(run.out_dir) if run.out_dir.exists() else None
        raise NonFiniteLoss(
            f"non-finite loss or gradient at step {run.step + 1} (loss {value}); "
            + (f"the last good checkpoint ({kept.name}) is kept: continue from it with --resume and {fixes}"
               if kept is not None else f"no checkpoint was written before it: train again with {fixes}")
        )
    else:
        optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return value, stepped


def log_training(run: RunState) -> None:
    """The ``train`` record of the steps since the last one: their mean finite loss, and the steps skipped so far."""
    record = {"event": "train", "step": run.step, "lr": run.scheduler.get_last_lr()[0], "tokens": run.tokens_seen,
              "time": run.clock.step_seconds, "tokens_per_s": run.clock.tokens_per_second,
              **run.task.log_fields(run.position)}
    if run.loss_count:
        record["train_loss"] = run.loss_sum / run.loss_count
        run.bar.set_postfix(loss=f"{run.loss_sum / run.loss_count:.3f}")
    if run.skipped:
        record["skipped_steps"] = run.skipped
    run.log(record)
    run.loss_sum, run.loss_count = 0.0, 0


def evaluate(run: RunState, stop_signal: _StopSignal, final: bool) -> bool:
    """The evaluation of step ``run.step``, logged, on rank 0 (the others wait in the checkpoint that follows);
    returns whether a stop signal cut it short (a whole split can take many minutes), for the checkpoint to say so and
    --resume to evaluate this step again first.

    A failure keeps the steps before it in a checkpoint (they are sound, as at a stop signal) and raises, a user error
    as :class:`EvaluationFailed`; a non-finite validation loss under ``train.nonfinite=stop`` raises
    :class:`NonFiniteLoss` and checkpoints nothing, so the last checkpoint, of finite validation loss, stays."""
    fields: dict[str, Any] | None = None
    abandoned = False
    if run.ddp.is_main:
        try:
            with stop_signal.abandonable():
                fields = run.task.evaluate(run.model, run.data, run.config, run.device, final, run.stats.recording)
        except _Abandoned:
            abandoned = True
            run.model.train()
        except Exception as err:
            observe(run, None, abandoned=True)
            checkpoint(run, evaluation_pending=True)
            run.bar.close()
            if isinstance(err, GatedformerError):
                raise EvaluationFailed(err, run.step, run.out_dir) from None
            raise
        else:
            log_evaluation(run, fields)
            run.bar.set_postfix(valid=f"{fields[f'valid_{run.metric}']:.3f} {run.metric}")
            run.final_eval = fields if final else None
    # train.nonfinite=skip rides through non-finite values, in validation as in training.
    diverged = distributed.any_rank(run.ddp, fields is not None and run.config.train.nonfinite == "stop"
                                    and not math.isfinite(fields["valid_loss"]))
    if diverged:
        run.bar.close()
        raise _diverged(run.step, run.out_dir, fields["valid_loss"] if fields is not None else math.nan)
    observe(run, fields, abandoned)
    return abandoned


def observe(run: RunState, fields: dict[str, Any] | None, abandoned: bool = False) -> None:
    """Rank 0's validation loss to the schedule on every rank (``optim.schedule=plateau`` anneals on it); every rank
    calls it after an evaluation, the others with no ``fields``."""
    if run.config.optim.schedule != "plateau":
        return
    loss, cut_short = distributed.broadcast_floats(
        run.ddp, [fields["valid_loss"] if fields is not None else math.nan, 1.0 if abandoned else 0.0])
    if not cut_short:  # an evaluation a stop signal cut short is done, and observed, on resume
        run.scheduler.observe(loss)


def log_evaluation(run: RunState, fields: dict[str, Any]) -> None:
    """The ``eval`` record (rank 0 alone)."""
    run.log({"event": "eval", "step": run.step, "tokens": run.tokens_seen, "time": run.clock.step_seconds,
             "tokens_per_s": run.clock.tokens_per_second, **fields, "gates": run.stats.summary()})


def checkpoint(run: RunState, evaluation_pending: bool = False) -> None:
    """The checkpoint of ``run.step``: every rank calls it, rank 0 writes it, with every rank's RNG states and
    carried state. ``evaluation_pending``: a stop signal or a failure cut the evaluation of this step short, and
    --resume does it again first."""
    ranks = distributed.gather_rank_states(run.ddp, run.carry)
    if run.ddp.is_main:
        trainer_state = {"optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(),
                         **distributed.rng_state(run.device)}
        if run.scaler.is_enabled():
            trainer_state["scaler"] = run.scaler.state_dict()
        meta = {**run.position, "tokens_seen": run.tokens_seen, **run.clock.state(), "loss_sum": run.loss_sum,
                "loss_count": run.loss_count, "skipped": run.skipped, "config": run.config.to_dict(),
                FILES_KEY: run.files_sha256}
        if evaluation_pending:
            meta["evaluation_pending"] = True
        trainer_state, saved_carry, extra = distributed.checkpoint_parts(run.ddp, trainer_state, run.carry, ranks)
        save_checkpoint(run.out_dir, run.step, run.model, trainer_state, {**meta, **extra}, saved_carry)
    distributed.barrier(run.ddp)  # no rank leaves before the checkpoint is complete


def stop_here(run: RunState, final: bool, signal: int | str | None, stop_after: int | None) -> bool:
    """After a step: on a stop ``signal`` (received by any rank), checkpoint and raise :class:`TrainingInterrupted`;
    at ``stop_after`` (before the last step), checkpoint and return True so the loop ends without results."""
    if signal is not None:
        checkpoint(run)
        run.bar.close()
        raise TrainingInterrupted(signal, run.step, run.out_dir)
    if stop_after is not None and run.step >= stop_after and not final:
        checkpoint(run)
        run.bar.close()
        return True
    return False


def finish(run: RunState) -> RunResult:
    """The whole valid and test splits scored by the task, the final weights (and gate biases), the ``test`` record,
    results.json and loss.png. The last checkpoint is on disk: a signal while the run is scored stops at once, and
    --resume scores it."""
    config, ddp, clock, metric = run.config, run.ddp, run.clock, run.metric
    with _StopSignal(interrupt=(run.step, run.out_dir)):
        if ddp.is_main:
            scores = run.task.score(run.model, run.data, config, run.device, run.out_dir, run.final_eval)
            save_model_weights(run.model, run.out_dir / "model.safetensors",
                               weights_metadata(config.to_dict(), run.files_sha256))
            biases = gate_biases(run.model)
            if biases:
                save_tensors_atomically(biases, run.out_dir / "gate_biases.safetensors")
        else:
            scores = (math.nan,) * 4
        valid_loss, valid_metric, test_loss, test_metric = distributed.broadcast_floats(ddp, list(scores))
        result = RunResult(
            run_dir=str(run.out_dir), corpus=config.data.corpus, metric=metric, valid_loss=valid_loss,
            valid_metric=valid_metric, test_loss=test_loss, test_metric=test_metric, params=run.params,
            steps=run.step, seconds_per_step=clock.seconds_per_step(run.step), train_seconds=clock.step_seconds,
            tokens_per_second=clock.tokens_per_second, setup_seconds=clock.setup_seconds,
            wall_seconds=clock.wall_seconds, steps_per_epoch=run.steps_per_epoch,
        )
        run.log({"event": "test", "step": run.step, "test_loss": test_loss, f"test_{metric}": test_metric})
        if ddp.is_main:
            atomic_write_json(run.out_dir / "results.json", {**run.task.result_fields(run.data), **result.__dict__})
    if ddp.is_main:
        write_loss_curve(run.out_dir, metric)  # loss.png, from Python as from the command line (with matplotlib)
    distributed.barrier(ddp)  # every rank returns once the results are written
    run.close_loggers()
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
