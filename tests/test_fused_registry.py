"""The reference-first layout: models compute their equations in plain PyTorch, and the fused paths are bound onto
them from one place (gatedformer.fused.registry), changing no number beyond float rounding."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from gatedformer import TransformerLM
from gatedformer.fused import fuse, implementations, implements, is_fused, reference, unfuse
from gatedformer.fused.registry import ENV_VAR
from gatedformer.nn.sublayer import FeedForward, Sublayer

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "gatedformer"
REFERENCE_FILES = [PACKAGE / "nn" / "sublayer.py", PACKAGE / "nn" / "attention.py",
                   *sorted((PACKAGE / "models").glob("*.py"))]


def _lm() -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(17, d_model=16, n_layers=2, n_heads=2, d_ffn=32, dropout=0.0, gates="+σ SDU")


@pytest.mark.parametrize("path", REFERENCE_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_reference_modules_name_no_fused_path_or_kernel(path: Path) -> None:
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    speed = sorted(m for m in imported if m.split(".")[:2] in (["gatedformer", "ops"], ["gatedformer", "kernels"],
                                                               ["gatedformer", "fused"]))
    assert not speed, f"{path.name} imports {speed}: fused execution belongs in gatedformer.fused"


def test_fuse_binds_the_implementations_and_unfuse_puts_the_reference_back() -> None:
    model = _lm()
    sublayer = model.layers[0].ffn
    assert not is_fused(sublayer) and "forward" not in vars(sublayer)
    assert fuse(model) is model
    assert is_fused(sublayer) and vars(sublayer)["forward"].__func__.__module__ == "gatedformer.fused.sublayer"
    assert hasattr(sublayer.body, "add_norm")  # a method only the fused body offers
    assert reference(sublayer).__func__ is Sublayer.forward
    fuse(model)  # twice is once
    assert unfuse(model) is model
    assert not is_fused(sublayer) and "forward" not in vars(sublayer) and not hasattr(sublayer.body, "add_norm")


def test_a_fused_model_computes_what_its_reference_computes() -> None:
    reference_model = _lm()
    fused_model = fuse(copy.deepcopy(reference_model))
    tokens = torch.randint(0, 17, (3, 12))
    for model in (reference_model, fused_model):
        model(tokens, targets=tokens).loss.backward()
    torch.testing.assert_close(fused_model(tokens).logits, reference_model(tokens).logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(fused_model.parameters(), reference_model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_a_copy_of_a_fused_model_is_fused_on_its_own_modules() -> None:
    model = fuse(_lm())
    twin = copy.deepcopy(model)
    bound = vars(twin.layers[1].attn)["forward"]
    assert is_fused(twin.layers[1].attn) and bound.__self__ is twin.layers[1].attn
    tokens = torch.randint(0, 17, (2, 7))
    torch.testing.assert_close(twin(tokens).logits, model(tokens).logits)


def test_the_environment_keeps_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "0")
    model = fuse(_lm())
    assert not any(is_fused(module) for module in model.modules())


def test_an_implementation_registered_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="FeedForward.features already has a fused implementation"):
        implements(FeedForward, "features")(lambda self, x: x)


def test_a_subclass_takes_its_parents_implementation_unless_it_registers_its_own() -> None:
    class Wider(FeedForward):
        pass

    module = fuse(Wider(8, 16))
    assert vars(module)["features"].__func__ is vars(fuse(FeedForward(8, 16)))["features"].__func__
    assert all(isinstance(i.cls, type) and issubclass(i.cls, nn.Module) for i in implementations())
