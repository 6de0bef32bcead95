"""Run configuration: dataclasses, recipe files and ``--set`` overrides.

A run is described by one :class:`RunConfig`. Recipes are TOML files shipped in
``gatedformer/recipes`` (or any path a user gives); every field can be overridden on the command
line with ``--set section.field=value``. Anything that does not describe a valid run raises a
:class:`~gatedformer.errors.ConfigError` with one line naming the problem and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import tomllib

from gatedformer.data.registry import corpus_task, text_tasks
from gatedformer.errors import ConfigError
from gatedformer.gates.spec import resolve_placement

# More threads than any machine's cores: torch crashes (not errs) on very large counts.
MAX_THREADS = 1024
OPTIMIZERS = ("sgd", "adam", "adamw", "adamax")
SCHEDULES = ("constant", "linear", "cosine", "noam", "plateau")
INIT_SCHEMES = ("default", "uniform", "normal", "xavier")


@dataclass
class DataConfig:
    """Which corpus, and how it is cut into training and evaluation windows."""

    corpus: str = "ptb-char"
    task: str = ""
    """The task to train: empty for the corpus's own (``gatedformer data list``), or ``mlm`` for masked language
    modelling (BERT pretraining) on a language-model corpus."""
    batch_size: int = 16
    seq_len: int = 128
    eval_batch_size: int = 16
    eval_seq_len: int = 0
    """0 means: the same as ``seq_len``."""


@dataclass
class ModelConfig:
    """The network. Every variant is a keyword. Each backbone reads the fields it declares
    (:attr:`Backbone.fields`); :func:`validate` refuses any other set away from its default."""

    backbone: str = "transformer"
    d_model: int = 128
    n_layers: int = 3
    n_heads: int = 4
    d_ffn: int = 512
    dropout: float = 0.1
    emb_dropout: float | None = None
    """Dropout on the embeddings; ``None`` means the same as ``dropout``."""
    attn_dropout: float = 0.0
    norm: str = "post"
    """``post`` (the papers' ``LN(X + Sublayer(X))``) or ``pre``."""
    ffn: str = "relu"
    """``relu``, ``gelu`` (BERT's) or ``glu`` (the gated linear unit feed-forward)."""
    tie_embeddings: bool = False
    share_embeddings: bool = False
    """Translation: the encoder reads the decoder's embedding table (needs ``translation.shared_vocab``)."""
    gates: str = ""
    """Gate placement spec, e.g. ``"+σ SDU"``, ``"+tanh L1-3"``, ``"+σ L1-6\\FFN"``, ``"+EAU+GRC"``."""
    # R-Transformer
    rnn_type: str = "gru"
    rnn_window: int = 7
    rnn_recompute: bool = False
    """Recompute the LocalRNN's window steps in the backward pass instead of keeping their activations from
    the forward pass: training memory grows with the window as one layer's steps, not all layers', for one
    more LocalRNN forward per step."""
    # Transformer-XL
    mem_len: int = 0
    # gated convolutional LM
    kernel_size: int = 4
    bottleneck: int = 0
    weight_norm: bool = False
    # ConvS2S
    conv_layers: str = ""
    """The encoder's convolutions, ``CHANNELSxWIDTH`` items with an optional ``*COUNT``, e.g.
    ``"512x3*9, 1024x3*4, 2048x1*2"``; empty: ``n_layers`` layers of ``d_model`` channels and width ``kernel_size``."""
    decoder_conv_layers: str = ""
    """The decoder's convolutions, as ``conv_layers``; empty: the same as the encoder's."""
    out_dim: int = 0
    """The decoder's width before the output layer (ConvS2S's output embedding); 0: ``d_model``."""
    # BERT
    max_positions: int = 512
    """Learned positions: the longest sequence the encoder takes, ``[CLS]`` and ``[SEP]`` included."""
    type_vocab: int = 2
    """Token types (segments A and B)."""
    init_from_hf: str = ""
    """A local Hugging Face BERT checkpoint folder (``config.json``, weights, ``vocab.txt``) the encoder starts from;
    gates the spec adds start fresh."""
    # SRU
    highway_bias: float = 0.0
    rescale: bool = True
    projection_size: int = 0
    sru_layer_norm: bool = False
    # Question answering's document reader
    rnn: str = "sru"
    """The reader's recurrent layers: ``sru`` (a stack whose last layer alone is read, the SRU paper's B.2) or
    ``lstm`` (DrQA's bi-LSTMs, every layer's output concatenated)."""


@dataclass
class OptimConfig:
    """Optimiser, learning-rate schedule and gradient clipping."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    momentum: float = 0.0
    nesterov: bool = False
    """SGD with Nesterov's momentum (needs ``optim.name=sgd`` and ``optim.momentum`` > 0)."""
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    """Linear and cosine schedules end at ``lr * min_lr_ratio``; the plateau schedule never goes below it."""
    plateau_factor: float = 0.1
    """``schedule=plateau``: multiply the learning rate by this when the validation loss has not improved for
    ``plateau_patience`` evaluations in a row."""
    plateau_patience: int = 1
    clip: float = 0.0
    """Clip gradients to this global L2 norm; 0 turns clipping off."""


@dataclass
class InitConfig:
    """Weight initialisation applied by the trainer; biases always start at zero."""

    scheme: str = "default"
    scale: float = 0.1
    """Half-width ``a`` of uniform(±a), or the std of normal(0, std)."""


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = 1000
    eval_every: int = 200
    eval_windows: int = 0
    """Cap on validation windows at intermediate evaluations (0: the whole split). Final numbers
    always use the whole valid and test splits."""
    log_every: int = 50
    seed: int = 0
    device: str = "auto"
    precision: str = "fp32"
    compile: bool = False
    threads: int = 0
    """CPU threads for torch (0: torch's default)."""
    nonfinite: str = "stop"
    """What to do with a non-finite loss or gradient: ``stop`` or ``skip`` the step."""
    tensorboard: bool = False
    """Also write the log's scalars to ``<run>/tensorboard`` (needs the ``tensorboard`` package)."""
    wandb: bool = False
    """Also send the log's scalars to Weights & Biases (needs the ``wandb`` package; ``WANDB_MODE=offline`` keeps
    them in ``<run>/wandb`` without a network)."""
    wandb_project: str = "gatedformer"
    """The W&B project of ``train.wandb``."""
    grad_accum: int = 1
    """Micro-batches per optimisation step: their gradients add up (weighted by their tokens) before one update."""
    init_from: str = ""
    """A finished run folder (or a ``.safetensors`` file) whose weights a new run starts from, as its task maps them
    (GLUE fine-tuning takes a pretrained encoder and starts its heads fresh)."""


@dataclass
class TranslationConfig:
    """Sequence-to-sequence settings, used when ``data.corpus`` is a translation corpus (``multi30k``)."""

    src_lang: str = "en"
    tgt_lang: str = "de"
    min_freq: int = 2
    max_len: int = 128
    """n: the longest sentence (in tokens, with <bos>/<eos>) the model accepts."""
    label_smoothing: float = 0.1
    max_tokens: int = 0
    """Batch by length up to this many tokens per batch (0: ``data.batch_size`` sentences per batch)."""
    shared_vocab: bool = False
    """One vocabulary for both languages, from both sides of the training split (e.g. joint BPE)."""
    decode: str = "beam"
    beam_size: int = 4
    length_penalty: float = 0.6
    bleu_sentences: int = 0
    """Sentences scored for BLEU at intermediate evaluations (0: the whole valid set)."""
    src_vocab: int = 0
    """Source vocabulary size, specials included: 0 takes every token seen ``min_freq`` times in the training
    split; N keeps the N - 4 most frequent. ``gatedformer params`` uses it as given, without reading data."""
    tgt_vocab: int = 0
    """Target vocabulary size, as ``src_vocab``."""
    train_sentences: int = 0
    """Train on the first N sentence pairs only (0: all), e.g. for quick checks."""


@dataclass
class TokenizerConfig:
    """The WordPiece tokenizer of the BERT tasks (masked LM, GLUE): learned from the training split, or given."""

    vocab_size: int = 30522
    """Tokens of the WordPiece vocabulary learned from the training text, the five specials included."""
    vocab_file: str = ""
    """A given ``vocab.txt`` (one token a line, e.g. bert-base-uncased's) instead of a learned vocabulary."""
    lowercase: bool = True
    min_frequency: int = 2
    """Pieces seen fewer times in the training text are not learned."""


@dataclass
class MaskedLMConfig:
    """Masked language modelling (``data.task=mlm``)."""

    mask_prob: float = 0.15
    """The share of each sequence's tokens chosen for prediction (80 % become [MASK], 10 % a random token, 10 %
    stay)."""
    valid_fraction: float = 0.0
    """0: the corpus's own validation split; above 0: the last such share of the training text is the validation
    split instead (the EAU/GRC paper splits WikiText-103 85/15)."""


@dataclass
class FinetuneConfig:
    """How ``gatedformer finetune`` and the GLUE comparison fine-tune a pretrained run on a GLUE task."""

    tasks: str = "cola sst2 mrpc stsb rte wnli qnli"
    """The GLUE tasks a comparison fine-tunes on (those whose data is present or fetched on first use; with
    ``GATEDFORMER_OFFLINE=1``, those present)."""
    epochs: float = 0.0
    """0: the paper's schedule (3 epochs; CoLA 5, RTE 8); else this many for every task."""
    batch_size: int = 32
    seq_len: int = 512
    """The longest input, ``[CLS] a [SEP] b [SEP]``; longer pairs lose tokens from the longer side."""
    lr: float = 2e-5
    beta2: float = 0.999
    weight_decay: float = 0.01
    evals_per_epoch: int = 1
    max_train_examples: int = 0
    """Train on this many examples of each task, drawn once with a fixed seed (0: all)."""
    max_eval_examples: int = 0
    """Evaluate on this many validation examples, drawn likewise (0: all)."""


@dataclass
class SentClassConfig:
    """Sentence classification (MR, CR, SUBJ, MPQA, TREC, SST) with a recurrent encoder."""

    folds: int = 10
    """Cross-validation folds of the sets without a split (MR, CR, SUBJ, MPQA)."""
    sets: str = "mr cr subj mpqa trec sst"
    """The sets a comparison covers (``compare``: every fold of each, or ``train.seed`` + 0 .. seeds - 1 where a set
    has its own split)."""
    fold: int = 0
    """The fold held out for testing (0-based); of the rest, one more fold validates."""
    word_vectors: str = ""
    """A word2vec or GloVe text file of pretrained vectors; words it lacks start uniform in [-0.25, 0.25]."""
    embedding_dim: int = 300
    """Word vector size without ``word_vectors`` (with them, theirs)."""
    freeze_vectors: bool = True
    """Keep the pretrained vectors fixed (Kim 2014's static vectors)."""
    max_train_examples: int = 0
    """Train on this many examples, drawn once with a fixed seed (0: all; SST's phrases are 77k)."""


@dataclass
class QAConfig:
    """Extractive question answering (SQuAD) with a document reader."""

    word_vectors: str = ""
    """A GloVe or word2vec text file of pretrained vectors; words it lacks start at random."""
    embedding_dim: int = 300
    """Word vector size without ``word_vectors`` (with them, theirs)."""
    tune_top_k: int = 1000
    """With ``word_vectors``: train the vectors of this many most frequent question words only, the rest fixed
    (DrQA's); -1 trains them all. Without vectors every word's trains."""
    max_span: int = 15
    """An answer is the best span of at most this many words after its first (DrQA's ``i <= i' <= i + 15``)."""
    max_articles: int = 0
    """Read only the first N articles of each file (0: all): a small run on a part of SQuAD."""


@dataclass
class RunConfig:
    """Everything that defines one training run."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    init: InitConfig = field(default_factory=InitConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    translation: TranslationConfig = field(default_factory=TranslationConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    mlm: MaskedLMConfig = field(default_factory=MaskedLMConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    sentclass: SentClassConfig = field(default_factory=SentClassConfig)
    qa: QAConfig = field(default_factory=QAConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# The backbones: each model module's build functions register themselves here (``@register_backbone``, at the import
# of gatedformer.models), so this table is the one list of what ``model.backbone`` may name, per task.


@dataclass(frozen=True)
class Backbone:
    """A network a task trains, as its module's build function registers it (``@register_backbone``)."""

    name: str
    """What ``model.backbone`` says."""
    task: str
    """The task it serves (``lm``, ``translation``); one name may serve several tasks, as different networks."""
    build: Callable[..., Any]
    """``build(config: RunConfig, **sizes) -> nn.Module``: the sizes the task knows (``vocab_size``, or
    ``src_vocab`` and ``tgt_vocab``). It reads the ``[model]`` section of the config (and, for translation, the
    ``[translation]`` one)."""
    description: str
    gated: bool = True
    """Whether it has attention/FFN sublayers that a gate spec places gates on."""
    cross_attention: bool = False
    """Whether it is an encoder-decoder (a gate spec then also reaches the decoder's cross-attention)."""
    check: Callable[[ModelConfig], None] | None = None
    """Checks of its own fields beyond :func:`validate`'s (a :class:`ConfigError` naming the field)."""
    fields: tuple[str, ...] = field(kw_only=True)
    """The :class:`ModelConfig` fields its network reads, ``backbone`` aside (its build, its module's checks and its
    task's use of ``[model]``): :func:`validate` refuses any other set away from its default, since the model would
    silently ignore it."""


_BACKBONES: dict[tuple[str, str], Backbone] = {}

_Build = TypeVar("_Build", bound=Callable[..., Any])


def register_backbone(name: str, *, task: str, fields: Sequence[str], description: str, gated: bool = True,
                      cross_attention: bool = False,
                      check: Callable[[ModelConfig], None] | None = None) -> Callable[[_Build], _Build]:
    """A decorator that puts the build function beside it in the table as backbone ``name`` of ``task`` (the
    arguments are :class:`Backbone`'s), at its module's import; it returns the function unchanged."""

    def register(build: _Build) -> _Build:
        _add_backbone(Backbone(name, task, build, description, gated=gated, cross_attention=cross_attention,
                               check=check, fields=tuple(fields)))
        return build

    return register


def _add_backbone(backbone: Backbone) -> None:
    unknown = sorted(set(backbone.fields) - set(_field_types(ModelConfig)))
    if unknown or not backbone.fields:
        raise ValueError(f"backbone {backbone.name!r} must declare the ModelConfig fields it reads (unknown: "
                         f"{unknown})")
    key = (backbone.task, backbone.name)
    if key in _BACKBONES and _BACKBONES[key] != backbone:
        raise ValueError(f"backbone {backbone.name!r} is registered twice for task {backbone.task!r}")
    _BACKBONES[key] = backbone


def backbone_names(task: str = "lm") -> tuple[str, ...]:
    """The backbones registered for ``task``, in registration order."""
    return tuple(name for (owner, name) in _BACKBONES if owner == task)


def get_backbone(name: str, task: str = "lm") -> Backbone:
    """The backbone ``model.backbone=name`` means for ``task``; a :class:`ConfigError` listing the choices if none."""
    backbone = _BACKBONES.get((task, name))
    if backbone is None:
        raise ConfigError(f"model.backbone={name!r} is not one of {', '.join(backbone_names(task))} (the {task} "
                          "models); pick one of them")
    return backbone


def task_of(config: RunConfig) -> str:
    """The task a run is: ``data.task`` where it names one, else the corpus's (``translation`` for a parallel corpus,
    ``glue`` and ``sentclass`` for the classification sets, ``lm`` for every other)."""
    return config.data.task.strip().lower() or corpus_task(config.data.corpus)


TASK_SECTIONS: dict[str, tuple[str, ...]] = {}
"""The task sections each task reads, beside ``[data]``, ``[model]``, ``[optim]``, ``[init]`` and ``[train]``, which
every run reads: :func:`validate` refuses a field of any other task section set away from its default. Each task
declares its own as it registers (``@register_task(name, sections=...)`` in :mod:`gatedformer.tasks`), which calls
:func:`register_task_sections`."""


def register_task_sections(task: str, sections: Sequence[str]) -> None:
    """Record the sections of :class:`RunConfig` that ``task`` reads (:data:`TASK_SECTIONS`)."""
    wrong = sorted(set(sections) - set(_sections()) | set(sections) & {"data", "model", "optim", "init", "train"})
    if wrong:
        raise ValueError(f"task {task!r} declares sections {wrong}, which are not task sections of RunConfig")
    TASK_SECTIONS[task] = tuple(sections)


@dataclass
class Variant:
    """One arm of a comparison: a name, its overrides, and the published number if any."""

    name: str
    overrides: list[str] = field(default_factory=list)
    published: float | None = None
    match_params: str | None = None
    """The name of another variant whose parameter count this one matches by its feed-forward width
    (``model.d_ffn``, within 0.5 %; see :mod:`gatedformer.analysis.matching`): a baseline as large as a gated
    variant, to tell a gate's effect from its size's."""


@dataclass
class Recipe:
    """A named run configuration, plus the variants ``compare`` trains side by side."""

    name: str
    description: str
    config: RunConfig
    variants: list[Variant]
    published_source: str = ""
    published_metric: str = ""


# --------------------------------------------------------------------------------------------
# Typed coercion of strings and TOML values into dataclass fields


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, annotation: Any, key: str) -> Any:
    """Convert ``value`` (a string from the command line or a TOML value) to ``annotation``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
            return None
        return _coerce(value, options[0], key)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key} must be true or false, got {value!r}; write {key}=true or {key}=false")
    if annotation is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a whole number, got {value!r}; write e.g. {key}=3")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value).strip().replace("_", ""))
        except ValueError:
            raise ConfigError(f"{key} must be a whole number, got {value!r}; write e.g. {key}=3") from None
    if annotation is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key} must be a number, got {value!r}; write e.g. {key}=0.1")
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):  # overflow: an integer beyond any float (from JSON)
            raise ConfigError(f"{key} must be a number, got {value!r}; write e.g. {key}=0.1") from None
        if not math.isfinite(number):
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return number
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config field type {annotation!r} for {key}")  # a bug, not user input


def _unknown_key(key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {close[0]}?" if close else f"known keys: {', '.join(known)}"
    return ConfigError(f"unknown config key {key!r}; {hint}")


def _all_keys(config: RunConfig) -> list[str]:
    return [f"{name}.{key}" for name in _sections() for key in _field_types(type(getattr(config, name)))]


def set_value(config: RunConfig, key: str, value: Any) -> None:
    """Set ``section.field`` on ``config`` to ``value``, coerced to the field's type."""
    section_name, _, field_name = key.partition(".")
    section = getattr(config, section_name, None) if section_name in _sections() else None
    if section is None or not field_name or field_name not in _field_types(type(section)):
        raise _unknown_key(key, _all_keys(config))
    annotation = _field_types(type(section))[field_name]
    setattr(section, field_name, _coerce(value, annotation, key))


