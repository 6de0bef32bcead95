"""Transformer-XL's layers, all of them, as one autograd function.

Each post-LN sublayer already runs as one autograd function, gates included
(:class:`~gatedformer.ops.relative_sublayer.RelativeAttentionAddNorm`, the FFN's ``_FeedForwardAddNorm``), and
their compiled calls do nearly all of the work. At the ``enwik8`` recipes' size (width 48, twelve layers) what
remains around those calls still costs about a sixth of a two-thread training step: the module calls, the checks
before each sublayer, the autograd functions' own bookkeeping and the engine's 24 nodes, all on one thread while
the other waits. :class:`LayerStack` runs the same two functions' forward and backward bodies, layer after layer,
inside a single autograd function: the arithmetic, the dropout masks (drawn in the same order) and so the results
are those of the layers one by one.

Where PyTorch links MKL and the layers' gates are ones it computes (any but an EAU on the FFN's output and a GRC
beside a gate unit, which placements do not make), :class:`StreamedLayerStack` goes further: one compiled call runs
every layer forward and one runs them all backward (``relative_stack_streamed`` in
:mod:`~gatedformer.kernels.epilogue`), each thread taking its own sequences through all the layers with no
return to Python and no wait for the other thread between sublayers. For plain layers its outputs and masks are the
Python stack's bit for bit and its gradients differ only in the order in which the threads' shares of the weights'
gradients are added; with gates they agree to float rounding. Other layers stay with :class:`LayerStack`, whose
sublayer functions compute their gates.

It applies where every layer's two sublayers would each run as one function (post-LN, the gates those take), no
hooks are on the layers or their sublayers (nor global module hooks), and the memories and position encodings
need no gradient; :func:`layer_stack` checks that and otherwise returns ``None`` (the fused model's ``run_layers``,
:mod:`gatedformer.fused.transformer_xl`, then calls its layers).
Under ``torch.compile`` each stack is a custom operator (:data:`LAYER_STACK`, :data:`STREAMED_LAYER_STACK`; see
:mod:`gatedformer.ops.operators`), which is why the functions take the layers' settings as six flat lists and the
memories as a list: a compiled graph keeps the whole stack as one node each way, with the eager masks and numbers.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from gatedformer.gates.kinds import kind_of
from gatedformer.kernels import blas as _blas
from gatedformer.kernels import epilogue as _epilogue_kernel
from gatedformer.kernels import gate as _gate_kernel
from gatedformer.kernels.build import constant_under_compile
from gatedformer.kernels.gate import TAILS
from gatedformer.kernels.relative_attention import KERNEL as RELATIVE_KERNEL
from gatedformer.kernels.relative_attention import kernel_addresses
from gatedformer.ops import dropout as dropout_ops
from gatedformer.ops.explain import declined, explaining, first_reason
from gatedformer.ops.fused_linear import (
    _branch_parameters,
    _FeedForwardAddNorm,
    branches_fuse,
    feed_forward_layers_fuse,
    registered,
    sublayer_reason,
    unhooked,
)
from gatedformer.ops.operators import TRACED_SEED, FunctionOperator, call, runs_native
from gatedformer.ops.relative_sublayer import (
    RelativeAttentionAddNorm,
    relative_inputs_fuse,
    relative_layers_fuse,
)

__all__ = ["LAYER_STACK", "STREAMED_LAYER_STACK", "LayerStack", "StreamedLayerStack", "layer_stack"]

# A layer's inputs to the function: the attention's 8 parameters (Wq, Wkv, Wr, Wo, u, v, LayerNorm's 2) and its
# gates' 10 (a residual gate's 2, a unit's 2, an EAU's 6; None where there is none), then the FFN's 6 and its 10.
_ATTENTION, _BRANCH, _FFN = 8, 10, 6
_PER_LAYER = 2 * _BRANCH + _ATTENTION + _FFN
_PLAIN = _ATTENTION + _FFN  # a layer's inputs to StreamedLayerStack; then its two units' and its two GRCs' weights and
_GATES = 14  # biases and its attention's EAU's six (Nones where there are none)
_STREAMED = _PLAIN + _GATES
STREAMED_KINDS = {"attn": ("sdu", "highway", "gated_mhdpa", "eau", "grc"),
                  "ffn": ("sdu", "highway", "gated_mhdpa", "grc")}
"""The gate kinds :class:`StreamedLayerStack` computes on each sublayer (never a unit beside a GRC or an EAU);
layers with others stay with :class:`LayerStack`."""
_PROJECTIONS = ("query", "key_value", "position", "out")
_INT32_VALUES = 2 ** 32
_LEADING = 9  # the functions' arguments before the parameters: x, pos, memories and the six settings lists


def _layer_settings(eps: list[float], heads: list[int], tails: list[str], ffn_eps: list[float],
                    ffn_tails: list[str], masks: list[tuple[int, int]]) -> list[tuple[object, ...]]:
    """Per layer ``(eps, heads, mask, tail, ffn_eps, inner_mask, outer_mask, ffn_tail)`` (tails ``None`` for no unit)
    from the lists of :func:`_flat_settings`."""
    return [(eps[i], heads[i], masks[3 * i], tails[i] or None, ffn_eps[i], masks[3 * i + 1], masks[3 * i + 2],
             ffn_tails[i] or None) for i in range(len(eps))]


def _flat_settings(settings: Sequence[tuple[object, ...]]) -> tuple[list[object], ...]:
    """The layers' settings as six lists, as a custom operator takes them: eps, heads, tails (``""`` for no unit),
    the FFN's eps and tails, and every layer's three masks in turn."""
    return ([layer[0] for layer in settings], [layer[1] for layer in settings],
            [layer[3] or "" for layer in settings], [layer[4] for layer in settings],
            [layer[7] or "" for layer in settings],
            [mask for layer in settings for mask in (layer[2], layer[5], layer[6])])


class _InnerContext:
    """What a sublayer function's forward pass keeps for its backward pass when it runs inside another function."""

    def __init__(self) -> None:
        self.needs_input_grad: tuple[bool, ...] = ()

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        self.saved_tensors = tensors


