"""What the gated-attention papers measure, for one run: the attention sink, the massive activations, the gate
scores' sparsity and the loss spikes (Qiu et al. 2025, "Gated Attention for Large Language Models: Non-linearity,
Sparsity, and Attention-Sink-Free", §4 and its figures; the massive activations as Sun et al. 2024 define them).

- **attention-sink share**: per layer (and attention: self, cross, encoder), the mean attention weight that a query
  puts on the first key, over every head and every real query of a validation batch. Attention spread evenly over
  the keys a causal query sees would give ``H(L)/L`` (``H`` the harmonic number; 4.2 % at ``L = 128``); a sink takes
  far more;
- **largest activation**: per layer, the largest ``|h|`` of the hidden state that layer hands on (its output);
- **gate-score sparsity**: per gate and layer, the mean gate score and the share of scores under 0.1, for the gates
  whose scores lie in [0, 1] (the σ of the SDU, the highway gate's and gated MHDPA's T, the GRC's σ, the EAU's
  evaluator, the attention output gate's σ(X W_θ): every unit of the gate table with a ``gate_activation``); a tanh
  SDU's scores are not a share;
- **loss spikes**: the ``train`` records of ``log.jsonl`` whose loss exceeds :data:`SPIKE_FACTOR` times the mean of
  the :data:`SPIKE_WINDOW` records before it.

The first three come from forward hooks on the model as it reads a small batch of the run's validation data
(:data:`MEASURE_ROWS` sequences), the model unfused (:func:`gatedformer.fused.unfuse`) so that every attention body
runs its reference forward: the attention weights are worked out from each attention sublayer's input (its body's,
``LN(X)`` pre-LN) and the attention's own query and key projections, as its forward computes them, so an attention
output gate, which runs the body's parts apart, is measured as well; the model is not changed. The figures need
matplotlib.
"""

from __future__ import annotations

import inspect
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gatedformer.errors import ConfigError, DataError, GatedformerError
from gatedformer.train.runlog import read_log, series

SPIKE_FACTOR = 1.25
"""A ``train`` record is a loss spike when its loss exceeds this many times the running mean before it."""
SPIKE_WINDOW = 10
"""The running mean is over this many ``train`` records before the one judged."""
SPARSE_BELOW = 0.1
"""A gate score under this counts as closed (the gated-attention paper's threshold)."""
MEASURE_ROWS = 4
"""Validation sequences the hooks read."""
MEASURED_TASKS = ("lm", "mlm", "translation")
"""The tasks whose validation data :func:`measure_run` reads (the others' models are measured by their loss alone)."""

_SUBLAYERS = {"attn": "attention", "self_attn": "attention", "cross_attn": "cross-attention"}


@dataclass
class Spike:
    """A ``train`` record whose loss rose above :data:`SPIKE_FACTOR` times its running mean."""

    step: int
    loss: float
    running_mean: float

    @property
    def ratio(self) -> float:
        return self.loss / self.running_mean


@dataclass
class RunMeasurements:
    """One run's measurements; each ``{site: [value per layer]}`` (``nan`` where a layer has no such site)."""

    run_dir: Path
    sink: dict[str, list[float]] = field(default_factory=dict)
    """Per attention site (``attention``, ``decoder cross-attention``), the mean weight on the first key."""
    max_activation: dict[str, list[float]] = field(default_factory=dict)
    """Per stack of layers (``""`` for a model of one stack), the largest ``|h|`` of each layer's output."""
    gate_mean: dict[str, list[float]] = field(default_factory=dict)
    """Per gate site (``attention (SDU)``), the mean gate score of each layer."""
    gate_sparse: dict[str, list[float]] = field(default_factory=dict)
    """Per gate site, the share of each layer's scores under :data:`SPARSE_BELOW`."""
    spikes: list[Spike] = field(default_factory=list)
    losses: tuple[list[float], list[float]] = ([], [])
    """``(steps, train losses)`` of the run's log, which :attr:`spikes` were found in."""
    query_length: int = 0
    """Positions of the measured sequences (the uniform-attention reference depends on it)."""
    notes: list[str] = field(default_factory=list)

    @property
    def has_attention(self) -> bool:
        return bool(self.sink)