def _sections() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(RunConfig))


def parse_override(text: str) -> tuple[str, str]:
    """Split ``key=value`` from ``--set``."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key=value, got {text!r}; write e.g. --set model.d_model=256")
    return key.strip(), value.strip()


def apply_overrides(config: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply ``--set key=value`` strings in order (later ones win) and return ``config``."""
    for text in overrides:
        key, value = parse_override(text)
        set_value(config, key, value)
    return config


def config_from_dict(data: dict[str, Any], *, where: str = "config", check: bool = False) -> RunConfig:
    """Build a :class:`RunConfig` from nested dicts (a recipe's TOML or a saved ``config.json``); with ``check``,
    also :func:`validate` it. An error names ``where`` (the file) unless it is ``"config"``."""
    config = RunConfig()
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a table of sections, got {type(data).__name__}")
    try:
        for section_name, values in data.items():
            if section_name not in _sections():
                raise _unknown_key(section_name, list(_sections()))
            if not isinstance(values, dict):
                raise ConfigError(f"[{section_name}] must be a table of key = value lines")
            for field_name, value in values.items():
                set_value(config, f"{section_name}.{field_name}", value)
        if check:
            validate(config)
    except ConfigError as err:
        if where == "config":
            raise
        fix = " (correct it in that file, or restore the file from a copy)" if check else ""
        raise ConfigError(f"{where}: {err}{fix}") from None
    return config


