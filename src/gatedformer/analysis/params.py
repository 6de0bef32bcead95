"""Parameter counts, total and per component, so the cost of each gate is visible."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from gatedformer.analysis.matching import matched_config, with_matched_baseline
from gatedformer.config import (
    Recipe,
    RunConfig,
    build_config,
    check_overrides_spare_variants,
    get_backbone,
    load_recipe,
    task_of,
)
from gatedformer.errors import ConfigError, DataError
from gatedformer.gates.kinds import kind_in_name
from gatedformer.tasks import task_for

# The recurrent parts' module names: the R-Transformer's LocalRNN, and the SRU alone or inside a Transformer's
# feed-forward sublayer.
_RECURRENT = {"local_rnn": "local RNN", "sru": "SRU"}


def component_of(name: str) -> str:
    """The component a parameter belongs to, from its qualified name."""
    parts = name.split(".")
    kind = kind_in_name(name)
    if kind is not None:
        return f"gate: {kind.label}"
    if any("norm" in part for part in parts[:-1]):
        return "norms"
    if parts[0].startswith("embed") or any(part.startswith("embed_") for part in parts[:-1]):
        return "embeddings"
    if parts[0] in ("output", "head", "lm_head"):
        return "output"
    recurrent = next((_RECURRENT[part] for part in parts if part in _RECURRENT), None)
    if recurrent is not None:  # an SRU in a feed-forward sublayer counts as the SRU, not as the feed-forward
        return recurrent
    for part in parts:
        if part in ("attn", "self_attn", "cross_attn"):
            return "attention"
        if part in ("ffn", "feed_forward"):
            return "feed-forward"
        if part == "conv":
            return "convolutions"
        if part in ("fc1", "fc2", "projections"):  # ConvS2S's maps between the embeddings and the channels
            return "projections"
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
                     vocab_size: int | None = None, matched_baseline: str | None = None) -> dict[str, Any]:
    """Counts for the recipe's config and for each of its variants (with ``matched_baseline``, as ``compare``
    takes it, one more: the baseline at that variant's size), with a printable table."""
    if vocab_size is not None and vocab_size < 1:
        raise ConfigError(f"--vocab-size must be a positive number of tokens, got {vocab_size}")
    recipe = load_recipe(recipe_name)
    check_overrides_spare_variants(recipe, overrides)
    if matched_baseline is not None:
        recipe = with_matched_baseline(recipe, overrides, matched_baseline)
    if task_of(build_config(recipe, overrides)) == "translation":
        return translation_parameter_report(recipe, overrides, data_dir, vocab_size)
    if task_of(build_config(recipe, overrides)) in ("mlm", "glue", "sentclass"):
        from gatedformer.analysis.text_params import text_parameter_report

        return text_parameter_report(recipe, overrides, data_dir, vocab_size)
    rows = []
    for variant in recipe.variants:
        config = matched_config(recipe, overrides, variant)
        size = vocab_size or _vocab_size(config, data_dir)
        with torch.device("meta"):  # shapes only: counting needs no memory for the weights
            components = count_by_component(task_for(config).nominal_model(config, size))
        rows.append({"variant": variant.name, "total": sum(components.values()), "components": components,
                     "vocab_size": size})
    base = rows[0]["total"]
    width = max(24, *(len(row["variant"]) for row in rows))
    lines = [f"{'variant':<{width}} {'total':>12} {'vs first':>10}  components"]
    for row in rows:
        extra = f"{(row['total'] - base) / base * 100:+.2f}%"
        parts = ", ".join(f"{k} {v:,}" for k, v in row["components"].items())
        lines.append(f"{row['variant']:<{width}} {row['total']:>12,} {extra:>10}  {parts}")
    return {"recipe": recipe.name, "variants": rows, "text": "\n".join(lines)}


def _vocab_size(config: RunConfig, data_dir: str | None) -> int:
    """The vocabulary's size: a language model's corpus's, else (question answering) the words the task reads from
    its training data."""
    if task_of(config) == "lm":
        from gatedformer.data import load_corpus

        return len(load_corpus(config.data.corpus, data_dir).vocab)
    try:
        return len(task_for(config).load_data(config, data_dir).vocab)
    except DataError as err:
        raise DataError(f"{err}; or give the vocabulary's size with --vocab-size N") from None


# The three model sizes of the EAU/GRC paper's translation experiments: (l, n, k, f).
PAPER_TRANSLATION_SIZES = ((3, 128, 256, 1024), (2, 128, 256, 1024), (2, 64, 128, 512))


