"""Gate units applied with their element-wise tail in one compiled pass each way (CPU).

:class:`~gatedformer.nn.sublayer.Sublayer` calls its gates through the role functions (``apply_output``,
``apply_branch``, ``apply_blend``, ``apply_stream``, ``apply_residual``, ``residual_dropout_norm``), which call the
gate as its role says (see :mod:`gatedformer.gates.kinds`). Each fused function computes exactly what the gate
module's ``forward`` computes: the module's own linear layers are called as usual, and only the element-wise end
(:mod:`gatedformer.kernels.gate`) is one kernel instead of several PyTorch operations. A role function fuses only
the kinds it lists in :data:`FUSED_KINDS`; any other kind, and any case where the kernel does not apply (not float32
on the CPU, autocast, no compiler) or the gate module has hooks (the gate statistics record activations through
forward hooks), calls the module itself. Under ``torch.compile`` the tails are custom operators
(:mod:`gatedformer.ops.operators`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from gatedformer.gates import EAU, GLU, SDU, GatedResidual, HighwayGate
from gatedformer.gates._transform_gate import TransformGate
from gatedformer.gates.kinds import GateKind
from gatedformer.kernels.gate import KERNEL, tail_backward, tail_forward
from gatedformer.ops.dropout import dropout
from gatedformer.ops.explain import declined, explaining, first_reason
from gatedformer.ops.fused_linear import dropout_add_layer_norm, unhooked
from gatedformer.ops.operators import FunctionOperator, call, runs_native

__all__ = ["FUSED_KINDS", "apply_blend", "apply_branch", "apply_eau", "apply_grc", "apply_highway", "apply_output",
           "apply_residual", "apply_sdu", "apply_stream", "gated_mhdpa_blend", "glu_residual", "grc_dropout_norm",
           "residual_dropout_norm", "tail_applies"]


def tail_applies(gate: nn.Module, *tensors: Tensor) -> bool:
    """Whether the fused tail replaces ``gate``'s own forward for these inputs."""
    applies = (unhooked(gate) and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
               and not torch.is_autocast_enabled("cpu") and runs_native(KERNEL, tensors[0].device))
    if not applies and explaining():
        declined(f"ops.fused_gates ({type(gate).__name__})", first_reason(tensors, (gate,), (KERNEL,)) or "")
    return applies