# --------------------------------------------------------------------------------------------
# Validation


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, f"{key}={value!r} is not one of {', '.join(allowed)}; pick one of them")


def _positive(key: str, value: int | float) -> None:
    _check(value > 0, f"{key} must be positive, got {value}; set {key} to a value above 0")


def _dropout(key: str, value: float | None) -> None:
    if value is not None:
        _check(0.0 <= value < 1.0, f"{key} must be in [0, 1), got {value}; e.g. {key}=0.1")


def validate(config: RunConfig) -> RunConfig:
    """Check every value for range and consistency; return ``config`` unchanged if valid."""
    _validate_data(config.data)
    _check_task(config)
    model = config.model
    backbone = get_backbone(model.backbone, task_of(config))
    _validate_model(model, backbone)
    _validate_optim(config.optim)
    _validate_init_and_train(config.init, config.train)

    # The gate spec is checked against the model here so a bad one fails before any data loads.
    placement = resolve_placement(model.gates, model.n_layers, cross_attention=backbone.cross_attention)
    _check(backbone.gated or placement.is_empty(),
           f"model.backbone={model.backbone} has no attention/FFN sublayers to gate; use a Transformer backbone or "
           "clear model.gates")
    if task_of(config) in ("mlm", "glue", "sentclass"):
        _validate_text_tasks(config)
    if task_of(config) == "qa":
        _validate_qa(config.qa)
    if task_of(config) == "translation":
        _validate_translation(config)
    else:
        _check(not model.share_embeddings, "model.share_embeddings shares a translation model's source and target "
               "embeddings; a language model has one embedding (model.tie_embeddings ties it to the output)")
    _refuse_unread(config, backbone)
    return config


