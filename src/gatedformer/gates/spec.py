"""Gate placement specs: which unit goes on which layer and sublayer.

A spec is a ``+``-separated list of items, so that the papers' own names parse as written::

    ""  or "baseline"        no gates
    "+σ SDU"                 sigmoid SDU beside every attention and FFN sublayer
    "+tanh L1-3"             tanh SDU on layers 1 to 3 (1-based, as the paper counts)
    "+σ L1-6\\FFN"           sigmoid SDU on layers 1-6, but not on the FFN sublayers
    "+highway gate"          highway gate on every sublayer
    "+gated MHDPA"           gated MHDPA on every sublayer
    "+EAU+GRC"               EAU after every attention, GRC in place of every residual
    "sdu tanh L1,3 /attn"    tanh SDU on layers 1 and 3, attention sublayers only
    "eau /cross"             EAU after the decoder's cross-attention only (encoder-decoder models)
    "+SDPA gate"             attention output gate Y ⊙ σ(X W_θ) on every attention (Qiu et al. 2025)
    "+SDPA gate headwise"    the same with one score per head
    "+SwiGLU"                SwiGLU feed-forwards (also GLU, Bilinear, ReGLU, GEGLU; Shazeer 2020)
    "+GRU gate"              GTrXL's GRU-type gating in place of every residual connection
    "+ReZero"                x + α F(x), α = 0 at first, on every residual connection

Words inside an item: a unit (``sdu``, ``highway [gate]``, ``gated mhdpa``, ``eau``, ``grc``, ``sdpa gate
[headwise]``, ``glu``, ``bilinear``, ``reglu``, ``geglu``, ``swiglu``, ``gru [gate]``, ``rezero``); a gate
function (``σ``/``sigmoid``, ``tanh``; alone it implies ``sdu``); layers (``L1-2``, ``L1,3,5``,
``Lall``); sublayers kept (``/attn``, ``/ffn``, ``/cross``) or dropped (``\\FFN``, ``\\attn``, ``\\cross``,
``no FFN``).

Encoder-decoder models (``resolve_placement(..., cross_attention=True)``) have a third sublayer kind,
``cross``: the decoder's cross-attention. Layer ``Li`` then means encoder layer i and decoder layer i,
``attn`` means self-attention in both stacks, and an item that names no sublayers also reaches
``cross`` (so ``+EAU`` is after every multi-head attention and ``+GRC`` on every residual). Models
without a decoder ignore that default and reject an explicit ``/cross``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gatedformer.errors import ConfigError
from gatedformer.gates.kinds import GATE_FNS, GATE_KINDS

_UNIT_WORDS = {word: kind.name for kind in GATE_KINDS.values() for word in kind.words}
_FN_WORDS = {"σ": "sigmoid", "sigma": "sigmoid", "sigmoid": "sigmoid", "sig": "sigmoid", "tanh": "tanh"}
_SUBLAYER_WORDS = {"attn": "attn", "att": "attn", "attention": "attn", "mhdpa": "attn", "ffn": "ffn",
                   "cross": "cross", "cross-attn": "cross", "xattn": "cross"}
# More layers than any model has: a spec or model naming more is refused before anything is materialised.
MAX_LAYERS = 10_000
_HELP = ("write e.g. '+σ SDU', '+tanh L1-3', '+σ L1-6\\FFN', '+highway gate', '+gated MHDPA', '+EAU+GRC', "
         "'+SDPA gate', '+SwiGLU', '+GRU gate' or '+ReZero'")
_EXCLUSIVE = ", ".join(kind.label for kind in GATE_KINDS.values() if kind.exclusive)


@dataclass(frozen=True)
class GateItem:
    """One parsed item of a spec: a gate kind (a name of :data:`~gatedformer.gates.kinds.GATE_KINDS`) with its
    function, layers (1-based) and sublayers."""

    unit: str
    fn: str = "sigmoid"
    layers: tuple[int, ...] | None = None
    """``None`` means every layer."""
    sublayers: tuple[str, ...] = ("attn", "ffn")
    """The sublayers named; ``cross`` appears here only when written explicitly (``/cross``)."""
    reaches_cross: bool = False
    """Whether the item also gates an encoder-decoder model's cross-attention (explicit or by default)."""


@dataclass
class SublayerGates:
    """What gates one sublayer carries once a spec is resolved."""

    kinds: dict[str, str] = field(default_factory=dict)
    """The gate kinds it carries, each with its gate function (``""`` for a kind that takes none), in the order of
    :data:`~gatedformer.gates.kinds.GATE_KINDS`."""

    @classmethod
    def of(cls, *kinds: str, fn: str = "sigmoid") -> SublayerGates:
        """The gates ``kinds`` (names of the table), the SDU's with gate function ``fn``."""
        return cls({name: fn if GATE_KINDS[name].takes_fn else "" for name in GATE_KINDS if name in kinds})

    def has(self, kind: str) -> bool:
        return kind in self.kinds

    @property
    def exclusive(self) -> str | None:
        """The one exclusive kind it carries (SDU, highway gate or gated MHDPA), if any."""
        return next((name for name in self.kinds if GATE_KINDS[name].exclusive), None)

    @property
    def empty(self) -> bool:
        return not self.kinds


