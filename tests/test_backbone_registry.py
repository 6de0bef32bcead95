"""Every backbone builds from a config by name, and its config errors are one ConfigError line."""

from __future__ import annotations

import pytest
import torch

from gatedformer import Seq2SeqTransformer, TransformerLM
from gatedformer.config import (
    Backbone,
    RunConfig,
    apply_overrides,
    backbone_names,
    get_backbone,
    register_backbone,
    validate,
)
from gatedformer.errors import ConfigError
from gatedformer.models import build_model


def _config(backbone: str, *overrides: str) -> RunConfig:
    """A config of ``backbone`` with those of ``overrides`` that it reads (it refuses any other)."""
    reads = get_backbone(backbone).fields
    kept = [o for o in overrides if o.partition("=")[0].removeprefix("model.") in reads]
    return apply_overrides(RunConfig(), [f"model.backbone={backbone}", *kept])


def test_each_model_module_registers_its_backbones() -> None:
    assert set(backbone_names("lm")) == {"transformer", "rtransformer", "transformer-xl", "gcnn", "sru",
                                         "sru-transformer"}
    assert backbone_names("translation") == ("transformer", "sru-transformer", "convs2s")
    with pytest.raises(ConfigError, match=r"model.backbone='lstm' is not one of .*transformer-xl.* \(the lm models\)"):
        validate(apply_overrides(RunConfig(), ["model.backbone=lstm"]))


def test_a_backbone_is_registered_once_per_task() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        register_backbone("transformer", task="lm", fields=("d_model",), description="another")(
            lambda cfg, vocab_size: None)
    with pytest.raises(ValueError, match="must declare the ModelConfig fields it reads"):
        register_backbone("mine", task="lm", fields=("width",), description="mine")(lambda cfg, vocab_size: None)
    assert "mine" not in backbone_names("lm")


def test_each_backbone_is_the_build_function_its_decorator_stands_beside() -> None:
    from gatedformer.models import bert, seq2seq, transformer

    assert get_backbone("transformer").build is transformer._build
    assert get_backbone("sru-transformer", "translation").build is seq2seq._build_sru
    assert get_backbone("bert", "glue").build is bert.build_classifier
    assert isinstance(get_backbone("bert", "mlm"), Backbone)
    assert get_backbone("bert", "mlm").fields == bert._FIELDS and get_backbone("bert", "mlm").check is bert._check
    assert get_backbone("sru-transformer", "translation").cross_attention
    # A module's own names are its functions: the decorator hands back what it was given.
    assert all(b.build.__name__ != "<lambda>" for b in map(get_backbone, backbone_names()))


@pytest.mark.parametrize("backbone", sorted(backbone_names()))
def test_each_backbone_builds_runs_and_is_causal(backbone: str) -> None:
    config = _config(backbone, "model.d_model=16", "model.n_heads=2", "model.d_ffn=32", "model.n_layers=2",
                     "model.dropout=0", "model.rnn_window=3", "model.mem_len=4")
    torch.manual_seed(0)
    model = build_model(validate(config).model, 11).eval()
    tokens = torch.randint(0, 11, (2, 9))
    changed = tokens.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 11
    logits = model(tokens).logits
    assert logits.shape == (2, 9, 11)
    assert torch.allclose(logits[:, :5], model(changed).logits[:, :5], atol=1e-5)


def test_sru_transformer_puts_an_sru_in_place_of_every_feed_forward_hidden_layer() -> None:
    from gatedformer.config import ModelConfig
    from gatedformer.nn.sru import SRUFeedForward

    plain = build_model(ModelConfig(d_model=16, n_layers=3, n_heads=2, d_ffn=32), 11)
    with_sru = build_model(ModelConfig(backbone="sru-transformer", d_model=16, n_layers=3, n_heads=2, d_ffn=32), 11)
    for layer in with_sru.layers:
        body = layer.ffn.body
        assert isinstance(body, SRUFeedForward) and not hasattr(layer, "recurrent")
        # W2 · SRU(x) + b2: an SRU of d_ffn units without highway term (3 streams), then the output projection
        assert (body.sru.input_size, body.sru.hidden_size, body.sru.num_streams, body.sru.alpha) == (16, 32, 3, 0.0)
        assert tuple(body.outer.weight.shape) == (16, 32)
    count = lambda model: sum(p.numel() for p in model.parameters())  # noqa: E731
    # per layer: the SRU's 3·d·f weights and four f-vectors replace W1 (d·f) and b1 (f)
    assert count(with_sru) - count(plain) == 3 * (3 * 16 * 32 + 4 * 32 - (16 * 32 + 32))
    with pytest.raises(ConfigError, match="model.ffn='glu' does not apply"):
        validate(apply_overrides(RunConfig(), ["model.backbone=sru-transformer", "model.ffn=glu"]))


def test_module_argument_errors_become_config_errors() -> None:
    config = apply_overrides(RunConfig(), ["model.backbone=sru", "model.d_model=16", "model.projection_size=100"])
    with pytest.raises(ConfigError, match="model config rejected by backbone sru"):
        build_model(validate(config).model, 11)


@pytest.mark.parametrize("backbone", sorted(backbone_names()))
def test_an_empty_vocabulary_is_refused_before_any_layer_is_built(backbone: str) -> None:
    # torch builds an nn.Embedding of 0 rows with only a warning; the model then fails at its first forward.
    config = _config(backbone, "model.d_model=16", "model.n_heads=2", "model.d_ffn=32", "model.n_layers=2")
    with pytest.raises(ConfigError, match="vocab_size must be an integer >= 1, got 0"):
        build_model(validate(config).model, 0)


@pytest.mark.parametrize(("sizes", "named"), [
    ({"d_model": 0}, "d_model must be an integer >= 1, got 0"),
    ({"n_layers": -1}, "n_layers must be an integer >= 1, got -1"),
    ({"n_heads": 0}, "n_heads must be an integer >= 1, got 0"),
    ({"d_ffn": 2.5}, "d_ffn must be an integer >= 1, got 2.5"),
])
def test_transformer_style_sizes_are_checked_by_name(sizes: dict, named: str) -> None:
    from gatedformer.models.rtransformer import RTransformerLM
    from gatedformer.models.transformer_xl import TransformerXLLM

    for model_class in (TransformerLM, TransformerXLLM, RTransformerLM):
        with pytest.raises(ValueError, match=named):
            model_class(**{"vocab_size": 11, "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ffn": 32, **sizes})


def test_top_level_exports() -> None:
    model = Seq2SeqTransformer(13, 17, layers=1, d_model=16, ffn=32, heads=2, max_len=16, eau=True, grc=True)
    logits = model(torch.randint(4, 13, (2, 5)), torch.randint(4, 17, (2, 6))).logits
    assert logits.shape == (2, 6, 17)