def _validate_data(data: DataConfig) -> None:
    _check(bool(data.corpus.strip()), "data.corpus is empty; name a corpus, e.g. --data ptb-char")
    for key in ("batch_size", "seq_len", "eval_batch_size"):
        _positive(f"data.{key}", getattr(data, key))
    _check(data.eval_seq_len >= 0, "data.eval_seq_len must be 0 (same as seq_len) or positive")


def _validate_model(model: ModelConfig, backbone: Backbone) -> None:
    # Only the fields the backbone reads are checked for range here; any other set at all is refused below.
    reads = set(backbone.fields)
    for key in ("d_model", "n_layers", "n_heads", "d_ffn"):
        if key in reads:
            _positive(f"model.{key}", getattr(model, key))
    _check(
        "n_heads" not in reads or model.d_model % model.n_heads == 0,
        f"model.d_model={model.d_model} is not divisible by model.n_heads={model.n_heads}; "
        "pick a head count that divides d_model",
    )
    for key in ("dropout", "emb_dropout", "attn_dropout"):
        _dropout(f"model.{key}", getattr(model, key))
    _one_of("model.norm", model.norm, ("post", "pre"))
    _one_of("model.ffn", model.ffn, ("relu", "gelu", "glu"))
    _one_of("model.rnn_type", model.rnn_type, ("gru", "lstm", "rnn"))
    _positive("model.rnn_window", model.rnn_window)
    _check(model.mem_len >= 0, "model.mem_len must be 0 (no memory) or positive")
    _positive("model.kernel_size", model.kernel_size)
    _check(model.bottleneck >= 0, "model.bottleneck must be 0 (off) or positive")
    _check(model.projection_size >= 0, "model.projection_size must be 0 (off) or positive")
    _check(model.out_dim >= 0, "model.out_dim must be 0 (model.d_model) or positive")
    if backbone.check is not None:
        backbone.check(model)