@dataclass
class Placement:
    """A resolved spec: the gates of every (layer, sublayer), 0-based layers."""

    n_layers: int
    sites: dict[tuple[int, str], SublayerGates] = field(default_factory=dict)

    def at(self, layer: int, sublayer: str) -> SublayerGates:
        return self.sites.get((layer, sublayer), SublayerGates())

    def is_empty(self) -> bool:
        return all(s.empty for s in self.sites.values())


def _parse_layers(text: str, spec: str) -> tuple[int, ...] | None:
    if text.lower() == "all":
        return None
    layers: set[int] = set()
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not match:
            raise ConfigError(f"bad layer set {text!r} in gate spec {spec!r}; write L1-2, L1,3,5 or Lall")
        numbers = [match.group(1), match.group(2) or match.group(1)]
        if any(len(n.lstrip("0")) > len(str(MAX_LAYERS)) or int(n) > MAX_LAYERS for n in numbers):
            raise ConfigError(f"layer set {text!r} in gate spec {spec!r} goes beyond {MAX_LAYERS} layers, more than "
                              "any model has; name the model's layers, e.g. L1-2")
        lo, hi = int(numbers[0]), int(numbers[1])
        if lo < 1 or hi < lo:
            raise ConfigError(f"bad layer range {part!r} in gate spec {spec!r}; layers count from 1, low to high")
        layers.update(range(lo, hi + 1))
    return tuple(sorted(layers))


def _tokenise(item: str) -> list[str]:
    item = item.strip().lower()
    item = re.sub(r"\bhighway\s+gate\b", "highway-gate", item)
    item = re.sub(r"\bgated\s+mhdpa\b", "gated-mhdpa", item)
    item = re.sub(r"\bsdpa\s+gate(\s+headwise)?\b", lambda m: "sdpa-gate" + "-headwise" * bool(m.group(1)), item)
    item = re.sub(r"\bgru\s+gate\b", "gru-gate", item)
    item = re.sub(r"\bno\s+(ffn|attn|att|attention)\b", r"\\\1", item)
    # "\FFN" and "/attn" may be glued to a layer word: split them off.
    item = re.sub(r"([\\/])", r" \1", item)
    item = re.sub(r"([\\/])\s+", r"\1", item)
    return item.split()


def _parse_item(item: str, spec: str) -> GateItem:
    unit: str | None = None
    fn: str | None = None
    layers: tuple[int, ...] | None = None
    keep: list[str] = []
    drop: list[str] = []
    written = item.strip()
    layer_word: str | None = None
    for word in _tokenise(item):
        if word in _UNIT_WORDS:
            if unit == _UNIT_WORDS[word]:
                raise ConfigError(f"gate spec item {written!r} names {unit} twice; name it once")
            if unit is not None:
                raise ConfigError(f"gate spec item {written!r} names two units ({unit} and {_UNIT_WORDS[word]}); "
                                  "give each unit its own item, joined by '+', e.g. '+EAU+GRC'")
            unit = _UNIT_WORDS[word]
        elif word in _FN_WORDS:
            if fn == _FN_WORDS[word]:
                raise ConfigError(f"gate spec item {written!r} names {fn} twice; name it once")
            if fn is not None:
                raise ConfigError(f"gate spec item {written!r} names two gate functions ({fn} and "
                                  f"{_FN_WORDS[word]}); keep one of σ and tanh")
            fn = _FN_WORDS[word]
        elif word[0] in "\\/" and word[1:] in _SUBLAYER_WORDS:
            (drop if word[0] == "\\" else keep).append(_SUBLAYER_WORDS[word[1:]])
        elif re.fullmatch(r"l(all|[\d,\-]+)", word):
            if layer_word is not None:
                raise ConfigError(f"gate spec item {written!r} names layers twice (L{layer_word[1:]} and "
                                  f"L{word[1:]}); write one set, e.g. L1,2 or L1-3")
            layer_word = word
            layers = _parse_layers(word[1:], spec)
        else:
            raise ConfigError(f"unknown word {word!r} in gate spec {spec!r}; {_HELP}")
    if unit is None:
        if fn is None:
            raise ConfigError(f"gate spec item {written!r} names no unit; {_HELP}")
        unit = "sdu"
    kind = GATE_KINDS[unit]
    if fn is not None and not kind.takes_fn:
        takers = " and ".join(k.label for k in GATE_KINDS.values() if k.takes_fn)
        raise ConfigError(f"a gate function ({fn}) applies to {takers} only, not {kind.label}; drop it from {spec!r}")
    default = tuple(s for s in kind.sublayers if s != "cross")
    sublayers = tuple(s for s in (keep or default) if s not in drop)
    reaches_cross = ("cross" in keep if keep else "cross" in kind.sublayers) and "cross" not in drop
    if not sublayers and not reaches_cross:
        raise ConfigError(f"gate spec item {written!r} leaves no sublayer to gate; {_HELP}")
    for sublayer in sublayers:
        if sublayer not in kind.sublayers:
            raise ConfigError(f"{kind.label} goes {kind.where} only; drop /{sublayer} from the {kind.label} item")
    return GateItem(unit, fn or GATE_FNS[0], layers, sublayers, reaches_cross)


