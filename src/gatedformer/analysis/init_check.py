r"""Does the initialisation keep signals at unit scale? Per-layer variance ratios at step 0, beside theory.

For every layer of a backbone this measures, on a few real training windows and before any update,

* forward:  :math:`\rho_f = \mathrm{Var}[\text{out}] / \mathrm{Var}[\text{in}]`;
* backward: :math:`\rho_b = \mathrm{Var}[\partial L/\partial x_{in}] / \mathrm{Var}[\partial L/\partial x_{out}]`,

with ``L`` the training loss (mean cross-entropy) and ``∂L/∂in`` the gradient that flows into the
layer's input *through that layer alone* (a full backward hook), so a residual path around the site
does not count. Variances are pooled over every element of every window (batch, time and channel), and
the model runs in training mode, dropout included, exactly as the trainer's first step sees it; with
``dropout=False`` (``--no-dropout``) in evaluation mode, the same weights without dropout, beside what theory
predicts there. A translation run's windows are its first training batches (source, decoder input and target).

What is a layer, and what theory predicts for it:

* a model may offer ``init_check_layers()``, returning dicts with ``name``, ``module`` and optionally
  ``kind``, ``forward``/``backward`` (predicted ratios), ``forward_no_dropout``/``backward_no_dropout`` (the
  same without dropout), ``forward_out_var`` (a predicted output variance, so the predicted ratio is that over the
  measured input variance) and ``note``;
* otherwise the first ``nn.ModuleList`` called ``layers`` (at any depth, e.g. ``sru.layers``) holds them.

Predictions:

* **GCNN blocks** (:class:`~gatedformer.models.gcnn.GatedConvLM`): the site is the gated branch
  ``F`` of ``H = X + F(X)``, not the block; with the GLU initialisation :math:`\mathcal N(0, \sqrt{4p/n})`,
  :math:`\rho_f = \rho_b = 1` to first order in the gate input (Gehring et al. 2017, appendix A). The
  next order adds about :math:`\mathrm E[x^2]/p` per gated convolution, since
  :math:`\mathrm E[\sigma(b)^2] \approx 1/4 + \mathrm{Var}[b]/16`; small embeddings keep it small, but the
  residual sum doubles the stream's variance each block, so deep blocks read a little above 1. Without dropout the
  same weights give ``p`` per gated convolution (they were drawn for inputs scaled by ``1/p``).
* **ConvS2S GLU blocks** (:class:`~gatedformer.models.convs2s.ConvS2S`), ``dropout → conv → GLU`` in both stacks:
  with dropout :math:`\rho_f = 1` and :math:`\rho_b = C_{out}/C_{in}` (appendix A, eq. 32-33: the backward fan-in
  is the next layer's ``w · C_out``); without dropout ``p`` and ``p · C_out/C_in``. The residuals scaled by
  :math:`\sqrt{0.5}` keep the stream's variance at the embeddings' (0.01), where the first-order approximation
  holds. The appendix's sums run over ``w · C_in`` inputs, all of them signal; at a sentence's edges part of a
  kernel reads the convolution's zero padding and, in a padded batch, padding tokens (zeroed), so there the output
  is smaller, and pooling every position reads some 5 % low. These blocks are therefore measured on interior
  positions: real tokens whose every neighbour within the kernel's reach, either way, is a real token of the same
  sentence (the row's ``positions`` says so).
* **SRU layers**: with :math:`c` of about the input's variance and the reset gate near
  :math:`\sigma(b)`, :math:`\mathrm{Var}[h]/\mathrm{Var}[x] \approx \sigma(b)^2 + (1-\sigma(b))^2\alpha^2`,
  which is 1 for :math:`\alpha = \sqrt{1 + 2e^b}` (:math:`\sqrt 3` at :math:`b = 0`; SRU paper,
  appendix) and 0.5 for :math:`\alpha = 1, b = 0` (``rescale=False``): the stack then shrinks
  geometrically with depth.
* **Transformer layers, post-LN**: the layer ends in a LayerNorm with unit gain and zero bias, so
  :math:`\mathrm{Var}[\text{out}] = 1` and :math:`\rho_f = 1/\mathrm{Var}[\text{in}]`: 1.0 for every layer
  that reads another layer's output. Pre-LN layers and the backward pass of LayerNorm stacks get no
  prediction.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gatedformer.config import RunConfig, task_of, validate
from gatedformer.errors import ConfigError

__all__ = ["format_init_check", "init_check", "interior_positions", "layer_sites", "measure_layers",
           "predict_sru_ratio"]


def predict_sru_ratio(highway_bias: float, alpha: float) -> float:
    r""":math:`\sigma(b)^2 + (1 - \sigma(b))^2 \alpha^2`: the SRU paper's estimate of ``Var[h]/Var[x]``."""
    r = 1.0 / (1.0 + math.exp(-highway_bias))
    return r * r + (1.0 - r) ** 2 * alpha * alpha