def _validate_optim(optim: OptimConfig) -> None:
    _one_of("optim.name", optim.name, OPTIMIZERS)
    _positive("optim.lr", optim.lr)
    _check(optim.weight_decay >= 0, "optim.weight_decay must be >= 0")
    for key in ("beta1", "beta2"):
        _check(0.0 <= getattr(optim, key) < 1.0, f"optim.{key} must be in [0, 1)")
    _check(optim.momentum >= 0, "optim.momentum must be >= 0")
    _check(not optim.nesterov or (optim.name == "sgd" and optim.momentum > 0),
           "optim.nesterov=true needs optim.name=sgd and optim.momentum > 0; e.g. optim.momentum=0.99")
    _check(0.0 < optim.plateau_factor < 1.0,
           f"optim.plateau_factor must be in (0, 1), got {optim.plateau_factor}; e.g. optim.plateau_factor=0.1")
    _check(optim.plateau_patience >= 1,
           f"optim.plateau_patience must be at least 1 evaluation, got {optim.plateau_patience}")
    _one_of("optim.schedule", optim.schedule, SCHEDULES)
    _check(optim.warmup_steps >= 0, "optim.warmup_steps must be >= 0")
    _check(
        optim.schedule != "noam" or optim.warmup_steps > 0,
        "optim.schedule=noam needs optim.warmup_steps > 0; set e.g. optim.warmup_steps=400",
    )
    _check(0.0 <= optim.min_lr_ratio <= 1.0, "optim.min_lr_ratio must be in [0, 1]")
    _check(optim.clip >= 0, "optim.clip must be >= 0 (0 turns clipping off)")


