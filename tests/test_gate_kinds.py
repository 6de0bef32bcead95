"""The one table of gate kinds: what it says of each kind holds of the unit it names, and every kind trains the same
on every fused path as its module's own forward computes it.

The cases are drawn from the table, so a kind added to it is tested here on every backbone's path without editing
this file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from gatedformer import Seq2SeqTransformer, TransformerLM, TransformerXLLM
from gatedformer.errors import ConfigError
from gatedformer.fused import fuse
from gatedformer.gates import SDU
from gatedformer.gates.kinds import GATE_FNS, GATE_KINDS, GateKind, kind_in_name, kind_of
from gatedformer.gates.spec import SublayerGates, parse_gate_spec, resolve_placement
from gatedformer.models.rtransformer import RTransformerLM
from gatedformer.nn.attention import CausalSelfAttention
from gatedformer.nn.sublayer import FeedForward, Sublayer
from gatedformer.ops import fused_linear
from gatedformer.ops.layer_stack import STREAMED_KINDS

# Every kind as a spec names it, once per gate function where it takes one.
KIND_SPECS = [(kind.name, f"+{fn} {kind.words[0]}" if kind.takes_fn else f"+{kind.words[0]}")
              for kind in GATE_KINDS.values() for fn in (GATE_FNS if kind.takes_fn else ("",))]


@pytest.mark.parametrize("kind", GATE_KINDS.values(), ids=list(GATE_KINDS))
def test_the_table_states_each_units_parameters_flops_and_paper(kind: GateKind) -> None:
    d, f, heads = 12, 30, 3
    # The body of the sublayer it goes on: a kind sized by its body reads its heads or its width.
    body = CausalSelfAttention(d, heads) if "attn" in kind.sublayers else FeedForward(d, f)
    unit = kind.build(d, body=body)
    assert kind_of(unit) is kind
    assert sum(p.numel() for p in unit.parameters()) == kind.parameters(d, f, heads)
    inputs = {"body": 1, "heads": 2, "output": 1, "branch": 1, "stream": 1, "blend": 2, "residual": 2}[kind.role]
    x = torch.randn(1, d)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        unit(*[x] * inputs)
    assert counter.get_total_flops() == kind.matmul_flops(d, f, heads)  # per token: one row
    paper_author = kind.paper.split()[0].rstrip(",")
    assert paper_author in (kind.unit.__doc__ or ""), f"{kind.unit.__name__}'s docstring names no paper"


@pytest.mark.parametrize(("name", "spec"), KIND_SPECS)
def test_a_spec_places_each_kind_on_its_sublayers_and_only_there(name: str, spec: str) -> None:
    kind = GATE_KINDS[name]
    assert parse_gate_spec(spec)[0].unit == name
    placement = resolve_placement(spec, 2, cross_attention=True)
    assert {sub for _, sub in placement.sites} == set(kind.sublayers)
    for missing in {"attn", "ffn"} - set(kind.sublayers):
        with pytest.raises(ConfigError, match=f"{kind.label} goes {kind.where} only"):
            resolve_placement(f"{spec} /{missing}", 2)


def test_a_parameter_name_names_its_gate_kind_by_todays_slot_names_only() -> None:
    assert kind_in_name("layers.2.ffn.grc.gate_proj.weight") is GATE_KINDS["grc"]
    assert kind_in_name("layers.0.attn.gated_mhdpa.proj.bias") is GATE_KINDS["gated_mhdpa"]
    # The names of unreleased versions are no gate slots: such weights are refused, not renamed.
    assert kind_in_name("layers.2.ffn.residual_gate") is None
    assert kind_in_name("layers.2.ffn.inner.weight") is None


# ---------------------------------------------------------------------------------------------------------------
# Every kind on every fused path: training with the fused paths equals training with the reference.


def _lm(cls: type, **extra: object) -> Callable[[str], nn.Module]:
    return lambda gates: cls(23, d_model=32, n_layers=2, n_heads=2, d_ffn=48, dropout=0.1, gates=gates, **extra)


PATHS: dict[str, Callable[[str], nn.Module]] = {
    "transformer": _lm(TransformerLM),
    "transformer pre-LN": _lm(TransformerLM, norm="pre"),
    "sru-transformer": _lm(TransformerLM, ffn="sru"),
    "rtransformer": _lm(RTransformerLM, rnn_window=3),
    "transformer-xl": _lm(TransformerXLLM, mem_len=6),
    "translation": lambda gates: Seq2SeqTransformer(23, 19, layers=2, d_model=32, ffn=48, heads=2, max_len=16,
                                                    dropout=0.1, gates=gates, pad_id=1),
    "translation sru-transformer": lambda gates: Seq2SeqTransformer(23, 19, layers=2, d_model=32, ffn=48, heads=2,
                                                                    max_len=16, dropout=0.1, gates=gates, pad_id=1,
                                                                    ffn_kind="sru"),
}


def _train_two_steps(build: Callable[[str], nn.Module], gates: str, fused: bool) -> list[Tensor]:
    """Two windows' losses and every parameter's gradient, with the fused paths bound onto the model or by the
    model's reference (its modules' own forward)."""
    torch.manual_seed(0)
    model = build(gates).train()
    if fused:
        fuse(model)
    data = torch.randint(2, 19, (3, 2, 10), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # the dropout masks
    losses, state = [], None
    for window in data.unbind(1):
        if isinstance(model, Seq2SeqTransformer):
            losses.append(model(window, window[:, :-1], targets=window[:, 1:], ignore_index=1).loss)
        else:
            out = model(window[:, :-1], state, targets=window[:, 1:])
            losses.append(out.loss)
            state = out.state
    return [*losses, *torch.autograd.grad(sum(losses), list(model.parameters()), allow_unused=True)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("name", "spec"), KIND_SPECS)
def test_every_kind_trains_on_every_path_as_its_module_computes_it(path: str, name: str, spec: str) -> None:
    if GATE_KINDS[name].role == "body" and "sru" in path:
        # A GLU-variant feed-forward stands in for a ReLU or GELU one: with the SRU's it is refused, not merged.
        with pytest.raises(ConfigError, match="in place of a ReLU or GELU one, not of an SRU one"):
            PATHS[path](spec)
        return
    fused = _train_two_steps(PATHS[path], spec, fused=True)
    written = _train_two_steps(PATHS[path], spec, fused=False)
    for a, b in zip(fused, written, strict=True):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


# ---------------------------------------------------------------------------------------------------------------
# A new kind added to the table: the fused paths that do not list it decline, so it is computed as written.


class _DoubledSDU(SDU):
    """A branch unit whose forward is twice an SDU's: were a fused path to take it for an SDU, it would compute half
    of it."""

    def forward(self, x: Tensor, add_to: Tensor | None = None) -> Tensor:
        out = 2 * super().forward(x)
        return out if add_to is None else add_to + out


def test_a_kind_no_fused_path_lists_is_computed_as_its_module_says(monkeypatch: pytest.MonkeyPatch) -> None:
    new = replace(GATE_KINDS["sdu"], name="doubled_sdu", label="doubled SDU", unit=_DoubledSDU, words=("dsdu",))
    monkeypatch.setitem(GATE_KINDS, new.name, new)
    assert not fused_linear.whole_sublayer_takes(("doubled_sdu",))
    assert "doubled_sdu" not in STREAMED_KINDS["attn"]
    torch.manual_seed(0)
    sub = fuse(Sublayer(FeedForward(8, 16), 8, SublayerGates({"doubled_sdu": "sigmoid"}), dropout=0.0).train())
    assert not sub.fuse_sublayer and not sub.fuse_linear and isinstance(sub.doubled_sdu, _DoubledSDU)
    x = torch.randn(2, 5, 8)
    expected = sub.norm(x + sub.body(x) + 2 * SDU.forward(sub.doubled_sdu, x))
    torch.testing.assert_close(sub(x), expected)
