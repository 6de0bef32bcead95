"""Parameter counts, total and per component, so the cost of each gate is visible."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from torch import nn

from gatedformer.backbones import build_model
from gatedformer.config import build_config, load_recipe

GATE_KINDS = {"sdu": "SDU", "highway": "highway gate", "gated_mix": "gated MHDPA", "eau": "EAU",
              "residual_gate": "GRC"}


def component_of(name: str) -> str:
    """The component a parameter belongs to, from its qualified name."""
    parts = name.split(".")
    for part in parts:
        if part in GATE_KINDS:
            return f"gate: {GATE_KINDS[part]}"
    if any("norm" in part for part in parts[:-1]):
        return "norms"
    if parts[0].startswith("embed"):
        return "embeddings"
    if parts[0] in ("output", "head", "lm_head"):
        return "output"
    for part in parts:
        if part in ("attn", "self_attn", "cross_attn"):
            return "attention"
        if part in ("ffn", "feed_forward"):
            return "feed-forward"
    return parts[0]


def count_by_component(model: nn.Module) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    seen: set[int] = set()
    for name, parameter in model.named_parameters():
        if id(parameter) in seen:
            continue
        seen.add(id(parameter))
        counts[component_of(name)] += parameter.numel()
    return dict(sorted(counts.items()))


def parameter_report(recipe_name: str, overrides: list[str], data_dir: str | None = None,
                     vocab_size: int | None = None) -> dict[str, Any]:
    """Counts for the recipe's config and for each of its variants, with a printable table."""
    recipe = load_recipe(recipe_name)
    rows = []
    for variant in recipe.variants:
        config = build_config(recipe, overrides, variant)
        size = vocab_size or _vocab_size(config.data.corpus, data_dir)
        model = build_model(config.model, size)
        components = count_by_component(model)
        rows.append({"variant": variant.name, "total": sum(components.values()), "components": components,
                     "vocab_size": size})
    base = rows[0]["total"]
    lines = [f"{'variant':<24} {'total':>12} {'vs first':>10}  components"]
    for row in rows:
        extra = f"{(row['total'] - base) / base * 100:+.2f}%"
        parts = ", ".join(f"{k} {v:,}" for k, v in row["components"].items())
        lines.append(f"{row['variant']:<24} {row['total']:>12,} {extra:>10}  {parts}")
    return {"recipe": recipe.name, "variants": rows, "text": "\n".join(lines)}


def _vocab_size(corpus: str, data_dir: str | None) -> int:
    from gatedformer.data import load_corpus

    return len(load_corpus(corpus, data_dir).vocab)
