r"""BERT (Devlin et al., NAACL 2019) in the layout of ``bert-base-uncased``, with gates placed by the spec.

With ``s`` the tokens, ``t`` their positions and ``u`` their token types (segment A or B):

.. math::

    E &= \mathrm{Dropout}(\mathrm{LN}(W_{tok}[s] + W_{pos}[t] + W_{type}[u])) \\
    U &= \mathrm{LN}(X + \mathrm{Dropout}(\mathrm{Att}(X))), \qquad
    O = \mathrm{LN}(U + \mathrm{Dropout}(W_2\,\mathrm{GELU}(W_1 U + b_1) + b_2)) \\
    p &= \tanh(W_p\,O_{[CLS]} + b_p) \qquad \text{(the pooler)} \\
    \mathrm{logits} &= \mathrm{LN}(\mathrm{GELU}(W_t h + b_t))\,W_{tok}^\top + b_{dec} \qquad \text{(the MLM head,
    its decoder tied to the token embeddings)}

every LayerNorm with ε = 1e-12 and the attention bidirectional over the real (unpadded) tokens. The gate spec places
gates as in every other backbone (:mod:`gatedformer.gates.spec`): ``+EAU`` puts an Evaluator Adjuster Unit after
every self-attention, ``+GRC`` a gated residual connection on every residual, as the EAU/GRC paper (Dhayalkar 2024,
§4.2) adds them to ``bert-base-uncased``; SDU and the other units go where their specs say.

The encoder (:class:`BertEncoder`, the pooler included) has exactly the parameters of Hugging Face's ``BertModel``
of the same configuration, and :func:`hf_to_ours` maps such a model's weights onto it (its Q, K and V projections
become one). Its last layer can be asked for a few rows only (``select``): the attention then reads keys and values
from every position but computes the queries, the feed-forward and the LayerNorms of those rows alone: the masked
positions for masked language modelling, ``[CLS]`` for classification.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gatedformer.config import ModelConfig, register_backbone
from gatedformer.errors import CheckpointError, ConfigError
from gatedformer.gates.kinds import GATE_KINDS, kind_in_name
from gatedformer.gates.spec import SublayerGates, resolve_placement
from gatedformer.nn.attention import BidirectionalSelfAttention
from gatedformer.nn.dropout import Dropout
from gatedformer.nn.output import OutputLayer
from gatedformer.nn.outputs import ModelOutput
from gatedformer.nn.sublayer import Sublayer, check_lm_sizes, make_ffn

__all__ = ["BertEncoder", "BertForMaskedLM", "BertForSequenceClassification", "hf_to_ours",
           "load_hf_checkpoint", "read_hf_config"]

LAYER_NORM_EPS = 1e-12
"""BERT's LayerNorm epsilon."""