# ---------------------------------------------------------------------------------------------
# Loss spikes


def check_spike_factor(factor: float) -> float:
    """``factor`` where it is a loss-spike factor (a finite number above 1), else a :class:`ConfigError`."""
    if not math.isfinite(factor) or factor <= 1.0:
        raise ConfigError(f"--spike-factor must be a number above 1, got {factor}; e.g. {SPIKE_FACTOR}")
    return factor


def loss_spikes(steps: list[float], losses: list[float], factor: float = SPIKE_FACTOR,
                window: int = SPIKE_WINDOW) -> list[Spike]:
    """The records whose loss exceeds ``factor`` times the mean of the ``window`` records before it."""
    check_spike_factor(factor)
    found = []
    for i in range(1, len(losses)):
        before = losses[max(0, i - window): i]
        mean = statistics.fmean(before)
        if mean > 0 and losses[i] > factor * mean:
            found.append(Spike(int(steps[i]), float(losses[i]), float(mean)))
    return found


def run_losses(run_dir: str | Path) -> tuple[list[float], list[float]]:
    """``(steps, train losses)`` of a run's ``log.jsonl`` (the finite ones)."""
    return series(read_log(run_dir), "train", "train_loss")


# ---------------------------------------------------------------------------------------------
# Where a module sits


def _site(name: str) -> tuple[str, int, str] | None:
    """``(stack, layer, sublayer)`` of a module name such as ``decoder_layers.1.cross_attn.body``; ``None`` outside a
    numbered stack of layers."""
    parts = name.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    if index is None:
        return None
    stack = ".".join(parts[:index])
    for suffix in ("_layers", ".layers", "layers"):
        if stack.endswith(suffix):
            stack = stack[: -len(suffix)]
            break
    return stack, int(parts[index]), ".".join(parts[index + 1:]).removesuffix(".body")


def _label(stack: str, sublayer: str) -> str:
    words = [stack] if stack else []
    return " ".join([*words, _SUBLAYERS.get(sublayer, sublayer or "block")])


# ---------------------------------------------------------------------------------------------
# Attention weights, from an attention module's inputs


def _softmax(scores: Tensor, allowed: Tensor | None) -> Tensor:
    scores = scores.float()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -math.inf)
    return scores.softmax(dim=-1)