def _flat(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


class _SplitTail(torch.autograd.Function):
    """``c + F(a) ⊙ (G(b) [- c])`` with ``a``, ``b`` the two halves of one projection ``(rows, 2d)``: ``a`` the
    first half, or the second with ``gate_last`` (a GLU's layout: values first, gates second)."""

    @staticmethod
    def forward(ctx, c: Tensor, projection: Tensor, tail: str, gate_last: bool = False) -> Tensor:  # type: ignore[override]
        d = c.shape[1]
        ctx.tail, ctx.gate_last = tail, gate_last
        ctx.save_for_backward(c if tail == "lerp" else None, projection)
        return tail_forward(tail, c, *_halves(projection, d, gate_last))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        c, projection = ctx.saved_tensors
        d = grad.shape[1]
        grad = grad.contiguous()
        grad_projection = torch.empty_like(projection)  # both halves' gradients side by side: no joining copy
        grad_c = tail_backward(ctx.tail, grad, c, *_halves(projection, d, ctx.gate_last),
                               *_halves(grad_projection, d, ctx.gate_last))
        return (grad if grad_c is None else grad_c), grad_projection, None, None


def _halves(projection: Tensor, d: int, gate_last: bool) -> tuple[Tensor, int, Tensor, int]:
    """The tail's ``a`` and ``b`` in a ``(rows, 2d)`` projection, each with its row length."""
    first, second = projection, projection[:, d:]
    return (second, 2 * d, first, 2 * d) if gate_last else (first, 2 * d, second, 2 * d)


class _Tail(torch.autograd.Function):
    """``c + F(a) ⊙ G(b)`` with ``a``, ``b`` tensors of ``c``'s shape (``c`` is ``None`` for the ``gate`` tail)."""

    @staticmethod
    def forward(ctx, c: Tensor | None, a: Tensor, b: Tensor, tail: str) -> Tensor:  # type: ignore[override]
        ctx.tail = tail
        ctx.save_for_backward(a, b)
        return tail_forward(tail, c, a, a.shape[1], b, b.shape[1], shape=a.shape)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a, grad_b = torch.empty_like(a), torch.empty_like(b)
        tail_backward(ctx.tail, grad, None, a, a.shape[1], b, b.shape[1], grad_a, a.shape[1], grad_b, b.shape[1])
        return (grad if ctx.needs_input_grad[0] else None), grad_a, grad_b, None


def _like_c(c: Tensor, *_: object) -> list[Tensor]:
    return [c.new_empty(c.shape)]


def _like_a(c: Tensor | None, a: Tensor, *_: object) -> list[Tensor]:
    return [a.new_empty(a.shape)]


SPLIT_TAIL = FunctionOperator("gate_split_tail", _SplitTail, "Tensor c, Tensor projection, str tail, bool gate_last",
                              _like_c)
TAIL = FunctionOperator("gate_tail", _Tail, "Tensor? c, Tensor a, Tensor b, str tail", _like_a)
"""The tails as custom operators, for ``torch.compile`` (:mod:`gatedformer.ops.operators`)."""


def _split_tail(c: Tensor, projection: Tensor, tail: str) -> Tensor:
    return call(SPLIT_TAIL, _flat(c), _flat(projection), tail, False).view(c.shape)


def glu_residual(glu: GLU, x: Tensor, y: Tensor) -> Tensor:
    """``x + glu(y)``: ``x + y_a ⊙ σ(y_b)`` with ``y_a``, ``y_b`` the first and second halves of ``y``'s last
    dimension (a GCNN block around one gated convolution)."""
    if not tail_applies(glu, x, y) or glu.dim not in (-1, y.dim() - 1) or y.shape[:-1] != x.shape[:-1] \
            or y.shape[-1] != 2 * x.shape[-1]:
        return x + glu(y)
    return call(SPLIT_TAIL, _flat(x), _flat(y), "sdu-sigmoid", True).view(x.shape)


def apply_sdu(sdu: SDU, x: Tensor, add_to: Tensor) -> Tensor:
    """``sdu(x, add_to=add_to)``: ``add_to + Ψ(x W1 + b1) ⊙ (x W2 + b2)``."""
    if not tail_applies(sdu, x, add_to) or add_to.shape != x.shape:
        return sdu(x, add_to=add_to)
    return _split_tail(add_to, sdu.proj(x), f"sdu-{sdu.gate}")


def gated_mhdpa_blend(gate: TransformGate, carry: Tensor, x: Tensor) -> Tensor:
    """``(1 - T(x)) ⊙ carry + T(x) ⊙ f(x)``: ``gate(x, carry)`` of a gated MHDPA, ``gate(x)`` of a highway gate
    (``carry = x``)."""
    if not tail_applies(gate, x, carry) or carry.shape != x.shape:
        return gate(x) if isinstance(gate, HighwayGate) else gate(x, carry)
    return _split_tail(carry, gate.proj(x), "lerp")


def apply_highway(gate: HighwayGate, x: Tensor) -> Tensor:
    """``gate(x)``: ``(1 - T(x)) ⊙ x + T(x) ⊙ f(x)``."""
    return gated_mhdpa_blend(gate, x, x)


def apply_grc(gate: GatedResidual, r: Tensor, s: Tensor) -> Tensor:
    """``gate(r, s)``: ``r + σ(Wg r + bg) ⊙ s``."""
    if not tail_applies(gate, r, s) or r.shape != s.shape:
        return gate(r, s)
    return call(TAIL, _flat(r), _flat(gate.gate_proj(r)), _flat(s), "sdu-sigmoid").view(r.shape)


def apply_eau(eau: EAU, x: Tensor) -> Tensor:
    """``eau(x)``: ``x + tanh(W3 x + b3) ⊙ σ(W2 ReLU(W1 x + b1) + b2)``."""
    if not tail_applies(eau, x):
        return eau(x)
    evaluated = eau.evaluator_out(F.relu(eau.evaluator_in(x)))
    return call(TAIL, _flat(x), _flat(evaluated), _flat(eau.adjuster(x)), "eau").view(x.shape)


def grc_dropout_norm(gate: GatedResidual, r: Tensor, s: Tensor, p: float, norm: nn.LayerNorm,
                     training: bool = True) -> Tensor:
    """``norm(gate(r, dropout(s, p)))``, a post-LN sublayer's gated residual connection. Fused, the gate's
    product ``σ(Wg r + bg) ⊙ s`` is one kernel and the dropout, residual add and norm another
    (``r + dropout(g ⊙ s)`` is ``r + g ⊙ dropout(s)``: the mask is element-wise)."""
    if not tail_applies(gate, r, s) or r.shape != s.shape:
        return norm(apply_grc(gate, r, dropout(s, p, training)))
    gated = call(TAIL, None, _flat(gate.gate_proj(r)), _flat(s), "gate").view(s.shape)
    return dropout_add_layer_norm(r, gated, p, norm, training)


# The role functions: the kinds each computes with a fused tail, and the call it makes of any other kind's unit.

FUSED_KINDS = {"output": ("eau",), "branch": ("sdu",), "blend": ("gated_mhdpa",), "stream": ("highway",),
               "residual": ("grc",)}
"""The gate kinds whose element-wise end each role function fuses; others run their module's ``forward``."""


def _unlisted(kind: GateKind, role: str) -> bool:
    """Whether no fused tail computes ``kind`` in ``role`` (and so its module's forward runs)."""
    if kind.name in FUSED_KINDS[role]:
        return False
    if explaining():
        declined(f"ops.fused_gates.apply_{role}", f"no fused tail is listed for {kind.name} (FUSED_KINDS)")
    return True


def apply_output(kind: GateKind, unit: nn.Module, s: Tensor) -> Tensor:
    """An output gate on the body's output: ``unit(s)``."""
    return unit(s) if _unlisted(kind, "output") else apply_eau(unit, s)


def apply_branch(kind: GateKind, unit: nn.Module, h: Tensor, s: Tensor) -> Tensor:
    """A branch beside the body: ``s + unit(h)``."""
    return s + unit(h) if _unlisted(kind, "branch") else apply_sdu(unit, h, add_to=s)


def apply_blend(kind: GateKind, unit: nn.Module, h: Tensor, s: Tensor) -> Tensor:
    """A gate blending the body's output with a transform of its input: ``unit(h, s)``."""
    return unit(h, s) if _unlisted(kind, "blend") else gated_mhdpa_blend(unit, s, h)


def apply_stream(kind: GateKind, unit: nn.Module, x: Tensor) -> Tensor:
    """A gate on the residual stream: ``unit(x)``."""
    return unit(x) if _unlisted(kind, "stream") else apply_highway(unit, x)


def apply_residual(kind: GateKind, unit: nn.Module, r: Tensor, s: Tensor) -> Tensor:
    """A gated residual connection: ``unit(r, s)`` in place of ``r + s``."""
    return unit(r, s) if _unlisted(kind, "residual") else apply_grc(unit, r, s)


def residual_dropout_norm(kind: GateKind, unit: nn.Module, r: Tensor, s: Tensor, p: float, norm: nn.LayerNorm,
                          training: bool = True) -> Tensor:
    """``norm(unit(r, dropout(s, p)))``, a post-LN sublayer's gated residual connection."""
    if _unlisted(kind, "residual"):
        return norm(unit(r, dropout(s, p, training)))
    return grc_dropout_norm(unit, r, s, p, norm, training)