def _validate_init_and_train(init: InitConfig, train: TrainConfig) -> None:
    _one_of("init.scheme", init.scheme, INIT_SCHEMES)
    _positive("init.scale", init.scale)

    _positive("train.steps", train.steps)
    _positive("train.eval_every", train.eval_every)
    _check(train.eval_windows >= 0, "train.eval_windows must be 0 (whole split) or positive")
    _positive("train.log_every", train.log_every)
    _positive("train.grad_accum", train.grad_accum)
    _check(0 <= train.threads <= MAX_THREADS,
           f"train.threads={train.threads} must be 0 (torch's default) or 1 to {MAX_THREADS}")
    # Seeds reach torch.manual_seed plus per-rank and per-seed offsets: keep them well inside 64 bits.
    _check(0 <= train.seed < 2**32, f"train.seed={train.seed} must be in 0 .. {2**32 - 1}")
    _check(
        train.device == "auto" or train.device == "cpu" or train.device.startswith("cuda"),
        f"train.device={train.device!r} is not auto, cpu or cuda[:N]",
    )
    _one_of("train.precision", train.precision, ("fp32", "bf16", "fp16"))
    _one_of("train.nonfinite", train.nonfinite, ("stop", "skip"))


def _refuse_unread(config: RunConfig, backbone: Backbone) -> None:
    """A field set away from its default where nothing reads it would leave the user believing the run changed."""
    task = task_of(config)
    reads = ("backbone", *backbone.fields)
    for name, default in dataclasses.asdict(ModelConfig()).items():
        value = getattr(config.model, name)
        if name in reads or value == default:
            continue
        others = [b.name for (owner, _), b in _BACKBONES.items() if owner == task and name in b.fields]
        instead = f", or pick a backbone that reads it ({', '.join(others)})" if others else ""
        raise ConfigError(f"model.{name}={value!r} does nothing: model.backbone={backbone.name} reads only "
                          f"{', '.join(f'model.{key}' for key in reads)}; drop model.{name}{instead}")
    own = TASK_SECTIONS[task]
    task_sections = {section for sections in TASK_SECTIONS.values() for section in sections}
    for section in _sections():
        if section not in task_sections or section in own:
            continue
        values = getattr(config, section)
        for name, default in dataclasses.asdict(type(values)()).items():
            value = getattr(values, name)
            if value == default:
                continue
            readers = " and ".join(t for t, sections in TASK_SECTIONS.items() if section in sections)
            read = ", ".join(f"[{s}]" for s in _sections() if s not in task_sections or s in own)
            raise ConfigError(f"{section}.{name}={value!r} does nothing: this {task} run (data.corpus="
                              f"{config.data.corpus}) reads only {read}, and [{section}] is read by {readers} runs; "
                              f"drop {section}.{name}")


def _check_task(config: RunConfig) -> None:
    """``data.task`` must be empty, the corpus's own task, or a task that reads a language-model corpus's text."""
    task, own = config.data.task.strip().lower(), corpus_task(config.data.corpus)
    if not task or task == own:
        return
    _check(task in text_tasks() and own == "lm",
           f"data.task={config.data.task!r} does not apply to corpus {config.data.corpus} (a {own} corpus); leave "
           f"data.task empty, or set data.task=mlm on a language-model corpus such as wikitext2")


