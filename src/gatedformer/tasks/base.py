"""What a task is: everything about one kind of experiment that the training loop does not know.

The loop (:func:`gatedformer.train.loop.train`) owns what every run shares: the run folder, checkpoints and exact
resume, RNG states, data parallelism, signals, non-finite losses, logging, TensorBoard and progress. A
:class:`Task` owns the rest: how to read its data, build its model, turn the data into training steps and a step into
a loss, and how to evaluate, score, classify and decode. A task is ``Task[DataT, InferenceT]``: ``DataT`` its data
for training (``LMData``, ``TranslationData``, ``MLMData``, ``GlueData``, ``SentenceData``) and ``InferenceT`` what a
trained model needs besides its weights (its vocabularies), which only the task itself looks into.

The loop calls, in this order::

    task.check_modules(config)                                          # before anything is read
    data: DataT = task.load_data(config, data_dir, shard, progress, shared)
    task.metric(data) -> str                                            # "bpc", "ppl", "bleu", ...
    model: nn.Module = task.build_model(config, data)                   # after torch.manual_seed(train.seed)
    task.start_weights(model, config, data)                             # a new run only, after initialisation
    task.run_files(data) -> dict[str, Any]                              # written beside config.json
    task.open_run(data, out_dir, resumed)
    task.train_batches(data, config, step, meta) -> Iterator[TrainBatch]
    task.steps_per_epoch(data, config, meta) -> int
    task.start_records(data, params) -> list[dict[str, Any]]            # the log's first lines
    for batch in batches:
        loss, carry = task.loss(model, batch, carry, config, device)    # -> (Tensor, carry)
        task.log_fields(batch.position) -> dict[str, Any]               # every train.log_every steps
        task.evaluate(model, data, config, device, final, recording)    # -> dict, every train.eval_every steps
    task.score(model, data, config, device, out_dir, final_eval)        # -> (valid loss, valid metric,
                                                                        #     test loss, test metric)
    task.result_fields(data) -> dict[str, Any]                          # merged into results.json

Outside training, a trained run is read back through ``inference_data(config, run_dir, data_dir) -> InferenceT``
(with ``inference_files(data)``, the files an exported folder carries), measured by ``evaluate_split`` (``gatedformer
eval``), counted by ``nominal_model(config, vocab_size)`` (``gatedformer params``), and, where its models classify
text, asked ``class_names``, ``reads_pairs`` and ``classify`` (``Pretrained.classify``, ``gatedformer classify``);
``shared_data`` lets ``compare`` read a corpus once for all its runs.

A new task is a subclass in its own module of :mod:`gatedformer.tasks`, imported by the package's ``__init__`` and
registered by its decorator, ``@register_task("name", corpora=[...], sections=[...])`` (its name, the corpora it
claims, the config sections it reads); the loop does not change.
"""

from __future__ import annotations

import contextlib
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import torch
from torch import nn

from gatedformer.config import RunConfig, register_task_sections
from gatedformer.data.registry import claim_corpora
from gatedformer.errors import ConfigError, GatedformerError

__all__ = ["TASKS", "Task", "TrainBatch", "by_length", "evaluating", "register_task"]


@dataclass
class TrainBatch:
    """One training step's data, as :meth:`Task.train_batches` gives it."""

    inputs: tuple[torch.Tensor, ...]
    """What :meth:`Task.loss` takes (on the CPU; the task moves them)."""
    tokens: int
    """The tokens the step trains on, over every rank (for throughput and the log)."""
    new_epoch: bool = False
    """The first batch of an epoch: a recurrent state carried from the last batch starts afresh."""
    position: dict[str, int] = field(default_factory=dict)
    """Where the data stands once this batch is consumed, as the checkpoint's meta records it (empty where the step
    alone says it)."""


DataT = TypeVar("DataT")
"""A task's data for training, as its :meth:`Task.load_data` reads it."""
InferenceT = TypeVar("InferenceT")
"""What a trained model of the task needs besides its weights (its vocabularies), as :meth:`Task.inference_data`
reads it back."""