_LAYER_KINDS = {"RTransformerLayer": "R-Transformer layer", "TransformerXLLayer": "Transformer-XL layer",
                "EncoderLayer": "Transformer encoder layer", "DecoderLayer": "Transformer decoder layer"}


def _describe(name: str, module: nn.Module) -> dict[str, Any]:
    """The site dict of a layer found in a ``layers`` list, with what theory predicts for its type."""
    site: dict[str, Any] = {"name": name, "module": module, "kind": type(module).__name__}
    if all(hasattr(module, attr) for attr in ("alpha", "highway_bias", "rescale")):  # an SRU layer
        site["kind"] = f"SRU layer (α={module.alpha:.3g}, b={module.highway_bias:g})"
        site["forward"] = site["forward_no_dropout"] = predict_sru_ratio(module.highway_bias, module.alpha)
        site["note"] = "σ(b)² + (1-σ(b))²α², Var[c] ≈ Var[x]"
        return site
    sub = getattr(module, "ffn", None)
    pre_norm = getattr(sub, "pre_norm", None)
    layer = _LAYER_KINDS.get(type(module).__name__, "Transformer layer")
    if pre_norm is False and isinstance(getattr(sub, "norm", None), nn.LayerNorm):
        site["kind"] = f"{layer} (post-LN)"
        site["forward_out_var"] = 1.0
        site["note"] = "LayerNorm: Var[out] = 1"
    elif pre_norm is True:
        site["kind"] = f"{layer} (pre-LN)"
        site["note"] = "residual stream grows; no fixed ratio"
    return site