class LayerStack(torch.autograd.Function):
    """``apply(x (B, L, d), pos (M+L, d), memories, *settings, *parameters)``: the layers in turn, each
    ``FFN-sublayer(attention-sublayer(h, memory, pos))``, with the arguments :func:`layer_stack` gives (``memories``:
    a list of ``(B, M, d)`` tensors or Nones; ``settings``: the six lists of :func:`_flat_settings`, per layer the
    attention's LayerNorm eps, heads and unit's tail, the FFN's eps and unit's tail, and the three masks;
    ``parameters``: 34 per layer, see ``_PER_LAYER``). Returns the last layer's output, then the inputs of the layers
    after the first (for the memories; no gradient)."""

    @staticmethod
    def forward(ctx, x: Tensor, pos: Tensor, memories: list[Tensor | None], eps: list[float],  # type: ignore[override]
                heads: list[int], tails: list[str], ffn_eps: list[float], ffn_tails: list[str],
                masks: list[tuple[int, int]], *parameters: Tensor | None) -> tuple[Tensor, ...]:
        settings = _layer_settings(eps, heads, tails, ffn_eps, ffn_tails, masks)
        batch, length, width = x.shape
        contexts, outputs = [], []
        h = x
        for i, (eps, n_heads, (seed, keep_below), tail, ffn_eps, inner_mask, outer_mask, ffn_tail) in (
                enumerate(settings)):
            layer = parameters[i * _PER_LAYER : (i + 1) * _PER_LAYER]
            attention_parameters, ffn_parameters = layer[: _ATTENTION + _BRANCH], layer[_ATTENTION + _BRANCH :]
            attention, ffn = _InnerContext(), _InnerContext()
            memory = memories[i]
            keys = length + (0 if memory is None else memory.shape[1])
            h = RelativeAttentionAddNorm.forward(attention, h, memory, pos[pos.shape[0] - keys :],
                                                 *attention_parameters, tail, eps, n_heads, seed, keep_below)
            h = _FeedForwardAddNorm.forward(ffn, h.view(-1, width), *ffn_parameters, ffn_tail, ffn_eps, inner_mask,
                                            outer_mask).view(batch, length, width)
            contexts.append((attention, ffn))
            outputs.append(h)
        # Saved through ctx, as any function's: freed after the backward pass (unless the graph is retained) and
        # checked against changes in place.
        saved: list[Tensor | None] = []
        for inner in (inner for pair in contexts for inner in pair):
            inner.count = len(inner.saved_tensors)
            saved += inner.saved_tensors
            del inner.saved_tensors
        ctx.save_for_backward(*saved)
        ctx.contexts = contexts
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*outputs[:-1])
        return (outputs[-1], *outputs[:-1])

    @staticmethod
    def backward(ctx, grad: Tensor | None, *_: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        needed = ctx.needs_input_grad
        saved, start = ctx.saved_tensors, 0
        for inner in (inner for pair in ctx.contexts for inner in pair):
            inner.saved_tensors = saved[start : start + inner.count]
            start += inner.count
        grads: list[tuple[Tensor | None, ...]] = []
        for i in reversed(range(len(ctx.contexts))):
            attention, ffn = ctx.contexts[i]
            wanted = needed[_LEADING + i * _PER_LAYER : _LEADING + (i + 1) * _PER_LAYER]
            split = _ATTENTION + _BRANCH
            # In the functions' own input order: (h, memory, pos, the attention's 18, the unit's tail, eps, heads,
            # seed, keep) and (x, the FFN's 16, the unit's tail, eps, the two masks).
            attention.needs_input_grad = (True, False, False, *wanted[:split]) + (False,) * 5
            ffn.needs_input_grad = (True, *wanted[split:]) + (False,) * 4
            if grad is None:
                grads.append((None,) * _PER_LAYER)
                continue
            batch, length, width = grad.shape
            from_ffn = _FeedForwardAddNorm.backward(ffn, grad.reshape(-1, width))
            from_attention = RelativeAttentionAddNorm.backward(attention, from_ffn[0].view(batch, length, width))
            grad = from_attention[0]
            grads.append((*from_attention[3 : 3 + split], *from_ffn[1 : 1 + _FFN + _BRANCH]))
        for inner in (inner for pair in ctx.contexts for inner in pair):
            del inner.saved_tensors
        flat = [g for layer in reversed(grads) for g in layer]
        return (grad if needed[0] else None, *(None,) * (_LEADING - 1), *flat)


class StreamedLayerStack(torch.autograd.Function):
    """:class:`LayerStack` where MKL's packed products are there and the layers' gates are ones it computes (per
    sublayer a gate unit, an SDU branch, a highway gate or a gated MHDPA, or a GRC; and an EAU on the attention's
    output, with or without a GRC): the whole stack in one compiled call forward and
    one backward (``relative_stack_streamed`` in :mod:`~gatedformer.kernels.epilogue`), each thread taking
    its own sequences through every layer without waiting for the other threads or returning to Python between
    sublayers. The arguments and results of
    :class:`LayerStack`, but per layer the 14 plain parameters, then the attention's and the FFN's unit's weight and
    bias, their GRCs' weight and bias and the attention's EAU's six parameters (``None`` where there is none), 28 in
    all; the same masks. Plain layers give the same outputs, and the same gradients but for the order in which the
    threads' shares of the weights' gradients are added; gated ones the same to float rounding (a gate's product gets
    its bias after the product, not before)."""

    @staticmethod
    def forward(ctx, x: Tensor, pos: Tensor, memories: list[Tensor | None], eps: list[float],  # type: ignore[override]
                heads: list[int], tails: list[str], ffn_eps: list[float], ffn_tails: list[str],
                masks: list[tuple[int, int]], *parameters: Tensor | None) -> tuple[Tensor, ...]:
        settings = _layer_settings(eps, heads, tails, ffn_eps, ffn_tails, masks)
        batch, length, width = x.shape
        n = len(settings)
        layers = [parameters[i * _STREAMED : (i + 1) * _STREAMED] for i in range(n)]
        memory_rows = [None if m is None else m.reshape(-1, width).contiguous() for m in memories]
        keys = length + (0 if memories[0] is None else memories[0].shape[1])
        pos = pos[pos.shape[0] - keys :].contiguous()
        r = x.new_empty(n, keys, width)
        for i, layer in enumerate(layers):
            torch.mm(pos, layer[2].t(), out=r[i])  # as each sublayer projects its position encodings
        weights = [(layer[4].contiguous(), layer[5].contiguous(), layer[0], layer[1], layer[3], layer[6], layer[7],
                    *layer[_ATTENTION:]) for layer in layers]
        reals = [(eps, ffn_eps, _INT32_VALUES / mask[1], _INT32_VALUES / inner[1], _INT32_VALUES / outer[1],
                  _tail_code(tail), _tail_code(ffn_tail), float(layer[_PLAIN + 4] is not None),
                  float(layer[_PLAIN + 6] is not None), float(layer[_PLAIN + 8] is not None))
                 for (eps, _, mask, tail, ffn_eps, inner, outer, ffn_tail), layer in zip(settings, layers, strict=True)]
        gated = any(real[5] >= 0 or real[6] >= 0 or real[7] or real[8] or real[9] for real in reals)
        masks = [(mask, inner, outer) for _, _, mask, _, _, inner, outer, _ in settings]
        rows = x.reshape(-1, width).contiguous()
        blas = _blas.packed_gemm()
        outputs, saved = _epilogue_kernel.relative_stack_streamed(
            blas, kernel_addresses()[0], rows, memory_rows, r, weights, reals, masks, batch, settings[0][1],
            tail_addresses() if gated else (0, 0, 0))
        ctx.names = tuple(saved)
        ctx.save_for_backward(rows, pos, r, *(m for m in memory_rows if m is not None),
                              *(w for layer in weights for w in layer if w is not None), *outputs[:-1], *saved.values())
        ctx.shapes = (layers[0][4].shape, layers[0][5].shape)  # u's and the position bias's, as every layer's
        ctx.set_materialize_grads(False)
        later = [o.view(batch, length, width) for o in outputs[:-1]]
        ctx.mark_non_differentiable(*later)
        return (outputs[-1].view(batch, length, width), *later)

    @staticmethod
    def backward(ctx, grad: Tensor | None, *_: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        needed = ctx.needs_input_grad
        n = (len(needed) - _LEADING) // _STREAMED
        if grad is None:
            return (None,) * len(needed)
        tensors = ctx.saved_tensors  # checks that none was changed in place since the forward pass
        rows, pos, r = tensors[:3]
        saved = dict(zip(ctx.names, tensors[len(tensors) - len(ctx.names) :], strict=True))
        batch, length, width = grad.shape
        grad_input, weights, small, sums = _epilogue_kernel.relative_stack_streamed_backward(
            _blas.packed_gemm(), kernel_addresses()[1], grad.reshape(-1, width), saved)
        keys, hidden_width = r.shape[1], int(saved["sizes"][6])
        d2, fd, small_start = width * width, hidden_width * width, keys * width
        sdu_weights, sdu_sums = 4 * d2 + 2 * fd, 6 * width + hidden_width
        grc_weights, grc_sums = sdu_weights + 4 * d2, sdu_sums + 4 * width
        half = width // 2
        eau_weights, eau_sums = grc_weights + 2 * d2, grc_sums + 2 * width

        def per_layer(t: Tensor, start: int, stop: int, *shape: int) -> tuple[Tensor, ...]:
            return t[:, start:stop].view(n, *(shape or (stop - start,))).unbind(0)

        u_shape, pb_shape = ctx.shapes
        grad_w_r = small[:, :small_start].view(n, keys, width).transpose(1, 2).matmul(pos)  # each r = pos W_rᵀ
        columns = zip(
            per_layer(weights, d2, 2 * d2, width, width), per_layer(weights, 2 * d2, 4 * d2, 2 * width, width),
            grad_w_r.unbind(0), per_layer(weights, 0, d2, width, width),
            per_layer(small, small_start, small_start + width, *u_shape),
            per_layer(small, small_start + width, small_start + 2 * width, *pb_shape),
            per_layer(sums, 0, width), per_layer(sums, width, 2 * width),
            per_layer(weights, 4 * d2, 4 * d2 + fd, hidden_width, width),
            per_layer(sums, 6 * width, 6 * width + hidden_width),
            per_layer(weights, 4 * d2 + fd, 4 * d2 + 2 * fd, width, hidden_width),
            per_layer(sums, 5 * width, 6 * width), per_layer(sums, 3 * width, 4 * width),
            per_layer(sums, 4 * width, 5 * width), *(
                (per_layer(weights, sdu_weights, sdu_weights + 2 * d2, 2 * width, width),
                 per_layer(sums, sdu_sums, sdu_sums + 2 * width),
                 per_layer(weights, sdu_weights + 2 * d2, sdu_weights + 4 * d2, 2 * width, width),
                 per_layer(sums, sdu_sums + 2 * width, sdu_sums + 4 * width))
                if weights.shape[1] > sdu_weights else ((None,) * n,) * 4),
            *((per_layer(weights, grc_weights, grc_weights + d2, width, width),
               per_layer(sums, grc_sums, grc_sums + width),
               per_layer(weights, grc_weights + d2, grc_weights + 2 * d2, width, width),
               per_layer(sums, grc_sums + width, grc_sums + 2 * width))
              if weights.shape[1] > sdu_weights else ((None,) * n,) * 4),
            *((per_layer(weights, eau_weights, eau_weights + half * width, half, width),
               per_layer(sums, eau_sums, eau_sums + half),
               per_layer(weights, eau_weights + half * width, eau_weights + 2 * half * width, width, half),
               per_layer(sums, eau_sums + half, eau_sums + half + width),
               per_layer(weights, eau_weights + 2 * half * width, eau_weights + 2 * half * width + d2, width, width),
               per_layer(sums, eau_sums + half + width, eau_sums + half + 2 * width))
              if weights.shape[1] > sdu_weights else ((None,) * n,) * 6), strict=True)
        flat = [g if want else None for g, want in zip((g for layer in columns for g in layer), needed[_LEADING:],
                                                         strict=True)]
        return (grad_input.view(batch, length, width) if needed[0] else None, *(None,) * (_LEADING - 1), *flat)


def _like_outputs(x: Tensor, pos: Tensor, memories: list[Tensor | None], eps: list[float],
                  *_: object) -> list[Tensor]:
    return [x.new_empty(x.shape) for _ in eps]


_ARGUMENTS = ("Tensor x, Tensor pos, Tensor?[] memories, float[] eps, int[] heads, str[] tails, float[] ffn_eps, "
              "str[] ffn_tails, Mask[] masks, Tensor?... parameters")
LAYER_STACK = FunctionOperator("layer_stack", LayerStack, _ARGUMENTS, _like_outputs, tuple_output=True,
                               non_differentiable=slice(1, None))
STREAMED_LAYER_STACK = FunctionOperator("streamed_layer_stack", StreamedLayerStack, _ARGUMENTS, _like_outputs,
                                        tuple_output=True, non_differentiable=slice(1, None))
"""The two stacks as custom operators, for ``torch.compile`` (:mod:`gatedformer.ops.operators`)."""


def _tail_code(tail: str | None) -> float:
    """An SDU tail's code for the stack kernels (the gate kernel's), -1 for no SDU."""
    if tail == "blend":
        return _epilogue_kernel.MIX_CODE
    return -1.0 if tail is None else float(TAILS[tail])


def tail_addresses() -> tuple[int, int, int]:
    """The gate kernel's forward and backward tail functions and its bias-sigmoid, by address (the stack kernels call
    them)."""
    library = _gate_kernel.KERNEL.library()
    functions = (library.gate_tail_forward, library.gate_tail_backward, library.gate_bias_sigmoid)
    return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in functions)  # type: ignore[return-value]


def _streamable(sublayer: str, gates: tuple[nn.Module | None, nn.Module | None, nn.Module | None]) -> bool:
    """Whether :class:`StreamedLayerStack` computes a sublayer's gates (residual gate, unit, output gate)."""
    gate, unit, eau = gates
    kinds = [kind_of(module) for module in gates if module is not None]
    return (all(kind is not None and kind.name in STREAMED_KINDS[sublayer] for kind in kinds)
            and (gate is None or unit is None) and (eau is None or unit is None))


def _whole_sublayers(layer: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """A layer's two sublayers (:class:`~gatedformer.nn.sublayer.Sublayer`) where they are post-LN, without hooks,
    each computes itself as one function (``fuse_sublayer``), and the FFN's body is the ReLU feed-forward (its
    ``inner`` and ``outer`` layers, ``activation`` "relu"); else ``None``."""
    attn, ffn = registered(layer, "attn"), registered(layer, "ffn")
    body = registered(ffn, "body") if ffn is not None else None
    if not (getattr(attn, "fuse_sublayer", False) and getattr(ffn, "fuse_sublayer", False)
            and getattr(body, "activation", None) == "relu"):
        return None
    whole = (not attn.pre_norm and not ffn.pre_norm
             and all(unhooked(module) for module in (layer, attn, ffn, registered(attn, "body"), body)))
    return (attn, ffn) if whole else None


def _with_masks(settings: list[tuple[object, ...]]) -> tuple[tuple[object, ...], ...]:
    """The layers' settings with each dropout rate replaced by its mask's ``(seed, keep_below)``: drawn once every
    layer is known to run here, in the order the layers one by one would draw them, in one call (under
    ``torch.compile`` by the operator, :data:`~gatedformer.ops.operators.TRACED_SEED`)."""
    keeps = [dropout_ops._keep_below(p) for layer in settings for p in (layer[2], layer[5], layer[6])]
    count = sum(keep < _INT32_VALUES for keep in keeps)
    seeds = iter([TRACED_SEED] * count if torch.compiler.is_compiling() else dropout_ops._draw_seeds(count))
    masks = [(next(seeds) if keep < _INT32_VALUES else 0, keep) for keep in keeps]
    return tuple((eps, heads, masks[3 * i], tail, ffn_eps, masks[3 * i + 1], masks[3 * i + 2], ffn_tail)
                 for i, (eps, heads, _, tail, ffn_eps, _, _, ffn_tail) in enumerate(settings))


def _global_hooks() -> bool:
    hooks = torch.nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks or hooks._global_backward_hooks
                or hooks._global_backward_pre_hooks)


def _streams_whole_stack(x: Tensor, memories: list[Tensor | None], settings: list[tuple[object, ...]],
                         parameters: list[Tensor]) -> bool:
    """Whether :class:`StreamedLayerStack` runs these layers (``parameters``: 18 per layer, the SDUs' ``None`` where
    there is none): MKL's packed products, memories all absent or all of one length, one number of heads and one FFN
    width, shapes whose blocks it can split (see ``stack_blocks``) and, with SDUs, the gate kernel."""
    if not _packed_products() or not all(p is None or p.is_contiguous() for p in parameters):
        return False
    sdus = (p for i in range(len(settings)) for p in parameters[i * _STREAMED + _PLAIN : (i + 1) * _STREAMED])
    if any(p is not None for p in sdus) and not runs_native(_gate_kernel.KERNEL, x.device):
        return False
    lengths = {None if m is None else m.shape[1] for m in memories}
    heads = {layer_settings[1] for layer_settings in settings}
    hidden = {parameters[i * _STREAMED + _ATTENTION].shape[0] for i in range(len(settings))}
    if len(lengths) != 1 or len(heads) != 1 or len(hidden) != 1:
        return False
    batch, length, width = x.shape
    hidden_width = parameters[_ATTENTION].shape[0]
    if torch.compiler.is_compiling():
        return _blocks_split_always(int(batch), int(length), int(width), int(hidden_width))
    return _epilogue_kernel.stack_blocks(batch, length, width, hidden_width) is not None


@constant_under_compile
def _packed_products() -> bool:
    """Whether MKL's packed products are there (under ``torch.compile`` asked once, while dynamo traces)."""
    return _blas.packed_gemm() is not None


@constant_under_compile
def _blocks_split_always(batch: int, length: int, width: int, hidden_width: int) -> bool:
    """Whether the streamed stack splits these shapes into blocks (see ``stack_blocks``) on any number of threads:
    asked once while dynamo traces, and the graph does not follow the thread count, which may change after."""
    return all(_epilogue_kernel.stack_blocks(batch, length, width, hidden_width, threads) is not None
               for threads in range(1, batch + 1))


def _declined(reason: str) -> None:
    if explaining():
        declined("ops.layer_stack.layer_stack", reason)


def layer_stack(layers: Sequence[nn.Module], x: Tensor, memories: Sequence[Tensor] | None,
                pos: Tensor) -> tuple[Tensor, list[Tensor]] | None:
    """``layers`` (Transformer-XL layers) applied in turn to ``x (B, L, d)`` with their ``memories`` (one ``(B, M, d)``
    each, or ``None``) and the position encodings ``pos``, by :class:`LayerStack` where that applies (see the
    module): the last output and the list of every layer's input. Else ``None``."""
    if not layers or not torch.is_grad_enabled() or _global_hooks() or pos.requires_grad:
        return _declined("no layers, no gradients, global module hooks or position encodings that need gradients")
    memories = list(memories) if memories else [None] * len(layers)
    if any(m is not None and m.requires_grad for m in memories):
        return _declined("a memory needs gradients")
    memories = [m if m is not None and m.shape[1] > 0 else None for m in memories]
    # Every layer's input has x's shape, dtype and device: what the sublayers ask of their inputs is asked once, of x.
    if not relative_inputs_fuse(x, memories, pos):
        return _declined(first_reason((x, pos, *memories), kernels=(RELATIVE_KERNEL, _epilogue_kernel.KERNEL))
                         or "memories or position encodings of shapes it does not take")
    width = x.shape[-1]
    settings, parameters, streamed = [], [], []
    streamable = True  # whether StreamedLayerStack takes every layer's gates
    for layer in layers:
        sublayers = _whole_sublayers(layer)
        if sublayers is None:
            return _declined("a layer's sublayers do not each run as one function (pre-LN, hooks, a GLU feed-forward "
                             "or gates the whole-sublayer functions do not list)")
        attn, ffn = sublayers
        # Read from the modules' tables (see registered): a few hundred reads a step.
        attention, feed_forward = registered(attn, "body"), registered(ffn, "body")
        attention_norm, ffn_norm = registered(attn, "norm"), registered(ffn, "norm")
        inner, outer = registered(feed_forward, "inner"), registered(feed_forward, "outer")
        p_attention, p_inner, p_ffn = (registered(module, "dropout").p for module in (attn, feed_forward, ffn))
        attention_gates, ffn_gates = attn.fused_gates(), ffn.fused_gates()
        streamable = streamable and _streamable("attn", attention_gates) and _streamable("ffn", ffn_gates)
        if not (relative_layers_fuse(attention, p_attention, attention_norm, width)
                and feed_forward_layers_fuse(width, inner, outer, p_inner, p_ffn, ffn_norm, ffn.training)
                and branches_fuse(x, p_attention, True, *attention_gates)
                and branches_fuse(x, p_ffn, ffn.training, *ffn_gates)):
            return _declined(sublayer_reason(x, (attention_norm, inner, outer, ffn_norm), ffn.training,
                                             *attention_gates))
        *attention_branch, attention_tail = _branch_parameters(*attention_gates)
        *ffn_branch, ffn_tail = _branch_parameters(*ffn_gates)
        settings.append((attention_norm.eps, attention.n_heads, p_attention, attention_tail, ffn_norm.eps, p_inner,
                         p_ffn, ffn_tail))
        attention_plain = [*(registered(registered(attention, name), "weight") for name in _PROJECTIONS),
                           registered(attention, "u"), registered(attention, "v"), registered(attention_norm, "weight"),
                           registered(attention_norm, "bias")]
        ffn_plain = [registered(inner, "weight"), registered(inner, "bias"), registered(outer, "weight"),
                     registered(outer, "bias"), registered(ffn_norm, "weight"), registered(ffn_norm, "bias")]
        parameters += [*attention_plain, *attention_branch, *ffn_plain, *ffn_branch]
        # A branch's first two are the GRC's weight and bias, the next two the unit's.
        streamed += [*attention_plain, *ffn_plain, *attention_branch[2:4], *ffn_branch[2:4], *attention_branch[:2],
                     *ffn_branch[:2], *attention_branch[4:10]]
    masked = _flat_settings(_with_masks(settings))
    if streamable and _streams_whole_stack(x, memories, settings, streamed):
        out, *later_inputs = call(STREAMED_LAYER_STACK, x, pos, memories, *masked, *streamed)
    else:
        out, *later_inputs = call(LAYER_STACK, x, pos, memories, *masked, *parameters)
    return out, [x, *later_inputs]