def parse_gate_spec(spec: str) -> list[GateItem]:
    """Parse a spec into its items; the empty spec and ``baseline`` mean no gates."""
    if not isinstance(spec, str):
        raise ConfigError(f"gate spec must be a string, got {type(spec).__name__}; {_HELP}")
    text = spec.strip()
    if text.lower() in ("", "baseline", "none"):
        return []
    parts = [p for p in re.split(r"[+;]", text) if p.strip()]
    if not parts:
        raise ConfigError(f"empty gate spec {spec!r}; {_HELP}")
    return [_parse_item(p, spec) for p in parts]


def resolve_placement(spec: str, n_layers: int, cross_attention: bool = False) -> Placement:
    """Resolve ``spec`` against a model of ``n_layers`` layers, rejecting conflicting gates.

    ``cross_attention=True`` is for encoder-decoder models: sites ``(layer, "cross")`` are filled too.
    """
    if n_layers > MAX_LAYERS:
        raise ConfigError(f"model.n_layers={n_layers} is more than the {MAX_LAYERS} layers gatedformer builds; "
                          "lower model.n_layers")
    placement = Placement(n_layers)
    for item in parse_gate_spec(spec):
        layers = item.layers if item.layers is not None else tuple(range(1, n_layers + 1))
        if layers and layers[-1] > n_layers:
            raise ConfigError(
                f"gate spec {spec!r} names layer {layers[-1]} but the model has {n_layers} layers; "
                "lower the layer numbers or raise model.n_layers"
            )
        if cross_attention:
            sublayers = tuple(s for s in item.sublayers if s != "cross") + ("cross",) * item.reaches_cross
        elif "cross" in item.sublayers:
            raise ConfigError(
                f"gate spec {spec!r} names /cross, but only encoder-decoder (translation) models have a "
                "cross-attention; drop /cross from it"
            )
        else:
            sublayers = item.sublayers
        if not sublayers:
            raise ConfigError(f"gate spec {spec!r} has an item that leaves no sublayer to gate; {_HELP}")
        for layer in layers:
            for sublayer in sublayers:
                site = placement.sites.setdefault((layer - 1, sublayer), SublayerGates())
                _add(site, item, f"layer {layer} {sublayer}", spec)
    for site in placement.sites.values():  # in the table's order, whatever the spec's
        site.kinds = {name: site.kinds[name] for name in GATE_KINDS if name in site.kinds}
    return placement


def _add(site: SublayerGates, item: GateItem, where: str, spec: str) -> None:
    kind = GATE_KINDS[item.unit]
    if kind.name in site.kinds:
        raise ConfigError(f"gate spec {spec!r} puts {kind.label} twice on {where}; name it once")
    for other in map(GATE_KINDS.get, site.kinds):
        if kind.exclusive and other.exclusive:
            raise ConfigError(f"gate spec {spec!r} puts both {other.name} and {kind.name} on {where}; "
                              f"choose one of {_EXCLUSIVE} per sublayer")
        if kind.role in ("body", "heads") and other.role == kind.role:
            raise ConfigError(f"gate spec {spec!r} puts both {other.label} and {kind.label} on {where}: "
                              f"{'both replace the feed-forward' if kind.role == 'body' else 'both gate the heads'}; "
                              "use one of them there")
        if kind.replaces_residual and other.replaces_residual:
            raise ConfigError(f"gate spec {spec!r} combines {other.label} with {kind.label} on {where}: both replace "
                              "the residual connection; use one of them there")
    site.kinds[kind.name] = item.fn if kind.takes_fn else ""


def describe_placement(placement: Placement) -> str:
    """A short human-readable summary, e.g. for logs."""
    parts = []
    for (layer, sublayer), site in sorted(placement.sites.items()):
        names = [f"{name}({fn})" if fn else name for name, fn in site.kinds.items()]
        if names:
            parts.append(f"L{layer + 1}.{sublayer}:{'+'.join(names)}")
    return ", ".join(parts) or "no gates"
