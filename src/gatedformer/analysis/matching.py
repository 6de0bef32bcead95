"""A parameter-matched baseline: the same network as a recipe's baseline with its feed-forward width chosen so that
it counts as many parameters as a gated variant (within 0.5 %).

The EAU/GRC paper (§4.4) asks of its gates what every comparison of a gated model should: is it better, or only
bigger? A variant with ``match_params = "<variant>"`` in a recipe (or ``compare --matched-baseline``) answers it: its
``model.d_ffn`` is solved for here. Parameter counts are linear in the feed-forward width, so two counts give the
slope and one solve the width; the counts are taken on the meta device (no memory for the weights) at a nominal
vocabulary, since the embeddings and output layer are the same for both variants and the difference does not depend
on the vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch

from gatedformer.config import Recipe, RunConfig, Variant, build_config, config_from_dict
from gatedformer.errors import ConfigError
from gatedformer.tasks import task_for

__all__ = ["TOLERANCE", "matched_config", "matched_ffn", "parameter_count", "with_matched_baseline"]

TOLERANCE = 0.005
"""How close a matched count must come to its target: 0.5 % of the target."""
_NOMINAL_VOCAB = 256


def parameter_count(config: RunConfig, vocab_size: int = _NOMINAL_VOCAB) -> int:
    """Parameters of ``config``'s network (tied ones once) with every vocabulary of ``vocab_size`` tokens."""
    with torch.device("meta"):
        model = task_for(config).nominal_model(config, vocab_size)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def matched_ffn(config: RunConfig, target: int, vocab_size: int = _NOMINAL_VOCAB) -> int:
    """The ``model.d_ffn`` at which ``config``'s network counts ``target`` parameters at ``vocab_size`` (within
    :data:`TOLERANCE`); a :class:`ConfigError` where no width does."""
    def count(width: int) -> int:
        sized = config_from_dict(config.to_dict())
        sized.model.d_ffn = width
        return parameter_count(sized, vocab_size)

    width = config.model.d_ffn
    # Over 3 widths: a GLU-variant feed-forward's hidden width is round(2/3 · d_ffn), which steps 2 of every 3.
    here = count(width)
    slope = (count(width + 3) - here) / 3
    if slope <= 0:
        raise ConfigError(f"model.backbone={config.model.backbone} has no feed-forward width that changes its size; "
                          "a parameter-matched baseline needs one (a Transformer-style backbone)")
    guess = round(width + (target - here) / slope)
    matched = min((w for w in range(max(1, guess - 1), guess + 2)), key=lambda w: abs(count(w) - target))
    reached = count(matched)
    if abs(reached - target) > TOLERANCE * target:
        raise ConfigError(f"no feed-forward width matches {target:,} parameters within {TOLERANCE:.1%} (d_ffn "
                          f"{matched} gives {reached:,}); match a variant closer in size")
    return matched


def matched_config(recipe: Recipe, overrides: list[str], variant: Variant) -> RunConfig:
    """The config of ``variant``: :func:`~gatedformer.config.build_config`'s, with ``model.d_ffn`` solved for where
    the variant matches another's parameters."""
    config = build_config(recipe, overrides, variant)
    if variant.match_params is None:
        return config
    target_variant = next(v for v in recipe.variants if v.name == variant.match_params)
    target = parameter_count(build_config(recipe, overrides, target_variant))
    config.model.d_ffn = matched_ffn(config, target)
    return config


def with_matched_baseline(recipe: Recipe, overrides: list[str], target: str = "") -> Recipe:
    """``recipe`` with one more variant: its first variant (the baseline) at the parameter count of ``target`` (by
    default the variant with the most parameters), its feed-forward width solved for
    (:mod:`gatedformer.analysis.matching`)."""
    counts = {v.name: parameter_count(build_config(recipe, overrides, v)) for v in recipe.variants}
    if not target:
        target = max(recipe.variants[1:] or recipe.variants, key=lambda v: counts[v.name]).name
    if target not in counts:
        raise ConfigError(f"--matched-baseline {target!r} is not a variant of {recipe.name}; its variants: "
                          f"{', '.join(counts)}")
    base = recipe.variants[0]
    name = f"{base.name}, params of {target}"
    if any(v.name == name or v.match_params == target for v in recipe.variants):
        return recipe  # the recipe has that variant already
    matched = Variant(name, list(base.overrides), None, target)
    return dataclasses.replace(recipe, variants=[*recipe.variants, matched])