def _validate_text_tasks(config: RunConfig) -> None:
    tk, mlm, ft, sc = config.tokenizer, config.mlm, config.finetune, config.sentclass
    _check(tk.vocab_size > 5, f"tokenizer.vocab_size={tk.vocab_size} leaves no room beside the five special tokens; "
           "raise it, e.g. tokenizer.vocab_size=8000")
    _positive("tokenizer.min_frequency", tk.min_frequency)
    _check(0.0 < mlm.mask_prob < 1.0, f"mlm.mask_prob must be in (0, 1), got {mlm.mask_prob}; BERT's is 0.15")
    _check(0.0 <= mlm.valid_fraction < 1.0,
           f"mlm.valid_fraction must be in [0, 1) (0: the corpus's validation split), got {mlm.valid_fraction}")
    _check(ft.epochs >= 0, "finetune.epochs must be 0 (the paper's schedule) or positive")
    for key in ("batch_size", "seq_len", "lr", "evals_per_epoch"):
        _positive(f"finetune.{key}", getattr(ft, key))
    _check(ft.seq_len >= 3, f"finetune.seq_len={ft.seq_len} leaves no room beside [CLS] and [SEP]; raise it")
    _check(0.0 <= ft.beta2 < 1.0, "finetune.beta2 must be in [0, 1)")
    _check(ft.weight_decay >= 0, "finetune.weight_decay must be >= 0")
    for key in ("max_train_examples", "max_eval_examples"):
        _check(getattr(ft, key) >= 0, f"finetune.{key} must be 0 (all) or positive")
    _check(sc.folds >= 2, f"sentclass.folds={sc.folds}: cross-validation needs at least 2 folds")
    _check(0 <= sc.fold < sc.folds, f"sentclass.fold={sc.fold} is not one of the folds 0 .. {sc.folds - 1}")
    _positive("sentclass.embedding_dim", sc.embedding_dim)
    _check(sc.max_train_examples >= 0, "sentclass.max_train_examples must be 0 (all) or positive")
    if task_of(config) in ("mlm", "glue"):
        _check(config.data.seq_len >= 3, f"data.seq_len={config.data.seq_len} leaves no room beside [CLS] and "
               "[SEP]; raise it")
        _check(config.data.seq_len <= config.model.max_positions and config.data.eval_seq_len
               <= config.model.max_positions,
               f"data.seq_len={config.data.seq_len} is longer than the model's model.max_positions="
               f"{config.model.max_positions}; lower data.seq_len or raise model.max_positions")


def _validate_qa(qa: QAConfig) -> None:
    _positive("qa.embedding_dim", qa.embedding_dim)
    _check(qa.tune_top_k >= -1, f"qa.tune_top_k={qa.tune_top_k}: give -1 (tune every vector) or how many to tune")
    _check(qa.max_span >= 0, f"qa.max_span={qa.max_span} must be 0 (one-word answers) or more")
    _check(qa.max_articles >= 0, "qa.max_articles must be 0 (all) or positive")


def _validate_translation(config: RunConfig) -> None:
    from gatedformer.data.translation import check_pair

    tr = config.translation
    check_pair(tr.src_lang, tr.tgt_lang, config.data.corpus)
    _check(tr.max_len >= 3, f"translation.max_len={tr.max_len} leaves no room between <bos> and <eos>; raise it")
    _positive("translation.min_freq", tr.min_freq)
    _check(0.0 <= tr.label_smoothing < 1.0, "translation.label_smoothing must be in [0, 1)")
    _one_of("translation.decode", tr.decode, ("greedy", "beam"))
    _positive("translation.beam_size", tr.beam_size)
    _check(tr.length_penalty >= 0, "translation.length_penalty must be >= 0 (0: no length normalisation)")
    for key in ("max_tokens", "bleu_sentences", "train_sentences"):
        _check(getattr(tr, key) >= 0, f"translation.{key} must be 0 (off / all) or positive")
    for key in ("src_vocab", "tgt_vocab"):
        value = getattr(tr, key)
        _check(value == 0 or value > 4, f"translation.{key} must be 0 (from the data) or above 4 (the specials)")
    _check(not config.model.share_embeddings or tr.shared_vocab,
           "model.share_embeddings needs one vocabulary for both languages; set translation.shared_vocab=true")
    _check(not tr.shared_vocab or tr.src_vocab == tr.tgt_vocab,
           f"translation.shared_vocab=true makes one vocabulary, but translation.src_vocab={tr.src_vocab} and "
           f"translation.tgt_vocab={tr.tgt_vocab} differ; give both the same size")


# --------------------------------------------------------------------------------------------
# Recipes