def _causal(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """True where query ``i`` (the last ``q_len`` of ``k_len`` positions) may see key ``j``."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)


def _split_heads(t: Tensor, heads: int) -> Tensor:
    batch, length, width = t.shape
    return t.view(batch, length, heads, width // heads).transpose(1, 2)


def _attention_classes() -> tuple[type[nn.Module], ...]:
    from gatedformer.models.convs2s import MultiStepAttention
    from gatedformer.models.seq2seq import CrossAttention, SelfAttention
    from gatedformer.models.transformer_xl import RelativeMultiHeadAttention
    from gatedformer.nn.attention import BidirectionalSelfAttention, CausalSelfAttention

    return (MultiStepAttention, RelativeMultiHeadAttention, CrossAttention, SelfAttention, CausalSelfAttention,
            BidirectionalSelfAttention)


def attention_weights(module: nn.Module, arguments: dict[str, Any], output: Any) -> tuple[Tensor, Tensor] | None:
    """The attention weights ``(B, H, Lq, Lk)`` a call of ``module`` (an attention of one of the package's models)
    averaged its values with, before dropout, and which query rows ``(B, Lq)`` are real tokens; ``None`` for a module
    that is not an attention, or an incremental-decoding call (one with a cache)."""
    from gatedformer.models.convs2s import MultiStepAttention
    from gatedformer.models.seq2seq import CrossAttention, SelfAttention
    from gatedformer.models.transformer_xl import RelativeMultiHeadAttention
    from gatedformer.nn.attention import BidirectionalSelfAttention, CausalSelfAttention

    if arguments.get("cache") is not None:
        return None
    if isinstance(module, MultiStepAttention):  # ConvS2S's one attention per decoder layer returns its weights
        weights = output[1].float().unsqueeze(1)
        return weights, torch.ones(weights.shape[0], weights.shape[2], dtype=torch.bool, device=weights.device)
    if isinstance(module, RelativeMultiHeadAttention):
        h = arguments["h"]
        weights = module.scores(h, arguments["memory"], arguments["pos"]).float().softmax(dim=-1)
        return weights, torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)
    if isinstance(module, CrossAttention):
        x, mask = arguments["x"], arguments["memory_mask"]
        weights = module.probabilities(x, arguments["memory"], mask)
        return weights, torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    if isinstance(module, CausalSelfAttention | BidirectionalSelfAttention | SelfAttention):
        x = arguments["x"]
        context = arguments.get("context")
        width = x.shape[-1]
        if context is None:
            q, k, _ = module.qkv(x).chunk(3, dim=-1)
        else:  # BERT's last layer may ask for a few query rows against every key
            q = nn.functional.linear(x, module.qkv.weight[:width], module.qkv.bias[:width])
            k = nn.functional.linear(context, module.qkv.weight[width: 2 * width],
                                     module.qkv.bias[width: 2 * width])
        q, k = _split_heads(q, module.n_heads), _split_heads(k, module.n_heads)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        key_mask = arguments.get("key_mask")
        allowed = None if key_mask is None else key_mask[:, None, None, :]
        if isinstance(module, CausalSelfAttention) or arguments.get("causal"):
            causal = _causal(q.shape[2], k.shape[2], x.device)
            allowed = causal if allowed is None else allowed & causal
        rows = key_mask if key_mask is not None and context is None else torch.ones(
            x.shape[:2], dtype=torch.bool, device=x.device)
        return _softmax(scores, allowed), rows
    return None


# ---------------------------------------------------------------------------------------------
# Hooks


class _Accumulator:
    """Sums per (site, layer), turned into per-layer lists."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, int], list[float]] = {}

    def add(self, site: str, layer: int, *values: float) -> None:
        slot = self.values.setdefault((site, layer), [0.0] * len(values))
        for i, value in enumerate(values):
            slot[i] += value

    def per_layer(self, combine: Callable[[list[float]], float]) -> dict[str, list[float]]:
        layers: dict[str, dict[int, float]] = {}
        for (site, layer), slot in self.values.items():
            layers.setdefault(site, {})[layer] = combine(slot)
        return {site: [found.get(i, math.nan) for i in range(max(found) + 1)] for site, found in layers.items()}


def _score_gate(module: nn.Module) -> bool:
    """Whether ``module`` is a gate unit of the table whose scores lie in [0, 1]: it offers ``gate_activation`` (its
    scores for its first input), and is not a tanh SDU (whose scores lie in (-1, 1))."""
    from gatedformer.gates.kinds import kind_of

    return (kind_of(module) is not None and callable(getattr(module, "gate_activation", None))
            and getattr(module, "gate", "sigmoid") != "tanh")


def _attention_call(module: nn.Module, args: tuple, kwargs: dict) -> tuple[nn.Module, dict[str, Any]]:
    """The attention and the arguments of its forward that a call of ``module`` made (or, for a
    :class:`~gatedformer.nn.sublayer.Sublayer`, would make: its body on ``LN(X)`` pre-LN, ``X`` post-LN)."""
    from gatedformer.nn.sublayer import Sublayer

    if isinstance(module, Sublayer):
        x, *body_args = args
        h = module.norm(x) if module.pre_norm else x
        module, args = module.body, (h, *body_args)
    return module, dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)


class MeasurementHooks:
    """Forward hooks on a model's attentions, layers and gates that accumulate the measurements of every forward
    pass inside ``with hooks:``."""

    def __init__(self, model: nn.Module) -> None:
        from gatedformer.analysis.gates import parse_site

        self.model = model
        self.sink = _Accumulator()
        self.peak = _Accumulator()
        self.gates = _Accumulator()
        self.query_length = 0
        self._handles: list[Any] = []
        self._plan: list[tuple[nn.Module, Callable[..., None]]] = []
        stacks = {s[0] for name, _ in model.named_modules() if (s := _site(name)) is not None}
        one_stack = len(stacks) <= 1  # "layers" alone, or BERT's "bert.layers": no stack worth naming
        from gatedformer.models.convs2s import MultiStepAttention
        from gatedformer.nn.sublayer import Sublayer

        attentions = _attention_classes()
        for name, module in model.named_modules():
            where = _site(name)
            if where is None:
                continue
            stack, layer, sublayer = where
            stack = "" if one_stack else stack
            if isinstance(module, Sublayer) and isinstance(module.body, attentions):
                # On the sublayer, not its body: a sublayer with an attention output gate runs the body's features
                # and output projection apart, never its forward.
                self._plan.append((module, self._sink_hook(_label(stack, sublayer), layer)))
            elif isinstance(module, MultiStepAttention):  # ConvS2S's, in no sublayer; it returns its weights
                self._plan.append((module, self._sink_hook(_label(stack, sublayer), layer)))
            elif isinstance(module, attentions):
                continue  # measured from its sublayer
            elif _score_gate(module):
                panel = parse_site(name).panel
                self._plan.append((module, self._gate_hook(_strip_stack(panel) if one_stack else panel, layer)))
            elif not sublayer and name.split(".")[-1].isdigit():  # a layer of a stack: its output is the hidden state
                self._plan.append((module, self._peak_hook(stack, layer)))

    def _sink_hook(self, site: str, layer: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            found = attention_weights(*_attention_call(module, args, kwargs), output)
            if found is None:
                return
            weights, rows = found
            first = weights[..., 0].mean(dim=1)  # (B, Lq): every head alike
            real = rows.to(first.dtype)
            self.sink.add(site, layer, float((first * real).sum()), float(real.sum()))
            self.query_length = max(self.query_length, weights.shape[-2])

        return hook

    def _peak_hook(self, stack: str, layer: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            hidden = output if isinstance(output, Tensor) else next(
                (t for t in output if isinstance(t, Tensor)), None) if isinstance(output, tuple | list) else None
            if hidden is not None and hidden.is_floating_point() and hidden.numel():
                slot = self.peak.values.setdefault((stack, layer), [0.0])
                slot[0] = max(slot[0], float(hidden.detach().abs().max()))

        return hook

    def _gate_hook(self, site: str, layer: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not args:
                return
            scores = module.gate_activation(args[0]).float()
            self.gates.add(site, layer, float(scores.sum()), float((scores < SPARSE_BELOW).sum()),
                           float(scores.numel()))

        return hook

    def __enter__(self) -> MeasurementHooks:
        self._handles = [module.register_forward_hook(hook, with_kwargs=True) for module, hook in self._plan]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def fill(self, result: RunMeasurements) -> RunMeasurements:
        """``result`` with what the hooks accumulated."""
        result.sink = self.sink.per_layer(lambda s: s[0] / s[1] if s[1] else math.nan)
        result.max_activation = self.peak.per_layer(lambda s: s[0])
        result.gate_mean = self.gates.per_layer(lambda s: s[0] / s[2] if s[2] else math.nan)
        result.gate_sparse = self.gates.per_layer(lambda s: s[1] / s[2] if s[2] else math.nan)
        result.query_length = self.query_length
        return result


def _strip_stack(panel: str) -> str:
    """A gate panel's name without the stack of a one-stack model (``bert attention (SDU)`` -> ``attention (SDU)``)."""
    for sublayer in ("attention", "cross-attention", "FFN", "block"):
        at = panel.find(sublayer)
        if at > 0:
            return panel[at:]
    return panel


# ---------------------------------------------------------------------------------------------
# A run's validation batch


def _lm_batch(run: Any, corpus: Any) -> Callable[[nn.Module], Any]:
    from gatedformer.data import LMStream

    config = run.config
    valid = corpus.valid
    rows = max(1, min(MEASURE_ROWS, config.data.eval_batch_size))
    length = max(1, min(config.data.eval_seq_len, (len(valid) - 1) // rows))
    x, _ = LMStream(valid, rows, length, split="valid").window(0)
    return lambda model: model(x.to(_device(model)))


def _mlm_batch(run: Any, data_dir: str | Path | None) -> Callable[[nn.Module], Any]:
    data = run.task.load_data(run.config, data_dir)
    windows = data.valid[:MEASURE_ROWS]
    pad = data.tokenizer.pad_id

    def forward(model: nn.Module) -> Any:
        tokens = windows.to(_device(model))
        mask = tokens != pad
        return model(tokens, None, None if bool(mask.all()) else mask)

    return forward


def _translation_batch(run: Any, data_dir: str | Path | None) -> Callable[[nn.Module], Any]:
    from gatedformer.data.translation import collate
    from gatedformer.tasks.translation import load_data

    split = load_data(run.config, data_dir).valid
    src, tgt_in, _ = collate(split, list(range(min(MEASURE_ROWS, len(split)))))
    return lambda model: model(src.to(_device(model)), tgt_in.to(_device(model)))


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def measure_model(model: nn.Module, forward: Callable[[nn.Module], Any], result: RunMeasurements) -> RunMeasurements:
    """Fill ``result`` with the hooks' measurements of ``model`` (unfused, in evaluation mode, for this call) as
    ``forward(model)`` runs it once."""
    from gatedformer.fused import unfuse

    unfuse(model)
    model.eval()
    hooks = MeasurementHooks(model)
    with torch.no_grad(), hooks:
        forward(model)
    return hooks.fill(result)


def measure_run(run_dir: str | Path, data_dir: str | Path | None = None, corpus: Any = None,
                spike_factor: float = SPIKE_FACTOR, device: str = "cpu",
                batches: dict[str, Callable[[nn.Module], Any]] | None = None) -> RunMeasurements:
    """The measurements of the run in ``run_dir``: the loss spikes of its log, and, for a language-model, masked-LM
    or translation run with weights, the hooks' measurements on a batch of its validation split (``corpus``: a
    language model's corpus already read, as ``compare`` shares it; ``batches``: the validation batches read so far,
    by the data settings that gave them, which the runs of one comparison share rather than each reading its corpus).
    What cannot be measured is said in ``notes``."""
    from gatedformer.runs import load_trained

    run_dir = Path(run_dir)
    result = RunMeasurements(run_dir)
    steps, losses = run_losses(run_dir)
    result.losses = (steps, losses)
    result.spikes = loss_spikes(steps, losses, spike_factor)
    try:
        run = load_trained(run_dir, data_dir, device)
    except GatedformerError as err:
        result.notes.append(f"attention, activation and gate measurements skipped: {err}")
        return result
    if run.task.name not in MEASURED_TASKS:
        result.notes.append(f"attention, activation and gate measurements read language-model, masked-LM and "
                            f"translation runs; {run_dir} is a {run.task.title} run")
        return result
    corpus = corpus if corpus is not None else run.data
    if run.task.name == "lm" and not len(getattr(corpus, "valid", ())):
        result.notes.append(f"{run_dir}: no validation text to measure on (read the corpus: pass --data-dir)")
        return result
    # Everything but the network and its training decides the batch
    settings = {k: v for k, v in run.config.to_dict().items() if k not in ("model", "optim", "init", "train")}
    key = json.dumps(settings, sort_keys=True, default=str)
    batches = {} if batches is None else batches
    try:
        if key not in batches:
            if run.task.name == "lm":
                batches[key] = _lm_batch(run, corpus)
            elif run.task.name == "mlm":
                batches[key] = _mlm_batch(run, data_dir)
            else:
                batches[key] = _translation_batch(run, data_dir)
        forward = batches[key]
    except (DataError, ConfigError) as err:
        result.notes.append(f"attention, activation and gate measurements skipped: {err}")
        return result
    return measure_model(run.model, forward, result)


def uniform_sink(length: int) -> float:
    """The mean weight on the first key of causal attention spread evenly: ``H(L) / L``."""
    return sum(1.0 / (i + 1) for i in range(length)) / length if length else math.nan


# ---------------------------------------------------------------------------------------------
# Tables and figures


def mean_over_seeds(runs: list[RunMeasurements], quantity: str) -> dict[str, list[float]]:
    """``quantity`` (``sink``, ``max_activation``, ``gate_mean``, ``gate_sparse``) per site and layer, the mean over
    the runs that measured it (a variant's seeds)."""
    sites: dict[str, list[list[float]]] = {}
    for run in runs:
        for site, values in getattr(run, quantity).items():
            sites.setdefault(site, []).append(values)
    out = {}
    for site, rows in sites.items():
        width = max(len(r) for r in rows)
        out[site] = [_nanmean([r[i] for r in rows if i < len(r)]) for i in range(width)]
    return out


def _nanmean(values: list[float]) -> float:
    known = [v for v in values if not math.isnan(v)]
    return statistics.fmean(known) if known else math.nan


def _cell(value: float, percent: bool = False, digits: int = 3) -> str:
    if math.isnan(value):
        return "—"
    return f"{value * 100:.1f}%" if percent else f"{value:.{digits}g}" if value >= 100 else f"{value:.{digits}f}"


def _layer_table(rows: list[tuple[str, str, list[float]]], percent: bool, digits: int = 3,
                 first: str = "variant") -> str:
    from gatedformer.analysis.report import markdown_table

    width = max(len(values) for _, _, values in rows)
    header = [first, "where", *(f"L{i + 1}" for i in range(width)), "mean"]
    body = [[name, site or "layers", *(_cell(v, percent, digits) for v in values),
             *(["—"] * (width - len(values))), _cell(_nanmean(values), percent, digits)]
            for name, site, values in rows]
    return markdown_table(header, body)


def measurement_tables(runs: dict[str, list[RunMeasurements]], first: str = "variant",
                       spike_factor: float = SPIKE_FACTOR) -> list[str]:
    """Markdown (headings, tables and their explanations) of the measurements of every variant (``{name: its seeds'
    measurements}``): attention sink, largest activation and gate sparsity per layer (means over the seeds), and the
    loss spikes of every seed."""
    parts: list[str] = []
    seeds = max((len(r) for r in runs.values()), default=0)
    over = f", the mean over {seeds} seeds" if seeds > 1 else ""
    sinks = [(n, s, v) for n, r in runs.items() for s, v in mean_over_seeds(r, "sink").items()]
    if sinks:
        length = max(m.query_length for r in runs.values() for m in r)
        parts += ["### Attention sink", "",
                  f"Mean attention weight on the first position, per layer (every head, every query of "
                  f"{MEASURE_ROWS} validation sequences of {length} positions{over}). Causal attention spread evenly "
                  f"would put {uniform_sink(length):.1%} there (H(L)/L); a sink puts far more "
                  "(Qiu et al. 2025 report it vanishing under the attention output gate).", "",
                  _layer_table(sinks, percent=True, first=first), ""]
    peaks = [(n, s, v) for n, r in runs.items() for s, v in mean_over_seeds(r, "max_activation").items()]
    if peaks:
        parts += ["### Largest activation", "",
                  f"The largest |h| of each layer's output hidden state on the same batch{over}: the \"massive "
                  "activations\" (Sun et al. 2024) that the gated-attention paper reports vanish with its gate.", "",
                  _layer_table(peaks, percent=False, first=first), ""]
    means = {(n, s): v for n, r in runs.items() for s, v in mean_over_seeds(r, "gate_mean").items()}
    if means:
        sparse = {(n, s): v for n, r in runs.items() for s, v in mean_over_seeds(r, "gate_sparse").items()}
        parts += ["### Gate scores", "",
                  f"Mean gate score per layer, then the share of scores under {SPARSE_BELOW} (a closed gate), on the "
                  f"same batch{over}: the gates whose scores lie in [0, 1] (σ SDU, highway and gated-MHDPA T, "
                  "EAU's evaluator, GRC's σ, the attention output gate).", "",
                  "Mean gate score:", "",
                  _layer_table([(n, s, v) for (n, s), v in means.items()], percent=False, first=first), "",
                  f"Share of scores under {SPARSE_BELOW}:", "",
                  _layer_table([(n, s, v) for (n, s), v in sparse.items()], percent=True, first=first), ""]
    parts += spike_section(runs, first, spike_factor)
    return parts


def spike_section(runs: dict[str, list[RunMeasurements]], first: str = "variant",
                  spike_factor: float = SPIKE_FACTOR) -> list[str]:
    """The loss-spike table: per variant, the spikes of each seed, the largest rise and where the first came."""
    from gatedformer.analysis.report import markdown_table

    rows = []
    for name, measured in runs.items():
        counts = [len(m.spikes) for m in measured]
        spikes = [s for m in measured for s in m.spikes]
        largest = max(spikes, key=lambda s: s.ratio, default=None)
        records = [len(m.losses[0]) for m in measured]
        rows.append([name, " / ".join(map(str, counts)), " / ".join(map(str, records)),
                     "—" if largest is None else f"×{largest.ratio:.2f} at step {largest.step}",
                     ", ".join(str(s.step) for s in measured[0].spikes[:5]) or "—" if measured else "—"])
    return ["### Loss spikes", "",
            f"Training-loss records (`log.jsonl`, one every `train.log_every` steps) above {spike_factor:g} × the "
            f"mean of the {SPIKE_WINDOW} records before them, per seed; the largest rise over all seeds; the first "
            "seed's first spikes.", "",
            markdown_table([first, *(["spikes per seed", "records per seed", "largest rise", "first seed's spikes"]
                                     if any(len(m) > 1 for m in runs.values())
                                     else ["spikes", "records", "largest rise", "spikes at steps"])], rows), ""]


def plot_measurements(runs: dict[str, list[RunMeasurements]], out_path: str | Path, title: str = "") -> Path | None:
    """One figure of four panels, layer on the x axis: attention sink, largest activation (log scale), mean gate
    score and share of gate scores under 0.1; a line per variant and site (means over seeds). ``None`` (nothing
    drawn) where nothing was measured."""
    from gatedformer.analysis.plots import _pyplot, _save

    quantities = [("sink", "weight on the first position", "attention sink"),
                  ("max_activation", "largest |h|", "largest activation"),
                  ("gate_mean", "mean gate score", "gate score"),
                  ("gate_sparse", f"share of scores < {SPARSE_BELOW}", "closed gates")]
    lines = {q: {(n, s): v for n, r in runs.items() for s, v in mean_over_seeds(r, q).items()}
             for q, _, _ in quantities}
    shown = [q for q in quantities if lines[q[0]]]
    if not shown:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(shown), figsize=(4.6 * len(shown), 4.0), squeeze=False, layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    order = {name: i for i, name in enumerate(runs)}
    styles = ["-", "--", ":", "-."]
    for axis, (quantity, ylabel, panel) in zip(axes[0], shown, strict=True):
        sites = list(dict.fromkeys(s for _, s in lines[quantity]))
        for (name, site), values in lines[quantity].items():
            label = name if len(sites) == 1 else f"{name}: {site or 'layers'}"
            axis.plot(range(1, len(values) + 1), values, marker="o", markersize=3, label=label,
                      color=colors[order[name] % len(colors)], linestyle=styles[sites.index(site) % len(styles)])
        if quantity == "max_activation":
            axis.set_yscale("log")
        if quantity == "sink":
            length = max(m.query_length for r in runs.values() for m in r)
            axis.axhline(uniform_sink(length), color="gray", linestyle=":", linewidth=1.0,
                         label=f"spread evenly (L = {length})")
        axis.set(xlabel="layer", ylabel=ylabel, title=panel)
        axis.xaxis.get_major_locator().set_params(integer=True)
        axis.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for axis in axes[0][1:]:
        more = axis.get_legend_handles_labels()
        for handle, label in zip(*more, strict=True):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    fig.legend(handles, labels, loc="outside right upper", fontsize=7)
    fig.suptitle(f"attention sink, activations and gate scores per layer{f' — {title}' if title else ''}")
    return _save(fig, Path(out_path))


def plot_loss_spikes(runs: dict[str, RunMeasurements], out_path: str | Path, title: str = "",
                     spike_factor: float = SPIKE_FACTOR) -> Path | None:
    """Each run's training loss against step, its spikes marked: a panel per run. ``None`` without losses."""
    from gatedformer.analysis.plots import _pyplot, _save

    drawn = {name: m for name, m in runs.items() if m.losses[0]}
    if not drawn:
        return None
    plt = _pyplot()
    cols = min(3, len(drawn))
    rows = math.ceil(len(drawn) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 2.8 * rows), squeeze=False, layout="constrained",
                             sharey=True)
    for axis, (name, measured) in zip(axes.flat, drawn.items(), strict=False):
        steps, losses = measured.losses
        axis.plot(steps, losses, linewidth=1.0)
        if measured.spikes:
            axis.scatter([s.step for s in measured.spikes], [s.loss for s in measured.spikes], color="red",
                         marker="x", zorder=3, label=f"{len(measured.spikes)} spike(s)")
            axis.legend(fontsize=7)
        axis.set(title=name, xlabel="step")
        axis.grid(alpha=0.3)
    for axis in axes[:, 0]:
        axis.set_ylabel("train loss")
    for axis in list(axes.flat)[len(drawn):]:
        axis.axis("off")
    fig.suptitle(f"loss spikes (> {spike_factor:g} × running mean){f' — {title}' if title else ''}")
    return _save(fig, Path(out_path))


def analyze_measurements(run_dirs: list[str | Path], out_dir: str | Path | None = None,
                         data_dir: str | Path | None = None, spike_factor: float = SPIKE_FACTOR
                         ) -> tuple[str, list[Path], list[str]]:
    """``gatedformer analyze``'s measurements of one or several runs: the tables as text, the figures
    (``measurements.png``, ``loss_spikes.png`` in ``out_dir``, by default the one run's folder) and notes."""
    from gatedformer.analysis.gates import _run_title

    measured: dict[str, list[RunMeasurements]] = {}
    notes: list[str] = []
    for run_dir in map(Path, run_dirs):
        title = _run_title(run_dir.resolve())
        name = title if title not in measured else str(run_dir)
        result = measure_run(run_dir, data_dir, spike_factor=spike_factor)
        measured[name] = [result]
        notes += result.notes
    first = "run"
    text = "\n".join(measurement_tables(measured, first, spike_factor))
    figures: list[Path] = []
    folder = Path(out_dir) if out_dir is not None else Path(run_dirs[0])
    try:
        drawn = [plot_measurements(measured, folder / "measurements.png"),
                 plot_loss_spikes({name: runs[0] for name, runs in measured.items()}, folder / "loss_spikes.png",
                                  spike_factor=spike_factor)]
        figures = [f for f in drawn if f is not None]
    except ImportError:
        notes.append("measurement figures skipped: matplotlib is missing (pip install 'gatedformer[plot]')")
    if not any(m.has_attention for runs in measured.values() for m in runs):
        notes.append("no attention measured (a model without attention, or a run that could not be read): the "
                     "attention sink is not drawn")
    return text, figures, notes