class Task(ABC, Generic[DataT, InferenceT]):
    """One kind of experiment: its data (``DataT``; ``InferenceT`` for a trained model), model, loss, metric,
    evaluation and decoding."""

    name: ClassVar[str]
    """What :func:`gatedformer.config.task_of` calls it (set by :func:`register_task`)."""
    title: ClassVar[str]
    """How messages name its runs (``a language-model run``)."""
    supports_ddp: ClassVar[bool] = False
    """Whether it shards its batches over the ranks of a data-parallel run."""
    optional_modules: ClassVar[tuple[tuple[str, str], ...]] = ()
    """The optional modules its training and evaluation import where they use them, each with the extra that
    installs it (``("sacrebleu", "translate")``): :meth:`check_modules` looks for them before the first step."""

    def modules_for(self, config: RunConfig) -> tuple[tuple[str, str], ...]:
        """:attr:`optional_modules` that a run of ``config`` imports (a task whose corpora differ in what they need
        names them per corpus)."""
        return self.optional_modules

    def check_modules(self, config: RunConfig) -> None:
        """One line naming the optional modules a run of ``config`` needs that are not installed, and the extra to
        install: checked before the first step, not found missing at the first evaluation hours later."""
        missing = [(module, extra) for module, extra in self.modules_for(config) if not _importable(module)]
        if missing:
            names = " and ".join(dict.fromkeys(module for module, _ in missing))
            extras = ",".join(dict.fromkeys(extra for _, extra in missing))
            raise GatedformerError(f"{self.title} runs need {names}, which {'is' if len(missing) == 1 else 'are'} not "
                                   f"installed here; install it with pip install 'gatedformer[{extras}]'")

    def shared_data(self, config: RunConfig, data_dir: str | Path | None) -> Any:
        """What runs on the same corpus may share instead of each reading it (``compare`` reads it once for all its
        runs); ``None`` where each run reads its own."""
        return None

    @abstractmethod
    def load_data(self, config: RunConfig, data_dir: str | Path | None, shard: tuple[int, int] = (0, 1),
                  progress: bool = False, shared: Any = None) -> DataT:
        """The corpus, vocabularies and splits the config names; ``shard`` is ``(rank, world)`` of a data-parallel
        run (this rank trains on its share of each batch); ``progress`` lets it say what it skipped; ``shared`` is
        what :meth:`shared_data` gave for this corpus, if the caller has it."""

    @abstractmethod
    def build_model(self, config: RunConfig, data: DataT) -> nn.Module:
        """The network of ``config.model`` for this data (its vocabulary sizes), fused
        (:func:`gatedformer.fused.fuse`): what training and inference run."""

    @abstractmethod
    def nominal_model(self, config: RunConfig, vocab_size: int) -> nn.Module:
        """The network of ``config.model`` with every vocabulary of ``vocab_size`` tokens, built without the data
        (for counting parameters, e.g. under ``torch.device("meta")``)."""

    @abstractmethod
    def metric(self, data: DataT) -> str:
        """The name of the task's metric (``bpc``, ``ppl``, ``bleu``)."""

    def run_files(self, data: DataT) -> dict[str, Any]:
        """Files (name → JSON content, or text as a ``str``) the run folder keeps beside ``config.json``, e.g. the
        vocabularies."""
        return {}

    def start_weights(self, model: nn.Module, config: RunConfig, data: DataT) -> None:
        """Load the weights a new run starts from into ``model``, after its initialisation (a resumed run takes its
        checkpoint's instead): by default ``train.init_from``'s, which must fit ``model`` exactly; a task whose
        model differs from the one it starts from (fine-tuning adds heads to a pretrained encoder) maps them."""
        if config.train.init_from:
            from gatedformer.tasks.weights import load_exactly, read_start_weights

            state, where = read_start_weights(config.train.init_from, config)
            load_exactly(model, state, where)

    def open_run(self, data: DataT, out_dir: Path, resumed: bool) -> None:
        """The run folder, once it exists and before the first step (of a new or resumed run): where a task keeps
        files of its own while it trains (e.g. the predictions of its best evaluation); by default none."""
        return None

    def result_fields(self, data: DataT) -> dict[str, Any]:
        """Fields ``results.json`` holds beside the loop's, once :meth:`score` has run (e.g. GLUE's metrics by
        name)."""
        return {}

    def start_records(self, data: DataT, params: int) -> list[dict[str, Any]]:
        """Log records a new run starts with (not a resumed one)."""
        return []

    @abstractmethod
    def train_batches(self, data: DataT, config: RunConfig, step: int, meta: dict[str, Any] | None
                      ) -> Iterator[TrainBatch]:
        """The training batches from optimisation step ``step`` on, epoch after epoch, forever; ``meta`` is the
        checkpoint's meta when resuming (where the data stood, see :attr:`TrainBatch.position`)."""

    @abstractmethod
    def steps_per_epoch(self, data: DataT, config: RunConfig, meta: dict[str, Any] | None) -> int:
        """Training steps in one pass over the training split."""

    def log_fields(self, position: dict[str, int]) -> dict[str, Any]:
        """What a ``train`` log record adds about where the data stands: the epoch, for tasks whose position has one
        (a language model's follows from the step alone and adds nothing)."""
        return {"epoch": position["epoch"]} if "epoch" in position else {}

    @abstractmethod
    def loss(self, model: nn.Module, batch: TrainBatch, carry: Any, config: RunConfig,
             device: torch.device) -> tuple[torch.Tensor, Any]:
        """The training loss of one batch (the mean the optimiser minimises) and the state to carry to the next."""

    @abstractmethod
    def evaluate(self, model: nn.Module, data: DataT, config: RunConfig, device: torch.device, final: bool,
                 recording: Callable[[], AbstractContextManager[Any]]) -> dict[str, Any]:
        """An evaluation during training, on the whole valid split when ``final``: the ``eval`` record's fields,
        ``valid_loss`` and ``valid_<metric>`` among them. Gate activations are recorded inside ``with
        recording():``, around the part of the evaluation that reads the model on the data as it is."""

    @abstractmethod
    def score(self, model: nn.Module, data: DataT, config: RunConfig, device: torch.device, out_dir: Path,
              final_eval: dict[str, Any] | None) -> tuple[float, float, float, float]:
        """The finished run's ``(valid_loss, valid_metric, test_loss, test_metric)`` on the whole splits (the valid
        ones from ``final_eval`` where the last evaluation scored them), writing what the task keeps of them."""

    # ---- using a trained run ---------------------------------------------------------------------------------

    @abstractmethod
    def inference_data(self, config: RunConfig, run_dir: Path, data_dir: str | Path | None) -> InferenceT:
        """What a trained model needs besides its weights (vocabularies), from the run folder where it keeps them,
        else from the corpus."""

    def inference_files(self, data: InferenceT) -> dict[str, str]:
        """The files (name -> text) from which :meth:`inference_data` reads ``data`` back out of a folder alone,
        without the corpus: what an exported model (``save_pretrained``) keeps besides its weights. A
        :class:`ConfigError` for a task whose models cannot be exported."""
        raise ConfigError(f"{self.title} models cannot be exported yet: their vocabulary is read from the corpus; "
                          "share the run folder instead")

    def class_names(self, data: InferenceT) -> tuple[str, ...] | None:
        """What each of a classifier's outputs means (``("negative", "positive")``); ``None`` for a model that
        scores (a regression) instead. A :class:`ConfigError` for a task whose models do not classify text."""
        raise ConfigError(f"{self.title} models do not classify text; classify with a sentence-classification or "
                          "GLUE run")

    def reads_pairs(self, data: InferenceT) -> bool:
        """Whether an example of :meth:`classify` is a pair of sentences (a GLUE task such as MRPC) rather than
        one."""
        return False

    def classify(self, model: nn.Module, config: RunConfig, data: InferenceT,
                 inputs: Sequence[str | tuple[str, str]], device: torch.device, batch_size: int = 64) -> torch.Tensor:
        """The class probabilities ``(N, classes)`` of ``inputs`` (sentences, or pairs of them for a task that reads
        two), or their scores ``(N,)`` where :meth:`class_names` is ``None``: the text read as the task's data reads
        its own, ``batch_size`` at a time."""
        self.class_names(data)  # the task's own error where it does not classify
        raise NotImplementedError

    @abstractmethod
    def evaluate_split(self, model: nn.Module, config: RunConfig, split: str, data_dir: str | Path | None,
                       device: torch.device, data: InferenceT) -> dict[str, float]:
        """The loss and metric of a trained model on a whole split (``valid`` or ``test``)."""