def _find_layers(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The first ``layers`` list, or an encoder-decoder's top-level ``encoder_layers`` and ``decoder_layers``."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and (name == "layers" or name.endswith(".layers")):
            return [(name, module)]
    return [(name, module) for name, module in model.named_children()
            if isinstance(module, nn.ModuleList) and name in ("encoder_layers", "decoder_layers")]


def layer_sites(model: nn.Module) -> list[dict[str, Any]]:
    """The layers of ``model`` to measure (see the module docstring), each a dict with ``name`` and ``module``."""
    offered = getattr(model, "init_check_layers", None)
    if callable(offered):
        return [dict(site) for site in offered()]
    found = _find_layers(model)
    if not found:
        raise ConfigError(
            f"{type(model).__name__} has no `layers` ModuleList and no init_check_layers(); "
            "the init check cannot tell what its layers are"
        )
    return [_describe(f"{prefix}.{i}", layer) for prefix, layers in found for i, layer in enumerate(layers)]


class _Moments:
    """Pooled count, sum and sum of squares (float64) of every tensor it is given."""

    def __init__(self) -> None:
        self.n, self.s, self.ss = 0, 0.0, 0.0

    def add(self, t: Tensor, positions: Tensor | None = None) -> None:
        """Pool ``t``, or where ``positions`` (``(B, L)``, True to keep) is given, ``t[positions]``."""
        t = t.detach()
        if positions is not None:
            t = t[positions.to(t.device)]
        t = t.double()
        self.n += t.numel()
        self.s += t.sum().item()
        self.ss += t.square().sum().item()

    @property
    def var(self) -> float | None:
        """The pooled (unbiased) variance; ``None`` if fewer than two values were seen."""
        if self.n < 2:
            return None
        mean = self.s / self.n
        return max(self.ss / self.n - mean * mean, 0.0) * self.n / (self.n - 1)


def _first_tensor(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a ModelOutput: its logits first
        value = [getattr(value, field.name) for field in dataclasses.fields(value)]
    if isinstance(value, list | tuple):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _ratio(top: float | None, bottom: float | None) -> float | None:
    """``top / bottom``, or ``None`` when either was not measured or the ratio is undefined."""
    if top is None or bottom is None or not (math.isfinite(top) and math.isfinite(bottom)) or bottom <= 0.0:
        return None
    return top / bottom


def _default_loss(output: Any, index: int) -> Tensor:
    """A fixed random projection of the first output tensor: unit-variance gradients at the top."""
    out = _first_tensor(output)
    if out is None:
        raise ValueError("the model returned no tensor to take a loss of")
    generator = torch.Generator().manual_seed(index)
    direction = torch.randn(out.shape, generator=generator, dtype=out.dtype).to(out.device)
    return (out * direction).sum()


def measure_layers(model: nn.Module, batches: Iterable[Sequence[Any]],
                   loss_fn: Callable[[Any, int], Tensor] | None = None,
                   sites: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Forward and backward variance ratios of each site of ``model`` over ``batches``.

    ``batches`` yields argument tuples for ``model(*args)``; ``loss_fn(output, i)`` turns the ``i``-th
    output into the scalar whose gradients are measured (default: a fixed random projection of the first
    output tensor). ``sites`` defaults to :func:`layer_sites`. The model's training/eval mode is used as
    it is, and no parameter is changed (their gradients are cleared afterwards).

    Each row has ``layer``, ``kind``, ``var_in``, ``var_out``, ``forward`` (measured ratio),
    ``forward_predicted``, ``grad_out_var``, ``grad_in_var``, ``backward``, ``backward_predicted`` and
    ``note``; a value that could not be measured (e.g. no gradient reaches an input that does not require
    one) or that theory does not predict is ``None``.
    """
    sites = layer_sites(model) if sites is None else sites
    loss_fn = loss_fn or _default_loss
    dropout_on = model.training
    stats = [{key: _Moments() for key in ("in", "out", "grad_in", "grad_out")} for _ in sites]
    # A site may pool chosen positions only: ``positions(args)`` gives them for the call's arguments, kept for the
    # gradients of the same call.
    chosen: list[Tensor | None] = [None] * len(sites)
    handles = []

    def forward_hook(k: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            x, y = _first_tensor(args), _first_tensor(output)
            if x is not None and y is not None:
                pick = sites[k].get("positions")
                chosen[k] = pick(args) if pick is not None else None
                stats[k]["in"].add(x, chosen[k])
                stats[k]["out"].add(y, chosen[k])

        return hook

    def backward_hook(k: int):
        def hook(module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
            gx, gy = _first_tensor(grad_input), _first_tensor(grad_output)
            if gx is not None and gy is not None:
                stats[k]["grad_in"].add(gx, chosen[k])
                stats[k]["grad_out"].add(gy, chosen[k])

        return hook

    try:
        for k, site in enumerate(sites):
            handles.append(site["module"].register_forward_hook(forward_hook(k)))
            handles.append(site["module"].register_full_backward_hook(backward_hook(k)))
        for i, args in enumerate(batches):
            loss = loss_fn(model(*args), i)
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)

    rows = []
    for site, moments in zip(sites, stats, strict=True):
        var_in, var_out = moments["in"].var, moments["out"].var
        g_in, g_out = moments["grad_in"].var, moments["grad_out"].var
        predicted_forward = site.get("forward" if dropout_on else "forward_no_dropout")
        if predicted_forward is None and site.get("forward_out_var") is not None:
            predicted_forward = _ratio(site["forward_out_var"], var_in)
        rows.append({
            "layer": site["name"], "kind": site.get("kind", type(site["module"]).__name__),
            "var_in": var_in, "var_out": var_out, "forward": _ratio(var_out, var_in),
            "forward_predicted": predicted_forward,
            "grad_out_var": g_out, "grad_in_var": g_in, "backward": _ratio(g_in, g_out),
            "backward_predicted": site.get("backward" if dropout_on else "backward_no_dropout"),
            "note": site.get("note", ""), "dropout": dropout_on,
            "positions": "interior" if site.get("positions") is not None else "all",
        })
    return rows


def init_check(config: RunConfig, data_dir: str | Path | None = None, batches: int = 4,
               device: str = "cpu", dropout: bool = True) -> list[dict[str, Any]]:
    """Per-layer variance ratios of ``config``'s model at initialisation, on its first training windows.

    The model is built and initialised as the trainer does (same seed, same ``init`` scheme) and run in
    training mode on ``batches`` windows of the configured corpus, carrying the recurrent state from
    window to window (a translation model: its first ``batches`` training batches). ``dropout=False`` runs it in
    evaluation mode instead. Returns one dict per layer (see :func:`measure_layers`).
    """
    from gatedformer.train.init import initialise

    validate(config)
    if batches < 1:
        raise ConfigError(f"batches must be at least 1, got {batches}")
    if task_of(config) not in ("lm", "translation"):
        raise ConfigError(f"init-check measures language and translation models' layers; {config.data.corpus} is "
                          "neither's corpus: pick such a recipe (e.g. ptb-char-tiny, wikitext2-gcnn-tiny, "
                          "multi30k-convs2s-tiny)")
    torch.manual_seed(config.train.seed)
    if task_of(config) == "translation":
        from gatedformer.tasks.translation import TranslationTask

        task = TranslationTask()
        data = task.load_data(config, data_dir)
        torch.manual_seed(config.train.seed)
        model = task.build_model(config, data)
        initialise(model, config.init)
        model.to(device).train(dropout)
        windows = [batch.inputs for batch in itertools.islice(task.train_batches(data, config, 0, None), batches)]
        runner = _TranslationRunner(model, torch.device(device)).train(dropout)
        sites = _interior_sites(layer_sites(model), runner)
        return measure_layers(runner, windows, loss_fn=_cross_entropy, sites=sites)
    from gatedformer.data import LMStream, load_corpus
    from gatedformer.fused import fuse
    from gatedformer.models import build_model

    corpus = load_corpus(config.data.corpus, data_dir)
    stream = LMStream(corpus.train, config.data.batch_size, config.data.seq_len)
    torch.manual_seed(config.train.seed)
    model = fuse(build_model(config.model, len(corpus.vocab)))  # as the task builds it for training
    initialise(model, config.init)
    model.to(device).train(dropout)
    windows = [stream.window(k) for k in range(min(batches, len(stream)))]
    runner = _Runner(model, torch.device(device)).train(dropout)
    return measure_layers(runner, windows, loss_fn=_cross_entropy, sites=layer_sites(model))


def interior_positions(real: Tensor, reach: int) -> Tensor:
    """``(B, L)``: True at the positions of ``real`` (``(B, L)``, True at real tokens) whose every neighbour within
    ``reach`` positions either way is a real token of the sequence (neither padding nor past its ends)."""
    if reach <= 0:
        return real.clone()
    ones = torch.ones(1, 1, 2 * reach + 1, dtype=torch.float32, device=real.device)
    count = F.conv1d(real[:, None].float(), ones, padding=reach)[:, 0]  # zeros past the ends
    return count > 2 * reach + 0.5


def _interior_sites(sites: list[dict[str, Any]], runner: _TranslationRunner) -> list[dict[str, Any]]:
    """The ConvS2S blocks of ``sites`` measured on interior positions (see the module docstring): a kernel of width
    ``w`` reads ``w - 1`` positions back (causal, the decoder) or ``⌊(w-1)/2⌋`` back and ``⌊w/2⌋`` ahead (the
    encoder); the margin covers both the positions an output reads and those that read an input (the gradients)."""
    for site in sites:
        module, side = site["module"], site["name"].split(".")[0]
        if not (hasattr(module, "width") and hasattr(module, "causal") and side in ("encoder", "decoder")):
            continue
        width = int(module.width)
        reach = width - 1 if module.causal else max((width - 1) // 2, width // 2)
        site["positions"] = lambda args, side=side, reach=reach: interior_positions(runner.real[side], reach)
        site["note"] = f"{site.get('note', '')}; interior positions".lstrip("; ")
    return sites


class _TranslationRunner(nn.Module):
    """``runner(src, tgt_in, tgt_out) -> (logits, targets)``: a translation model under teacher forcing, the padded
    target positions left out of the loss (marked ``-100``). ``real`` keeps the call's real (non-padding) source and
    target positions, for the sites that pool only those."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.model = model
        self.device = device
        self.real: dict[str, Tensor] = {}

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> tuple[Tensor, Tensor]:
        from gatedformer.data.translation import PAD_ID

        self.real = {"encoder": src != PAD_ID, "decoder": tgt_in != PAD_ID}
        logits = self.model(src.to(self.device), tgt_in.to(self.device)).logits
        return logits, tgt_out.to(self.device).masked_fill(tgt_out.to(self.device) == PAD_ID, -100)


class _Runner(nn.Module):
    """``runner(x, y) -> (logits, y)``: the language model on one window, its state carried to the next
    (detached), in the ``model(*args) -> output`` form :func:`measure_layers` calls."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.model = model
        self.device = device
        self.state: Any = None

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        from gatedformer.train.loop import detach_state

        out = self.model(x.to(self.device), self.state)
        self.state = detach_state(out.state)
        return out.logits, y.to(self.device)


def _cross_entropy(output: tuple[Tensor, Tensor], index: int) -> Tensor:
    logits, targets = output
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _number(value: float | None, width: int) -> str:
    if value is None:
        return "—".rjust(width)
    if not math.isfinite(value):
        return "nan".rjust(width)
    return f"{value:{width}.3f}" if 1e-3 <= abs(value) < 1e4 or value == 0 else f"{value:{width}.2e}"


def format_init_check(rows: list[dict[str, Any]]) -> str:
    """A printable table of :func:`init_check` rows, measured beside predicted ratios."""
    if not rows:
        return "no layers measured"
    name_w = max(5, *(len(r["layer"]) for r in rows))
    kind_w = max(4, *(len(r["kind"]) for r in rows))
    header = (f"{'layer':<{name_w}}  {'kind':<{kind_w}}  {'Var[in]':>9}  {'fwd':>9}  {'fwd pred':>9}  "
              f"{'bwd':>9}  {'bwd pred':>9}  note")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['layer']:<{name_w}}  {r['kind']:<{kind_w}}  {_number(r['var_in'], 9)}  {_number(r['forward'], 9)}  "
            f"{_number(r['forward_predicted'], 9)}  {_number(r['backward'], 9)}  "
            f"{_number(r['backward_predicted'], 9)}  {r['note']}".rstrip()
        )
    lines.append("")
    mode = ("training mode, dropout on" if rows[0].get("dropout", True)
            else "evaluation mode, dropout off (--no-dropout)")
    lines.append("fwd = Var[out]/Var[in]; bwd = Var[dL/d in]/Var[dL/d out] through the layer alone; "
                 f"pooled over batch, time and channels, {mode}, at initialisation.")
    if any(r.get("positions") == "interior" for r in rows):
        lines.append("interior positions: real tokens whose neighbours within the kernel's reach are all real tokens "
                     "(no padding, no sequence edge), where appendix A's sums hold; pooling every position reads "
                     "some 5 % lower.")
    return "\n".join(lines)
