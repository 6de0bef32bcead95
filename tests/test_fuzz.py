"""Fuzzed inputs: recipes, config dicts, ``--set`` overrides, gate specs and corpora either give a valid
run configuration or raise one GatedformerError with a one-line message; never another exception, never a
hang (every example runs under a hypothesis deadline)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import tempfile
from datetime import timedelta
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gatedformer.config import (
    RunConfig,
    apply_overrides,
    backbone_names,
    build_config,
    config_from_dict,
    load_recipe,
    validate,
)
from gatedformer.data import LMStream, load_corpus
from gatedformer.errors import GatedformerError
from gatedformer.gates.spec import resolve_placement

FAST = settings(max_examples=150, deadline=timedelta(seconds=5), suppress_health_check=[HealthCheck.too_slow])
SECTIONS = {s.name: [f.name for f in dataclasses.fields(getattr(RunConfig(), s.name))]
            for s in dataclasses.fields(RunConfig)}
KEYS = [f"{section}.{name}" for section, names in SECTIONS.items() for name in names]
# Values that a field could plausibly hold, and values that probe the edges of the parsers.
WORDS = ["transformer", "transformer-xl", "gcnn", "rtransformer", "sru", "adamw", "sgd", "noam", "cosine", "bf16",
         "fp32", "cpu", "auto", "cuda:0", "skip", "stop", "pre", "post", "glu", "lstm", "xavier", "multi30k",
         "ptb-char", "text:", "+σ SDU", "+tanh L1-2", "+σ L1-6\\FFN", "+EAU+GRC", "+highway gate", "eau /cross",
         "none", "null", "true", "no", "nan", "inf", "-inf", "1e400", "0x10", "1_000", "٣", "", " ", "\n", "\x00"]
counter = itertools.count()  # distinct file names: no example sees another's file (or its token cache)


def one_line(err: GatedformerError) -> None:
    message = str(err)
    assert message.strip() and "\n" not in message and "\r" not in message, repr(message)


def text(max_size: int = 12) -> st.SearchStrategy[str]:
    return st.text(st.characters(exclude_categories=("Cs",)), max_size=max_size)  # encodable as UTF-8


scalars = st.one_of(
    st.integers(-(2**63), 2**63 - 1), st.integers(-3, 600), st.floats(), st.booleans(),
    st.sampled_from(WORDS), text(),
)
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(text(6), scalars, max_size=2))
field_names = st.one_of(st.sampled_from(sorted({n for names in SECTIONS.values() for n in names})), text(8))
sections = st.dictionaries(st.one_of(st.sampled_from(list(SECTIONS)), text(8)),
                           st.one_of(st.dictionaries(field_names, values, max_size=5), scalars), max_size=4)
overrides = st.lists(st.builds("{}={}".format, st.one_of(st.sampled_from(KEYS), text()),
                               st.one_of(st.sampled_from(WORDS), scalars.map(str), text())), max_size=6)


def toml_value(value: object) -> str:
    """A TOML literal for ``value`` (TOML strings take JSON's escapes, floats take nan and inf)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


def toml_document(top: dict, tables: dict, variants: list[dict]) -> str:
    lines = [f"{json.dumps(k, ensure_ascii=False)} = {toml_value(v)}" for k, v in top.items()]
    for name, table in tables.items():
        lines.append(f"[{json.dumps(name, ensure_ascii=False)}]")
        items = table.items() if isinstance(table, dict) else [("value", table)]
        lines += [f"{json.dumps(k, ensure_ascii=False)} = {toml_value(v)}" for k, v in items]
    for variant in variants:
        lines.append("[[variants]]")
        lines += [f"{json.dumps(k, ensure_ascii=False)} = {toml_value(v)}" for k, v in variant.items()]
    return "\n".join(lines) + "\n"


variant_tables = st.lists(st.fixed_dictionaries({}, optional={
    "name": st.one_of(st.sampled_from(["baseline", "+σ SDU", ""]), text(), scalars),
    "set": st.one_of(overrides, scalars, st.lists(scalars, max_size=2)),
    "published": st.one_of(st.floats(), scalars),
    "extra": scalars,
}), max_size=3)
top_level = st.dictionaries(st.sampled_from(["description", "published_source", "published_metric", "variants",
                                             "model"]), scalars, max_size=2)
recipes = st.one_of(
    st.builds(toml_document, top_level, sections, variant_tables),
    text(200),  # mostly not TOML at all
    st.builds(lambda doc, cut: doc[:cut], st.builds(toml_document, top_level, sections, variant_tables),
              st.integers(0, 400)),  # a document cut short
)


def build_every_variant(path: Path) -> None:
    recipe = load_recipe(str(path))
    for variant in recipe.variants:
        config = build_config(recipe, [], variant)
        assert config_from_dict(config.to_dict()) == config


@FAST
@given(recipes)
def test_any_recipe_file_builds_or_fails_with_one_line(document: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"fuzz-{next(counter)}.toml"
        path.write_text(document, encoding="utf-8")
        try:
            build_every_variant(path)
        except GatedformerError as err:
            one_line(err)


@FAST
@given(st.binary(max_size=200))
def test_recipe_files_of_random_bytes(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "bytes.toml"
        path.write_bytes(data)
        try:
            build_every_variant(path)
        except GatedformerError as err:
            one_line(err)


@FAST
@given(st.one_of(text(40), st.sampled_from(["ptb-char-tiny", "a" * 300, "a" * 300 + ".toml", "/", ".", "~x/y",
                                             "~no_such_user_here/r.toml", "nul\x00name"])))
@example("line\nbreak.toml")  # the message quotes the name: still one line
def test_recipe_names_load_or_fail_with_one_line(name: str) -> None:
    try:
        load_recipe(name)
    except GatedformerError as err:
        one_line(err)


@FAST
@given(st.one_of(sections, st.dictionaries(text(8), values, max_size=3), values))
@example({"model": {"dropout": 10**400}})  # JSON (config.json) integers have no size limit: once an OverflowError
def test_nested_dicts_give_a_valid_config_or_one_error(data: object) -> None:
    try:
        config = validate(config_from_dict(data))  # type: ignore[arg-type]
    except GatedformerError as err:
        one_line(err)
    else:
        assert config_from_dict(config.to_dict()) == config


@FAST
@given(overrides)
@example(["model.n_layers=1000000000", "model.gates=+σ SDU"])  # once a hang: every layer was materialised
@example(["model.dropout=" + "9" * 5000])
def test_override_sequences_give_a_valid_config_or_one_error(sets: list[str]) -> None:
    config = RunConfig()
    try:
        validate(apply_overrides(config, sets))
    except GatedformerError as err:
        one_line(err)
    else:
        assert config_from_dict(config.to_dict()) == config


spec_words = st.sampled_from(["+", "σ", "tanh", "sdu", "SDU", "highway", "gate", "gated", "MHDPA", "EAU", "GRC",
                              "L1", "L2-3", "L0", "L1,3", "Lall", "L" + "9" * 30, "L1-99999999999", "L1-10000",
                              "\\FFN", "/attn", "/cross", "no", "ffn", ";", ",", "-", " ", "\n", "\t", "\u2028"])
specs = st.one_of(st.lists(st.one_of(spec_words, text(4)), max_size=10).map("".join), text(30))


@settings(max_examples=300, deadline=timedelta(seconds=5))
@given(specs, st.integers(1, 12), st.sampled_from(backbone_names()), st.booleans())
@example("+σ L1-99999999999", 4, "transformer", False)  # once a MemoryError, or a hang for L1-99999999
@example("+σ L" + "1" * 5000, 4, "transformer", False)
def test_any_gate_spec_on_any_model_resolves_or_fails_with_one_line(spec: str, n_layers: int, backbone: str,
                                                                   cross: bool) -> None:
    try:
        placement = resolve_placement(spec, n_layers, cross_attention=cross)
    except GatedformerError as err:
        one_line(err)
    else:
        assert all(0 <= layer < n_layers for layer, _ in placement.sites)


@settings(max_examples=60, deadline=timedelta(seconds=10), suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=400), text(400).map(lambda t: t.encode("utf-8"))))
def test_text_corpus_of_random_bytes_loads_or_fails_with_one_line(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"corpus-{next(counter)}.txt"
        path.write_bytes(data)
        try:
            corpus = load_corpus(f"text:{path}", data_dir=folder)
            characters = len(data.decode("utf-8"))
            assert len(corpus.train) + len(corpus.valid) + len(corpus.test) == characters
            LMStream(corpus.train, 2, 4, split="train")
        except GatedformerError as err:
            one_line(err)


@FAST
@given(st.one_of(text(30), text(30).map("text:".__add__), st.sampled_from(
    ["", "ptb", "ptb-char", "enwik8", "text:", "text: ", "text:~no_such_user_here/x.txt", "text:" + "a" * 300,
     "text:/", "text:.", "text:a\x00b", "text:\n", "x" * 300])))
def test_corpus_names_load_or_fail_with_one_line(name: str) -> None:
    with tempfile.TemporaryDirectory() as empty:  # no corpus files there: registered names are missing
        try:
            load_corpus(name, data_dir=empty)
        except GatedformerError as err:
            one_line(err)
