"""Recipes, overrides and validation: every bad value is one ConfigError naming the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SHARED_DATA, needs_shared
from hypothesis import given, settings
from hypothesis import strategies as st

from gatedformer.config import (
    TASK_SECTIONS,
    MaskedLMConfig,
    ModelConfig,
    RunConfig,
    apply_overrides,
    backbone_names,
    build_config,
    config_from_dict,
    get_backbone,
    load_recipe,
    validate,
)
from gatedformer.errors import ConfigError
from gatedformer.runs import load_trained
from gatedformer.tasks import TASKS


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
    with pytest.raises(ConfigError, match=fragment) as refused:
        validate(config)
    assert "\n" not in str(refused.value)


# One corpus of each task, as a config names it.
TASK_CONFIG = {"lm": [], "translation": ["data.corpus=multi30k"], "mlm": ["data.corpus=wikitext2", "data.task=mlm"],
               "glue": ["data.corpus=glue-rte"], "sentclass": ["data.corpus=mr"]}


def test_a_model_field_the_backbone_never_reads_is_refused_naming_the_fields_it_reads() -> None:
    recipe = load_recipe("ptb-char-tiny")
    with pytest.raises(ConfigError) as refused:
        build_config(recipe, ["model.mem_len=512"])
    message = str(refused.value)
    assert "\n" not in message and message.startswith("model.mem_len=512 does nothing: model.backbone=transformer")
    assert all(f"model.{key}" in message for key in get_backbone("transformer").fields)
    assert "transformer-xl" in message  # the backbone that reads it
    assert build_config(recipe, ["model.backbone=transformer-xl", "model.mem_len=512"]).model.mem_len == 512
    with pytest.raises(ConfigError, match="model.conv_layers='512x3' does nothing: model.backbone=transformer"):
        build_config(recipe, ["model.conv_layers=512x3"])
    # a head count on a convolutional LM, an attention dropout on ConvS2S: nothing reads them there
    with pytest.raises(ConfigError, match="model.n_heads=8 does nothing: model.backbone=gcnn reads only "
                                          "model.backbone, model.d_model"):
        validate(apply_overrides(RunConfig(), ["model.backbone=gcnn", "model.n_heads=8"]))
    with pytest.raises(ConfigError, match="model.attn_dropout=0.1 does nothing: model.backbone=convs2s"):
        validate(apply_overrides(RunConfig(), [*TASK_CONFIG["translation"], "model.backbone=convs2s",
                                               "model.attn_dropout=0.1"]))
    # set to its default it changes nothing, so it is no lie
    assert validate(apply_overrides(RunConfig(), ["model.mem_len=0"])).model.mem_len == 0


@pytest.mark.parametrize(("override", "named"), [("model.mem_len=512", "model.backbone=transformer reads only"),
                                                ("translation.beam_size=5", "this lm run")])
def test_train_refuses_a_field_nothing_reads_in_one_line_before_any_work(override: str, named: str, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    from gatedformer.cli import main

    out = tmp_path / "x"
    assert main(["train", "--recipe", "ptb-char-tiny", "--set", override, "--out", str(out)]) != 0
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and f"{override} does nothing" in error and named in error
    assert not out.exists()


def test_a_task_section_the_task_never_reads_is_refused_naming_the_sections_it_reads() -> None:
    with pytest.raises(ConfigError) as refused:
        build_config(load_recipe("ptb-char-tiny"), ["translation.beam_size=5"])
    assert str(refused.value) == (
        "translation.beam_size=5 does nothing: this lm run (data.corpus=ptb-char) reads only [data], [model], "
        "[optim], [init], [train], and [translation] is read by translation runs; drop translation.beam_size")
    with pytest.raises(ConfigError, match=r"mlm.mask_prob=0.3 does nothing: this translation run .* \[translation\]"):
        validate(apply_overrides(RunConfig(), [*TASK_CONFIG["translation"], "mlm.mask_prob=0.3"]))
    with pytest.raises(ConfigError, match="sentclass.folds=5 does nothing: this mlm run"):
        validate(apply_overrides(RunConfig(), [*TASK_CONFIG["mlm"], "model.backbone=bert", "sentclass.folds=5"]))
    # a pretraining run keeps its fine-tuning's settings
    assert validate(apply_overrides(RunConfig(), [*TASK_CONFIG["mlm"], "model.backbone=bert", "finetune.lr=1e-4"]))
    assert set(TASK_SECTIONS) == set(TASKS)


@pytest.mark.parametrize(("task", "backbone"), [(task, name) for task in TASK_CONFIG for name in backbone_names(task)])
def test_a_field_every_backbone_reads_is_taken(task: str, backbone: str) -> None:
    config = validate(apply_overrides(RunConfig(), [*TASK_CONFIG[task], f"model.backbone={backbone}",
                                                    "model.dropout=0.3", "model.d_model=64", "model.n_layers=2"]))
    assert (config.model.dropout, config.model.d_model, config.model.n_layers) == (0.3, 64, 2)


class _Reads:
    """A model config that notes which of its fields are read."""

    def __init__(self, config: ModelConfig) -> None:
        self.config, self.read = config, set()

    def __getattr__(self, name: str) -> object:
        self.read.add(name)
        return getattr(self.config, name)


BUILD_SIZES = {"lm": {"vocab_size": 11}, "mlm": {"vocab_size": 11}, "glue": {"vocab_size": 11, "num_labels": 2},
               "sentclass": {"vocab_size": 11, "num_labels": 2},
               "translation": {"src_vocab": 11, "tgt_vocab": 13, "max_len": 16, "pad_id": 0}}


@pytest.mark.parametrize(("task", "backbone"), [(task, name) for task in TASK_CONFIG for name in backbone_names(task)])
def test_each_backbone_declares_the_fields_its_build_reads(task: str, backbone: str) -> None:
    import gatedformer.models  # noqa: F401 (fills the table)

    declared = get_backbone(backbone, task)
    sizes = ModelConfig(backbone=backbone, d_model=16, n_heads=2, d_ffn=32, n_layers=2)
    built, checked = _Reads(sizes), _Reads(sizes)
    declared.build(built, **BUILD_SIZES[task])
    if declared.check is not None:
        declared.check(checked)  # may read a field only to refuse it (an SRU-FFN's model.ffn)
    assert built.read - {"backbone"} <= set(declared.fields)
    # init_from_hf is read by the BERT tasks, which load the checkpoint into the model they built
    assert set(declared.fields) - built.read - checked.read <= {"init_from_hf"}


@needs_shared("glue/RTE/train.tsv", "glue/RTE/dev.tsv")
def test_fine_tuning_drops_the_pretraining_runs_masking_and_refuses_a_masking_override(tmp_path: Path) -> None:
    from gatedformer.tasks.glue import finetune_config

    # bert-mlm-paper pretrains on its own 85/15 split (mlm.valid_fraction), which a GLUE run never reads
    pretraining = build_config(load_recipe("bert-mlm-paper"))
    assert pretraining.mlm.valid_fraction > 0
    (tmp_path / "config.json").write_text(json.dumps(pretraining.to_dict()))
    (tmp_path / "model.safetensors").write_bytes(b"")  # finetune_config only asks that the run has finished
    config = finetune_config(tmp_path, "rte", [], SHARED_DATA)
    assert config.data.corpus == "glue-rte" and config.mlm == MaskedLMConfig()
    with pytest.raises(ConfigError, match=r"mlm.mask_prob=0.2 does nothing: this glue run .* \[finetune\]"):
        finetune_config(tmp_path, "rte", ["mlm.mask_prob=0.2"], SHARED_DATA)


def test_a_bad_value_in_a_runs_config_json_names_the_file_and_the_field(tmp_path: Path) -> None:
    config_file = tmp_path / "config.json"
    for edit, field in ((["model.dropout=2.0"], "model.dropout"), (["model.mem_len=64"], "model.mem_len")):
        saved = apply_overrides(RunConfig(), edit).to_dict()  # as if edited by hand after the run was written
        config_file.write_text(json.dumps(saved))
        with pytest.raises(ConfigError) as refused:
            load_trained(tmp_path)
        message = str(refused.value)
        assert message.startswith(f"{config_file}: {field}") and "\n" not in message
        assert "correct it in that file" in message


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
