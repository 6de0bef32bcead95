"""Parameter counts of the BERT and sentence-classification recipes (``gatedformer params``).

A BERT variant's encoder is counted as Hugging Face's ``BertModel`` counts it (embeddings, layers and the pooler; the
gates a spec adds among them, by kind), and the MLM head apart (its transform, LayerNorm and decoder bias: the
decoder's weight is the token embeddings').
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from gatedformer.config import Recipe, RunConfig, build_config, task_of
from gatedformer.gates.kinds import kind_in_name
from gatedformer.models.bert import BertEncoder
from gatedformer.tasks import task_for

__all__ = ["bert_components", "text_parameter_report"]


def bert_components(model: nn.Module) -> dict[str, int]:
    """Parameters of a BERT model by component: embeddings, attention, feed-forward, norms, pooler, each gate kind,
    and the heads (MLM head, classifier); tied parameters once."""
    counts: dict[str, int] = {}
    seen: set[int] = set()
    for name, parameter in model.named_parameters():
        if id(parameter) in seen:
            continue
        seen.add(id(parameter))
        parts = name.split(".")
        kind = kind_in_name(name)
        if kind is not None:
            part = f"gate: {kind.label}"
        elif parts[0] == "head":
            part = "MLM head"
        elif parts[0] == "classifier":
            part = "classifier"
        elif "embeddings" in parts:
            part = "embeddings"
        elif "norm" in parts:
            part = "norms"
        elif "pooler" in parts:
            part = "pooler"
        elif "attn" in parts:
            part = "attention"
        elif "ffn" in parts:
            part = "feed-forward"
        else:
            part = parts[0]
        counts[part] = counts.get(part, 0) + parameter.numel()
    return dict(sorted(counts.items()))


def _bert_vocab(config: RunConfig, vocab_size: int | None) -> tuple[int, str]:
    if vocab_size:
        return vocab_size, "given"
    if config.tokenizer.vocab_file:
        path = Path(config.tokenizer.vocab_file).expanduser()
        try:
            return sum(1 for line in path.read_text(encoding="utf-8").split("\n") if line), str(path)
        except (OSError, UnicodeDecodeError):
            pass
    return config.tokenizer.vocab_size, "tokenizer.vocab_size"


def text_parameter_report(recipe: Recipe, overrides: list[str], data_dir: str | None = None,
                          vocab_size: int | None = None) -> dict[str, Any]:
    """Counts of every variant of a BERT or sentence-classification recipe, with a printable table."""
    config = build_config(recipe, overrides)
    task = task_of(config)
    rows = []
    if task in ("mlm", "glue"):
        size, source = _bert_vocab(config, vocab_size)
        for variant in recipe.variants:
            m = build_config(recipe, overrides, variant).model
            with torch.device("meta"):
                encoder = BertEncoder(size, m.d_model, m.n_layers, m.n_heads, m.d_ffn, m.dropout, m.attn_dropout,
                                      m.max_positions, m.type_vocab, m.gates, m.ffn, pooler=True)
                model = task_for(build_config(recipe, overrides, variant)).nominal_model(
                    build_config(recipe, overrides, variant), size)
            components = bert_components(encoder)
            heads = {k: v for k, v in bert_components(model).items() if k in ("MLM head", "classifier")}
            rows.append({"variant": variant.name, "total": sum(components.values()), "components": components,
                         "heads": heads, "vocab_size": size})
        title = (f"{recipe.name}: the encoder counted as Hugging Face's BertModel counts it (pooler included), "
                 f"vocabulary {size:,} ({source}); heads apart")
    else:
        size = vocab_size or 0
        for variant in recipe.variants:
            variant_config = build_config(recipe, overrides, variant)
            if not size:
                size = len(task_for(variant_config).load_data(variant_config, data_dir).words)
            with torch.device("meta"):
                model = task_for(variant_config).nominal_model(variant_config, size)
            components: dict[str, int] = {}
            for name, parameter in model.named_parameters():
                part = name.split(".")[0]
                components[part] = components.get(part, 0) + parameter.numel()
            rows.append({"variant": variant.name, "total": sum(components.values()), "components": components,
                         "heads": {}, "vocab_size": size})
        title = f"{recipe.name}: vocabulary {size:,}"
    base = rows[0]["total"]
    width = max(24, *(len(row["variant"]) for row in rows))
    lines = [title, "", f"{'variant':<{width}} {'encoder' if task in ('mlm', 'glue') else 'total':>12} "
             f"{'vs first':>10}  components"]
    for row in rows:
        extra = f"{(row['total'] - base) / base * 100:+.2f}%"
        parts = ", ".join(f"{k} {v:,}" for k, v in row["components"].items())
        heads = "".join(f"; {k} {v:,} apart" for k, v in row["heads"].items())
        lines.append(f"{row['variant']:<{width}} {row['total']:>12,} {extra:>10}  {parts}{heads}")
    return {"recipe": recipe.name, "variants": rows, "text": "\n".join(lines)}