def translation_parameter_report(recipe: Recipe, overrides: list[str], data_dir: str | None = None,
                                 vocab_size: int | None = None) -> dict[str, Any]:
    """Counts of a translation recipe's variants, and baseline against +EAU+GRC at the paper's three
    sizes (l layers, n longest sequence, k width, f feed-forward width; n changes no count).

    Vocabulary sizes come from ``translation.src_vocab`` / ``tgt_vocab`` when set (e.g. with
    ``--set translation.src_vocab=5921``), else from ``vocab_size``, else from the training data.
    """
    from gatedformer.tasks.translation import build_seq2seq

    config = build_config(recipe, overrides)
    src_size, tgt_size, source = _translation_vocab_sizes(config, data_dir, vocab_size)
    rows = []
    for variant in recipe.variants:
        variant_config = matched_config(recipe, overrides, variant)
        with torch.device("meta"):
            components = count_by_component(build_seq2seq(variant_config, src_size, tgt_size))
        rows.append({"variant": variant.name, "total": sum(components.values()), "components": components,
                     "vocab_size": [src_size, tgt_size]})
    sizes = []
    # The EAU paper's sizes, where the recipe's network takes its gates (ConvS2S has none to place).
    gated = get_backbone(config.model.backbone, "translation").gated
    for layers, max_len, width, ffn in PAPER_TRANSLATION_SIZES if gated else ():
        counts = {}
        for name, spec in (("baseline", ""), ("+EAU+GRC", "+EAU+GRC")):
            sized = build_config(recipe, [*overrides, f"model.n_layers={layers}", f"translation.max_len={max_len}",
                                          f"model.d_model={width}", f"model.d_ffn={ffn}",
                                          f"model.n_heads={_heads_for(width, config.model.n_heads)}",
                                          f"model.gates={spec}"])
            with torch.device("meta"):
                counts[name] = sum(count_by_component(build_seq2seq(sized, src_size, tgt_size)).values())
        sizes.append({"l": layers, "n": max_len, "k": width, "f": ffn, **counts})

    tr = config.translation
    name_width = max(24, *(len(row["variant"]) for row in rows))
    lines = [f"{recipe.name}: {tr.src_lang}→{tr.tgt_lang}, vocabularies: source {src_size:,}, target {tgt_size:,} "
             f"({source})", "", f"{'variant':<{name_width}} {'total':>12} {'vs first':>10}  components"]
    base = rows[0]["total"]
    for row in rows:
        extra = f"{(row['total'] - base) / base * 100:+.2f}%"
        parts = ", ".join(f"{k} {v:,}" for k, v in row["components"].items())
        lines.append(f"{row['variant']:<{name_width}} {row['total']:>12,} {extra:>10}  {parts}")
    if sizes:
        lines += ["", "paper sizes (l layers, n max length, k width, f feed-forward; n does not change the count):",
                  f"{'l':>2} {'n':>4} {'k':>4} {'f':>5} {'baseline':>12} {'+EAU+GRC':>12} {'added':>10}"]
    for row in sizes:
        added = (row["+EAU+GRC"] - row["baseline"]) / row["baseline"] * 100
        lines.append(f"{row['l']:>2} {row['n']:>4} {row['k']:>4} {row['f']:>5} {row['baseline']:>12,} "
                     f"{row['+EAU+GRC']:>12,} {added:>+9.2f}%")
    return {"recipe": recipe.name, "variants": rows, "paper_sizes": sizes, "src_vocab": src_size,
            "tgt_vocab": tgt_size, "text": "\n".join(lines)}


def _heads_for(width: int, heads: int) -> int:
    # Heads change no parameter count; fall back to one head where the recipe's do not divide k.
    return heads if width % heads == 0 else 1


def _translation_vocab_sizes(config: RunConfig, data_dir: str | None, vocab_size: int | None) -> tuple[int, int, str]:
    tr = config.translation
    if tr.src_vocab and tr.tgt_vocab:
        return tr.src_vocab, tr.tgt_vocab, "translation.src_vocab / tgt_vocab"
    if vocab_size and not (tr.src_vocab or tr.tgt_vocab):
        return vocab_size, vocab_size, "given"
    from gatedformer.errors import DataError
    from gatedformer.tasks.translation import load_data

    try:
        data = load_data(config, data_dir)
    except DataError as err:
        raise DataError(
            f"{err}; or give the sizes with --set translation.src_vocab=N --set translation.tgt_vocab=N"
        ) from None
    return (tr.src_vocab or len(data.src_vocab), tr.tgt_vocab or len(data.tgt_vocab),
            f"from the training data, min_freq {tr.min_freq}")
