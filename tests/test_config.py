"""Recipes, overrides and validation: every bad value is one ConfigError naming the fix."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatedformer.config import (
    RunConfig,
    apply_overrides,
    build_config,
    config_from_dict,
    load_recipe,
    recipe_names,
    validate,
)
from gatedformer.errors import ConfigError


def test_every_shipped_recipe_loads_and_validates() -> None:
    names = recipe_names()
    assert "ptb-char-tiny" in names
    for name in names:
        recipe = load_recipe(name)
        assert recipe.variants, name
        for variant in recipe.variants:
            build_config(recipe, [], variant)


def test_overrides_are_typed() -> None:
    config = apply_overrides(RunConfig(), ["model.d_model=256", "model.dropout=0.25", "model.tie_embeddings=yes",
                                           "model.emb_dropout=none", "model.gates=+tanh L1-2"])
    assert config.model.d_model == 256 and isinstance(config.model.d_model, int)
    assert config.model.dropout == 0.25
    assert config.model.tie_embeddings is True
    assert config.model.emb_dropout is None
    assert config.model.gates == "+tanh L1-2"


def test_later_overrides_win_and_round_trip_through_dict() -> None:
    config = apply_overrides(RunConfig(), ["train.steps=5", "train.steps=7"])
    assert config.train.steps == 7
    assert config_from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("model.d_modle=3", "did you mean model.d_model"),
        ("modle.d_model=3", "unknown config key"),
        ("model.d_model=abc", "whole number"),
        ("model.dropout=high", "must be a number"),
        ("model.tie_embeddings=maybe", "true or false"),
        ("model.d_model", "key=value"),
        ("optim.lr=nan", "finite"),
    ],
)
def test_bad_overrides_name_the_problem(override: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        apply_overrides(RunConfig(), [override])


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("model.d_model=0", "model.d_model must be positive"),
        ("model.n_layers=-1", "model.n_layers must be positive"),
        ("data.seq_len=0", "data.seq_len must be positive"),
        ("model.dropout=1.0", r"model.dropout must be in \[0, 1\)"),
        ("model.dropout=-0.1", r"model.dropout must be in \[0, 1\)"),
        ("model.n_heads=3", "not divisible"),
        ("optim.name=rmsprop", "optim.name='rmsprop' is not one of"),
        ("optim.schedule=noam", "warmup_steps"),
        ("model.gates=+σ L7", "names layer 7 but the model has 3 layers"),
        ("model.gates=+wibble", "unknown word"),
        ("model.backbone=lstm", "model.backbone='lstm' is not one of"),
        ("model.backbone=sru;model.highway_bias=1000",
         "model.highway_bias=1000.0 must be a finite number of at most 170"),
        ("model.backbone=sru;model.highway_bias=170.5", "at most 170"),
        ("model.backbone=gcnn;model.gates=+σ SDU", "model.backbone=gcnn has no attention/FFN sublayers to gate"),
        ("train.seed=99999999999999999999999", "train.seed=99999999999999999999999 must be in 0 .. 4294967295"),
        ("train.seed=-1", "must be in 0 .."),
        ("train.threads=100000", r"train.threads=100000 must be 0 \(torch's default\) or 1 to 1024"),
    ],
)
def test_validation_names_the_field_and_fix(override: str, fragment: str) -> None:
    config = apply_overrides(RunConfig(), override.split(";"))
    with pytest.raises(ConfigError, match=fragment):
        validate(config)
    assert "\n" not in str(ConfigError(fragment))


def test_unknown_recipe_suggests_the_closest() -> None:
    with pytest.raises(ConfigError, match="did you mean ptb-char-tiny"):
        load_recipe("ptb-char-tinny")


def test_recipe_file_from_a_path(tmp_path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('[model]\nd_model = 64\nn_heads = 2\n[[variants]]\nname = "a"\nset = ["model.gates=+σ SDU"]\n')
    recipe = load_recipe(str(path))
    assert recipe.name == "mine" and recipe.config.model.d_model == 64
    assert build_config(recipe, [], recipe.variants[0]).model.gates == "+σ SDU"
    path.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_recipe(str(path))
    path.write_text("[model]\nwidth = 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'model.width'"):
        load_recipe(str(path))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40), st.text(max_size=40))
def test_any_override_is_applied_or_rejected_cleanly(key: str, value: str) -> None:
    config = RunConfig()
    try:
        apply_overrides(config, [f"{key}={value}"])
        validate(config)
    except ConfigError as err:
        assert str(err) and "\n" not in str(err)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["model.d_model", "model.n_heads", "model.dropout", "data.seq_len", "optim.lr",
                        "train.steps", "model.gates", "optim.schedule", "model.norm"]),
       st.one_of(st.integers(-5, 600).map(str), st.floats(allow_nan=True).map(str), st.text(max_size=12)))
def test_known_keys_with_any_value_are_valid_or_one_error(key: str, value: str) -> None:
    config = RunConfig()
    try:
        apply_overrides(config, [f"{key}={value}"])
        validate(config)
    except ConfigError as err:
        assert str(err) and "\n" not in str(err)