TASKS: dict[str, Task[Any, Any]] = {}
"""Every task, by name, in the order :mod:`gatedformer.tasks` imports their modules: filled by :func:`register_task`."""

_TaskClass = TypeVar("_TaskClass", bound=type[Task[Any, Any]])


def register_task(name: str, *, corpora: Sequence[str] = (),
                  sections: Sequence[str] = ()) -> Callable[[_TaskClass], _TaskClass]:
    """A decorator that makes the :class:`Task` subclass beside it the task called ``name`` (what ``data.task`` and
    :func:`gatedformer.config.task_of` say), at its module's import: it sets the class's :attr:`~Task.name`, puts one
    instance of it in :data:`TASKS`, makes ``corpora`` (names of the data registry's corpora, or patterns such as
    ``glue-*``) its own (:func:`gatedformer.data.registry.corpus_task`; a task that claims none runs where
    ``data.task`` names it) and records ``sections``, the config sections it reads besides every run's
    (:data:`gatedformer.config.TASK_SECTIONS`)."""

    def register(cls: _TaskClass) -> _TaskClass:
        if name in TASKS:
            raise ValueError(f"task {name!r} is registered twice")
        register_task_sections(name, sections)
        claim_corpora(name, corpora)
        cls.name = name
        TASKS[name] = cls()
        return cls

    return register


def _importable(module: str) -> bool:
    # Imported, not only looked up: an installed module that fails to import fails the evaluation all the same.
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode for the block, and back in its own mode after it, however the block ends."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def by_length(lengths: Sequence[int], size: int) -> Iterator[list[int]]:
    """The indices of ``lengths`` in order of length, ``size`` at a time: batches of like lengths pad little."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    for start in range(0, len(order), size):
        yield order[start: start + size]


def rng(*words: int) -> np.random.Generator:
    """A generator for the numbers ``words`` name (seed, step, stream), independent of every other such tuple."""
    return np.random.default_rng([int(w) for w in words])


def shuffled_epochs(examples: int, batch_size: int, per_epoch: int, seed: int, stream: int, step: int
                    ) -> Iterator[tuple[int, int, list[int]]]:
    """From ``step`` on, every step's ``(epoch, first position in the epoch, example indices)``: each epoch is a
    permutation of the ``examples`` drawn from ``(seed, epoch, stream)`` alone, so a run resumed at any step takes
    the batches the uninterrupted run would have taken."""
    epoch, order = -1, np.empty(0, dtype=np.int64)
    while True:
        if step // per_epoch != epoch:
            epoch = step // per_epoch
            order = rng(seed, epoch, stream).permutation(examples)
        start = (step % per_epoch) * batch_size
        yield epoch, start, order[start: start + batch_size].tolist()
        step += 1