def recipe_names() -> list[str]:
    """The recipes shipped with the package."""
    folder = resources.files("gatedformer") / "recipes"
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def _read_recipe_text(name: str) -> tuple[str, str]:
    try:
        return _read_recipe_file(name)
    except OSError as err:  # e.g. a name too long for the file system, or a file we may not read
        raise ConfigError(f"cannot read recipe {name!r} ({err.strerror or err}); give a recipe name or a path to "
                          "a readable .toml file") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"recipe file {name!r} is not UTF-8 text (byte offset {err.start}); save it as UTF-8") \
            from None


def _read_recipe_file(name: str) -> tuple[str, str]:
    path = Path(name)
    if name.endswith(".toml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"recipe file {name} does not exist; give a path to a .toml recipe")
        return path.stem, path.read_text(encoding="utf-8")
    folder = resources.files("gatedformer") / "recipes"
    candidate = folder / f"{name}.toml"
    if not candidate.is_file():
        close = difflib.get_close_matches(name, recipe_names(), n=1)
        hint = f"did you mean {close[0]}?" if close else f"known recipes: {', '.join(recipe_names())}"
        raise ConfigError(f"unknown recipe {name!r}; {hint}")
    return name, candidate.read_text(encoding="utf-8")


def load_recipe(name: str) -> Recipe:
    """Load a recipe by name (shipped) or path (a user's own TOML file)."""
    recipe_name, text = _read_recipe_text(name)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"recipe {recipe_name} is not valid TOML ({err}); fix the file") from None
    description = str(raw.pop("description", ""))
    published_source = str(raw.pop("published_source", ""))
    published_metric = str(raw.pop("published_metric", ""))
    raw_variants = raw.pop("variants", [])
    if not isinstance(raw_variants, list):
        raise ConfigError(f"recipe {recipe_name}: variants must be [[variants]] tables, got {raw_variants!r}")
    config = config_from_dict(raw, where=f"recipe {recipe_name}")
    variants = []
    for i, entry in enumerate(raw_variants):
        if not isinstance(entry, dict) or "name" not in entry:
            raise ConfigError(f"recipe {recipe_name}: variant {i + 1} needs a name")
        unknown = set(entry) - {"name", "set", "published", "match_params"}
        if unknown:
            raise ConfigError(f"recipe {recipe_name}: variant {entry['name']!r} has unknown keys {sorted(unknown)}")
        overrides = entry.get("set", [])
        if isinstance(overrides, str):
            overrides = [overrides]
        if not isinstance(overrides, list):
            raise ConfigError(f"recipe {recipe_name}: variant {entry['name']!r} needs set = [\"key=value\", ...], "
                              f"got {overrides!r}")
        published = entry.get("published")
        if published is not None and (isinstance(published, bool) or not isinstance(published, int | float)):
            raise ConfigError(f"recipe {recipe_name}: variant {entry['name']!r} has published = {published!r}; "
                              "write the published number, e.g. published = 1.37")
        match = entry.get("match_params")
        if match is not None and not isinstance(match, str):
            raise ConfigError(f"recipe {recipe_name}: variant {entry['name']!r} has match_params = {match!r}; name "
                              "the variant whose parameter count it matches, e.g. match_params = \"+σ SDU\"")
        variants.append(Variant(str(entry["name"]), [str(o) for o in overrides],
                                None if published is None else float(published), match))
    if not variants:
        variants = [Variant("baseline")]
    names = [v.name for v in variants]
    for variant in variants:
        if variant.match_params is not None and (variant.match_params not in names
                                                 or variant.match_params == variant.name):
            raise ConfigError(f"recipe {recipe_name}: variant {variant.name!r} matches the parameters of "
                              f"{variant.match_params!r}, which is not another of its variants ({', '.join(names)})")
    return Recipe(recipe_name, description, config, variants, published_source, published_metric)


def check_overrides_spare_variants(recipe: Recipe, overrides: list[str]) -> None:
    """Refuse a ``--set`` of a field that the recipe's variants set themselves.

    The user's overrides apply after each variant's, so such a ``--set`` would give every variant the same
    value while its row kept the variant's name (a "baseline" row carrying gates, say).
    """
    owner: dict[str, str] = {}
    for variant in recipe.variants:
        for text in variant.overrides:
            owner.setdefault(parse_override(text)[0], variant.name)
    for text in overrides:
        key = parse_override(text)[0]
        if key in owner:
            raise ConfigError(
                f"--set {key} would replace what variant {owner[key]!r} of {recipe.name} sets, and every row would "
                f"carry it under its own name; to compare other values of {key}, write them as [[variants]] in a "
                "recipe file and pass it with --recipe FILE")


def build_config(recipe: Recipe, overrides: list[str] | None = None, variant: Variant | None = None) -> RunConfig:
    """The validated config of ``recipe``, with a variant's overrides and then the user's applied."""
    config = config_from_dict(recipe.config.to_dict())
    if variant is not None:
        apply_overrides(config, variant.overrides)
    apply_overrides(config, overrides or [])
    return validate(config)