class BertEmbeddings(nn.Module):
    """``Dropout(LN(W_tok[s] + W_pos[t] + W_type[u]))``."""

    def __init__(self, vocab_size: int, d_model: int, max_positions: int, type_vocab: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(max_positions, d_model)
        self.token_types = nn.Embedding(type_vocab, d_model)
        self.norm = nn.LayerNorm(d_model, eps=LAYER_NORM_EPS)
        self.dropout = Dropout(dropout)

    def forward(self, tokens: Tensor, token_types: Tensor | None = None) -> Tensor:
        length = tokens.shape[1]
        if length > self.positions.num_embeddings:
            raise ValueError(f"a sequence of {length} tokens is longer than the {self.positions.num_embeddings} "
                             "positions the model has (model.max_positions)")
        x = self.tokens(tokens) + self.positions.weight[:length]
        x = x + (self.token_types.weight[0] if token_types is None else self.token_types(token_types))
        return self.dropout(self.norm(x))


class BertLayer(nn.Module):
    """``U = LN(X + Att(X))``, ``O = LN(U + FFN(U))``, each a :class:`~gatedformer.nn.sublayer.Sublayer` with its
    gates."""

    def __init__(self, d_model: int, n_heads: int, d_ffn: int, dropout: float, attn_dropout: float, ffn: str,
                 attn_gates: SublayerGates, ffn_gates: SublayerGates) -> None:
        super().__init__()
        self.attn = Sublayer(BidirectionalSelfAttention(d_model, n_heads, attn_dropout), d_model, attn_gates, dropout)
        # BERT's feed-forward has no dropout inside; the other kinds keep the model's.
        self.ffn = Sublayer(make_ffn(ffn, d_model, d_ffn, 0.0 if ffn == "gelu" else dropout), d_model, ffn_gates,
                            dropout)
        for sublayer in (self.attn, self.ffn):
            sublayer.norm.eps = LAYER_NORM_EPS

    def forward(self, x: Tensor, key_mask: Tensor | None = None, context: Tensor | None = None) -> Tensor:
        """``x`` the rows to compute, ``context`` (default ``x``) the rows the attention's keys and values read."""
        return self.ffn(self.attn(x, key_mask, context))


class BertEncoder(nn.Module):
    """BERT's embeddings and layers, and (``pooler=True``) the pooler: ``BertModel``'s parameters exactly.

    ``forward(tokens (B, L), token_types=None, attention_mask=None, select=None) -> states``: ``attention_mask``
    ``(B, L)`` is True (or 1) at real tokens; ``states`` is ``(B, L, d)``, or with ``select`` ``(B, M)`` (positions)
    the last layer's ``(B, M, d)`` at those positions only. :meth:`pool` is the pooler on ``[CLS]``'s state.
    """

    def __init__(self, vocab_size: int, d_model: int = 768, n_layers: int = 12, n_heads: int = 12, d_ffn: int = 3072,
                 dropout: float = 0.1, attn_dropout: float = 0.1, max_positions: int = 512, type_vocab: int = 2,
                 gates: str = "", ffn: str = "gelu", pooler: bool = True) -> None:
        super().__init__()
        check_lm_sizes(vocab_size, d_model, n_layers, n_heads, d_ffn)
        for name, value in (("max_positions", max_positions), ("type_vocab", type_vocab)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}")
        placement = resolve_placement(gates, n_layers)
        self.d_model = d_model
        self.embeddings = BertEmbeddings(vocab_size, d_model, max_positions, type_vocab, dropout)
        self.layers = nn.ModuleList(
            BertLayer(d_model, n_heads, d_ffn, dropout, attn_dropout, ffn, placement.at(i, "attn"),
                      placement.at(i, "ffn"))
            for i in range(n_layers))
        self.pooler = nn.Linear(d_model, d_model) if pooler else None

    def forward(self, tokens: Tensor, token_types: Tensor | None = None, attention_mask: Tensor | None = None,
                select: Tensor | None = None) -> Tensor:
        key_mask = None if attention_mask is None else attention_mask.bool()
        x = self.embeddings(tokens, token_types)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if i == last and select is not None:
                rows = x.gather(1, select.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
                return layer(rows, key_mask, x)
            x = layer(x, key_mask)
        return x

    def pool(self, first: Tensor) -> Tensor:
        """``tanh(W_p h + b_p)`` of ``[CLS]``'s final state ``first`` ``(B, d)``."""
        if self.pooler is None:
            raise ValueError("this encoder was built without a pooler")
        return torch.tanh(self.pooler(first))


class MaskedLMHead(nn.Module):
    """``LN(GELU(W_t h + b_t))``, then the decoder (its weight the token embeddings', its bias its own)."""

    def __init__(self, embeddings: nn.Embedding) -> None:
        super().__init__()
        vocab_size, d_model = embeddings.weight.shape
        self.transform = nn.Linear(d_model, d_model)
        self.norm = nn.LayerNorm(d_model, eps=LAYER_NORM_EPS)
        self.decoder = OutputLayer(d_model, vocab_size)
        self.decoder.weight = embeddings.weight

    def hidden(self, states: Tensor) -> Tensor:
        return self.norm(F.gelu(self.transform(states)))


class BertForMaskedLM(nn.Module):
    """The encoder (no pooler, as Hugging Face's ``BertForMaskedLM``) and the MLM head.

    ``forward(tokens, token_types=None, attention_mask=None, *, positions=None, targets=None)`` gives a
    :class:`~gatedformer.nn.outputs.ModelOutput`: the ``logits`` ``(B, L, V)`` of every position, or of
    ``positions`` ``(B, M)`` only (``(B, M, V)``); given ``targets`` ``(B, M)`` (``ignore_index`` where a row of
    ``positions`` is padding), their cross-entropy as ``loss`` instead (the decoder's
    :meth:`~gatedformer.nn.output.OutputLayer.loss`, which the fused model computes without the logits).
    """

    def __init__(self, vocab_size: int, **encoder: object) -> None:
        super().__init__()
        self.bert = BertEncoder(vocab_size, pooler=False, **encoder)  # type: ignore[arg-type]
        self.head = MaskedLMHead(self.bert.embeddings.tokens)

    def forward(self, tokens: Tensor, token_types: Tensor | None = None, attention_mask: Tensor | None = None, *,
                positions: Tensor | None = None, targets: Tensor | None = None, ignore_index: int = -100,
                reduction: str = "mean") -> ModelOutput:
        hidden = self.head.hidden(self.bert(tokens, token_types, attention_mask, positions))
        if targets is None:
            return ModelOutput(logits=self.head.decoder(hidden))
        return ModelOutput(loss=self.head.decoder.loss(hidden, targets, ignore_index, reduction))


class BertForSequenceClassification(nn.Module):
    """The encoder with its pooler, dropout and a linear layer: ``num_labels`` logits (1: a regression score).

    ``forward(tokens, token_types=None, attention_mask=None)`` gives a :class:`~gatedformer.nn.outputs.ModelOutput`
    of ``logits`` ``(B, num_labels)``; the last layer computes ``[CLS]``'s row alone.
    """

    def __init__(self, vocab_size: int, num_labels: int, dropout: float = 0.1, **encoder: object) -> None:
        super().__init__()
        if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(f"num_labels must be at least 1, got {num_labels!r}")
        self.bert = BertEncoder(vocab_size, dropout=dropout, pooler=True, **encoder)  # type: ignore[arg-type]
        self.dropout = Dropout(dropout)
        self.classifier = nn.Linear(self.bert.d_model, num_labels)

    def forward(self, tokens: Tensor, token_types: Tensor | None = None, attention_mask: Tensor | None = None
                ) -> ModelOutput:
        first = tokens.new_zeros((tokens.shape[0], 1))
        cls = self.bert(tokens, token_types, attention_mask, first)[:, 0]
        return ModelOutput(logits=self.classifier(self.dropout(self.bert.pool(cls))))


# ---------------------------------------------------------------------------------------------
# Hugging Face checkpoints


def read_hf_config(folder: Path) -> dict:
    """A Hugging Face BERT checkpoint folder's ``config.json``; a :class:`CheckpointError` if it has none."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"model.init_from_hf: cannot read {path} ({getattr(err, 'strerror', None) or err}); "
                              "give a Hugging Face BERT checkpoint folder (config.json, weights, vocab.txt)") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"model.init_from_hf: {path} is not a BERT config")
    return config


def hf_config_differences(hf: dict, cfg: ModelConfig, vocab_size: int) -> list[str]:
    """Where a Hugging Face config and ours disagree on a size (each as ``field: theirs vs ours``)."""
    pairs = (("hidden_size", "model.d_model", cfg.d_model), ("num_hidden_layers", "model.n_layers", cfg.n_layers),
             ("num_attention_heads", "model.n_heads", cfg.n_heads), ("intermediate_size", "model.d_ffn", cfg.d_ffn),
             ("max_position_embeddings", "model.max_positions", cfg.max_positions),
             ("type_vocab_size", "model.type_vocab", cfg.type_vocab), ("vocab_size", "the vocabulary", vocab_size))
    out = [f"{ours} {value} vs their {theirs} {hf.get(theirs)}" for theirs, ours, value in pairs
           if hf.get(theirs) != value]
    if hf.get("hidden_act", "gelu") != "gelu" or cfg.ffn != "gelu":
        out.append(f"model.ffn {cfg.ffn!r} vs their hidden_act {hf.get('hidden_act')!r} (both must be gelu)")
    return out


def _rename(key: str) -> str:
    # Checkpoints converted from TensorFlow name LayerNorm's parameters gamma and beta.
    return key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")


def hf_to_ours(state: dict[str, Tensor], n_layers: int, prefix: str = "bert.") -> dict[str, Tensor]:
    """The weights of a Hugging Face ``BertModel`` / ``BertForMaskedLM`` / ``BertForPreTraining`` state dict under our
    names, ``prefix`` + the encoder's (its MLM head's too, where it has one, as ``head.``)."""
    state = {_rename(k).removeprefix("bert."): v for k, v in state.items()}
    out: dict[str, Tensor] = {}

    def take(theirs: str, ours: str) -> None:
        if theirs in state:
            out[ours] = state[theirs]

    for theirs, ours in (("word_embeddings", "tokens"), ("position_embeddings", "positions"),
                         ("token_type_embeddings", "token_types")):
        take(f"embeddings.{theirs}.weight", f"{prefix}embeddings.{ours}.weight")
    for kind in ("weight", "bias"):
        take(f"embeddings.LayerNorm.{kind}", f"{prefix}embeddings.norm.{kind}")
        take(f"pooler.dense.{kind}", f"{prefix}pooler.{kind}")
        for i in range(n_layers):
            theirs, ours = f"encoder.layer.{i}.", f"{prefix}layers.{i}."
            parts = [state.get(f"{theirs}attention.self.{name}.{kind}") for name in ("query", "key", "value")]
            if all(part is not None for part in parts):
                out[f"{ours}attn.body.qkv.{kind}"] = torch.cat(parts, dim=0)  # type: ignore[arg-type]
            take(f"{theirs}attention.output.dense.{kind}", f"{ours}attn.body.out.{kind}")
            take(f"{theirs}attention.output.LayerNorm.{kind}", f"{ours}attn.norm.{kind}")
            take(f"{theirs}intermediate.dense.{kind}", f"{ours}ffn.body.inner.{kind}")
            take(f"{theirs}output.dense.{kind}", f"{ours}ffn.body.outer.{kind}")
            take(f"{theirs}output.LayerNorm.{kind}", f"{ours}ffn.norm.{kind}")
        take(f"cls.predictions.transform.dense.{kind}", f"head.transform.{kind}")
        take(f"cls.predictions.transform.LayerNorm.{kind}", f"head.norm.{kind}")
    take("cls.predictions.bias", "head.decoder.bias")
    return out


def _hf_weights(folder: Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    safetensors, pickled = folder / "model.safetensors", folder / "pytorch_model.bin"
    try:
        if safetensors.is_file():
            return load_file(str(safetensors))
        if pickled.is_file():
            # weights_only: a pickle that holds anything but tensors is refused, never run.
            state = torch.load(pickled, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, Tensor)
                                                      for k, v in state.items()):
                raise CheckpointError(f"model.init_from_hf: {pickled} holds no state dict of named tensors; give a "
                                      "Hugging Face BERT checkpoint (model.safetensors or pytorch_model.bin)")
            return state
    except pickle.UnpicklingError as err:
        if "weights only" not in str(err).lower():  # not a pickle at all: truncated or another file
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:120]
            raise CheckpointError(f"model.init_from_hf: cannot read the weights in {folder} ({reason})") from None
        raise CheckpointError(f"model.init_from_hf: refused to load {pickled}: it holds objects other than tensors, "
                              "which could run code; give the checkpoint's model.safetensors instead") from None
    except (SafetensorError, OSError, RuntimeError, ValueError, EOFError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:120]
        raise CheckpointError(f"model.init_from_hf: cannot read the weights in {folder} ({reason})") from None
    raise CheckpointError(f"model.init_from_hf: {folder} holds no model.safetensors or pytorch_model.bin")


def load_hf_checkpoint(model: nn.Module, folder: str | Path, cfg: ModelConfig) -> list[str]:
    """Load a local Hugging Face BERT checkpoint into ``model`` (a :class:`BertForMaskedLM` or
    :class:`BertForSequenceClassification`): every encoder weight must be there; the MLM head and the pooler load
    where the checkpoint has them. Returns the names of the tensors left as they were (gates, heads)."""
    folder = Path(folder).expanduser()
    bert = model.bert  # type: ignore[union-attr]
    vocab_size = bert.embeddings.tokens.num_embeddings
    differences = hf_config_differences(read_hf_config(folder), cfg, vocab_size)
    if differences:
        raise ConfigError(f"model.init_from_hf: {folder} is another model size ({'; '.join(differences[:3])}); set "
                          "the model fields to the checkpoint's")
    bodies = {GATE_KINDS[name].label for site in resolve_placement(cfg.gates, cfg.n_layers).sites.values()
              for name in site.kinds if GATE_KINDS[name].role == "body"}
    if bodies:  # a GLU variant is another feed-forward than BERT's, with weights of other shapes
        raise ConfigError(f"model.init_from_hf: a BERT checkpoint holds no weights for the {', '.join(sorted(bodies))} "
                          "feed-forward; drop it from model.gates, or train from scratch without model.init_from_hf")
    state = hf_to_ours(_hf_weights(folder), len(bert.layers))
    expected = model.state_dict()
    encoder = [k for k in expected if k.startswith("bert.") and ".pooler." not in f".{k}" and kind_in_name(k) is None]
    missing = [k for k in encoder if k not in state]
    if missing:
        raise CheckpointError(f"model.init_from_hf: {folder} lacks encoder weights ({', '.join(missing[:3])}); give a "
                              "BERT checkpoint")
    taken = {k: v for k, v in state.items() if k in expected}
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(expected[k].shape)}" for k, v in taken.items()
             if v.shape != expected[k].shape]
    if wrong:
        raise CheckpointError(f"model.init_from_hf: {folder} does not fit ({', '.join(wrong[:2])})")
    model.load_state_dict(taken, strict=False)
    return [k for k in expected if k not in taken]


# ---------------------------------------------------------------------------------------------
# The backbone table


def _encoder_args(cfg: ModelConfig) -> dict[str, object]:
    return {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "d_ffn": cfg.d_ffn,
            "attn_dropout": cfg.attn_dropout, "max_positions": cfg.max_positions, "type_vocab": cfg.type_vocab,
            "gates": cfg.gates, "ffn": cfg.ffn}


def _check(cfg: ModelConfig) -> None:
    if cfg.norm != "post":
        raise ConfigError(f"model.norm={cfg.norm!r}: BERT's layers are post-LN; leave model.norm at post")
    if cfg.ffn == "glu":
        raise ConfigError("model.ffn=glu does not fit BERT's layout; use gelu (BERT's) or relu")
    for key in ("max_positions", "type_vocab"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"model.{key} must be positive, got {getattr(cfg, key)}")


_DESCRIPTION = ("BERT in bert-base-uncased's layout: learned positions and token types, post-LN layers with a GELU "
                "feed-forward, a tanh pooler; '+EAU+GRC' puts an EAU after every self-attention and a GRC on every "
                "residual")
# init_from_hf: read by the masked-LM and GLUE tasks, which load the checkpoint into the model
_FIELDS = ("d_model", "n_layers", "n_heads", "d_ffn", "dropout", "attn_dropout", "ffn", "gates", "max_positions",
           "type_vocab", "init_from_hf")


@register_backbone("bert", task="mlm", fields=_FIELDS, check=_check,
                   description=_DESCRIPTION + " (with the MLM head, its decoder tied)")
def build_mlm(cfg: ModelConfig, vocab_size: int) -> BertForMaskedLM:
    return BertForMaskedLM(vocab_size, dropout=cfg.dropout, **_encoder_args(cfg))


@register_backbone("bert", task="glue", fields=_FIELDS, check=_check,
                   description=_DESCRIPTION + " (with a classification or regression head on the pooled output)")
def build_classifier(cfg: ModelConfig, vocab_size: int, num_labels: int) -> BertForSequenceClassification:
    return BertForSequenceClassification(vocab_size, num_labels, dropout=cfg.dropout, **_encoder_args(cfg))
