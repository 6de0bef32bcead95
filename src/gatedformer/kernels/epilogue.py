"""Linear-layer epilogues that apply dropout masks: what :mod:`gatedformer.ops.fused_linear` computes with.

A small C++ kernel, ``csrc/epilogue.cpp`` (C API: ``csrc/epilogue.h``; built by :mod:`gatedformer.kernels.build`),
sharing the Philox4x32-10 mask generator of :mod:`gatedformer.kernels.dropout` (``csrc/philox.h``), so every mask
here is the one :func:`~gatedformer.kernels.dropout.apply_dropout` would draw for the same seed and element. It
works in place on a linear layer's product:

* ``bias_relu_dropout_``: ``relu(h + bias)`` times the mask, and one bit per element where the result is
  positive; ``scale_where_positive_with_sums`` is its backward pass from those bits, summing the bias gradient;
* ``bias_dropout_add_``: ``base + (h + bias)`` times the mask (no ``base``: only the bias and the mask);
* ``dropout_add_norm``: ``LayerNorm(base + (h + bias) * mask)`` row by row, keeping what its backward pass,
  ``dropout_add_norm_backward``, needs (the normalised rows, ``1/std`` per row and the mask as bits); with a
  gated residual connection's gate ``g``, ``LayerNorm(base + g * (h + bias) * mask)``
  (``gated_dropout_add_norm_backward``).

Column sums are taken in fixed blocks of rows, so results do not depend on the number of threads. It follows
the dropout kernel's switch, ``GATEDFORMER_DROPOUT_BACKEND``; without the kernel the callers compute unfused.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from gatedformer.kernels.blas import PackedGemm
from gatedformer.kernels.build import HEAVY_ELEMENT, NativeKernel, kernel_threads
from gatedformer.kernels.dropout import (
    _NO_FMA,
    apply_dropout,
    apply_dropout_add,
    apply_relu_dropout,
    keep_word,
)

__all__ = ["KERNEL", "attention_body_streamed", "attention_body_streamed_backward", "attention_sublayer_streamed",
           "attention_sublayer_streamed_backward", "bias_dropout_add_", "bias_relu_dropout_", "dropout_add_norm",
           "dropout_add_norm_backward", "feed_forward_body_streamed", "feed_forward_body_streamed_backward",
           "feed_forward_streamed", "feed_forward_streamed_backward", "gated_dropout_add_norm_backward",
           "relative_stack_streamed", "relative_stack_streamed_backward", "relative_sublayer_streamed",
           "relative_sublayer_streamed_backward", "scale_where_positive_with_sums", "stack_blocks"]


KERNEL = NativeKernel(
    "epilogue", abi_version=12, env_var="GATEDFORMER_DROPOUT_BACKEND",
    description="the compiled linear-epilogue kernel", fallback="unfused PyTorch operations",
    extra_cflags=_NO_FMA, avx512=True,
)


def _native_ok(x: Tensor) -> bool:
    return x.dtype == torch.float32 and KERNEL.pick_backend(x.device) == "native"


def bias_relu_dropout_(h: Tensor, bias: Tensor, seed: int, keep_below: int, scale: float) -> tuple[Tensor, Tensor]:
    """``h <- relu(h + bias)`` times the mask of ``seed``, in place: the epilogue of a linear layer's product ``h``
    (contiguous float32 rows on the CPU, ``bias`` one row). The mask is the one :func:`apply_relu_dropout` draws.

    Also returns where the result is positive, one bit per element (``int32`` words, element ``i`` at bit
    ``i % 32`` of word ``i // 32``): all that :func:`scale_where_positive_with_sums` needs of it.
    """
    positive = torch.empty(-(-h.numel() // 32), dtype=torch.int32)
    if _native_ok(h) and h.dtype == torch.float32:
        KERNEL.library().bias_relu_dropout_f32(h.data_ptr(), bias.data_ptr(), h.numel(), h.shape[-1], seed,
                                               keep_word(keep_below), scale,
                                               kernel_threads(h.numel(), cost=HEAVY_ELEMENT), positive.data_ptr())
        return h, positive
    h.copy_(apply_relu_dropout(h + bias, seed, keep_below, scale))
    return h, _pack_bits(h.reshape(-1) > 0)


def _pack_bits(flags: Tensor) -> Tensor:
    padded = np.zeros(-(-flags.numel() // 32) * 32, dtype=np.uint8)
    padded[:flags.numel()] = flags.numpy()
    return torch.from_numpy(np.packbits(padded, bitorder="little").view(np.int32).copy())


def _unpack_bits(positive: Tensor, count: int) -> Tensor:
    return torch.from_numpy(np.unpackbits(positive.numpy().view(np.uint8), bitorder="little")[:count].astype(bool))


def bias_dropout_add_(h: Tensor, base: Tensor | None, bias: Tensor, seed: int, keep_below: int,
                      scale: float) -> Tensor:
    """``h <- base + (h + bias)`` times the mask of ``seed``, in place (see :func:`bias_relu_dropout_`); without
    a ``base``, only the bias and the mask."""
    if _native_ok(h) and h.dtype == torch.float32 and (base is None or base.dtype == h.dtype):
        KERNEL.library().bias_dropout_add_f32(None if base is None else base.data_ptr(), h.data_ptr(),
                                              bias.data_ptr(), h.numel(), h.shape[-1], seed, keep_word(keep_below),
                                              scale, kernel_threads(h.numel(), cost=HEAVY_ELEMENT))
        return h
    if base is None:
        return h.copy_(apply_dropout(h + bias, seed, keep_below, scale))
    return h.copy_(apply_dropout_add(base, h + bias, seed, keep_below, scale))


def scale_where_positive_with_sums(positive: Tensor, grad: Tensor, scale: float,
                                   in_place: bool = False) -> tuple[Tensor, Tensor]:
    """``grad * scale`` where the bits of ``positive`` (from :func:`bias_relu_dropout_`) are set, else 0, for 2-d
    ``grad``; and the sums of its columns (one pass natively). With ``in_place`` the result is written over a
    contiguous ``grad`` (a temporary of the caller's: no second buffer of its size to fill)."""
    if _native_ok(grad) and grad.dtype == torch.float32:
        in_place = in_place and grad.is_contiguous()
        grad = grad.contiguous()
        out = grad if in_place else torch.empty_like(grad)
        sums = grad.new_empty(grad.shape[1])
        KERNEL.library().positive_scale_colsum_f32(positive.data_ptr(), grad.data_ptr(), out.data_ptr(),
                                                   sums.data_ptr(), grad.shape[0], grad.shape[1], scale,
                                                   kernel_threads(grad.numel()))
        return out, sums
    keep = _unpack_bits(positive, grad.numel()).view(grad.shape)
    out = grad * keep.to(grad.dtype) * scale
    return out, out.sum(0)


def dropout_add_norm(h: Tensor, base: Tensor, bias: Tensor | None, gamma: Tensor, beta: Tensor, eps: float, seed: int,
                     keep_below: int, scale: float, in_place: bool = False,
                     gate: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``LayerNorm(base + (h + bias) * mask)`` over the rows of 2-d float32 ``h`` (the mask of ``seed``, as in
    :func:`apply_dropout_add`; no bias: ``None``), or with a ``gate`` of ``h``'s shape (a GRC's
    ``sigmoid(Wg r + bg)``) ``LayerNorm(base + gate * (h + bias) * mask)``. Returns the result, the normalised
    rows (written over ``h`` with ``in_place``), each row's ``1 / sqrt(var + eps)`` and the mask as bits
    (``int32`` words, ``ceil(cols / 32)`` a row). Needs the compiled kernel."""
    rows, cols = h.shape
    y, rstd = torch.empty_like(h), h.new_empty(rows)
    xhat = h if in_place else torch.empty_like(h)
    bias = h.new_zeros(cols) if bias is None else bias
    keep_bits = torch.empty(rows, -(-cols // 32), dtype=torch.int32)
    KERNEL.library().dropout_add_norm_f32(base.data_ptr(), h.data_ptr(), bias.data_ptr(),
                                          None if gate is None else gate.data_ptr(), xhat.data_ptr(),
                                          gamma.data_ptr(), beta.data_ptr(), y.data_ptr(), rstd.data_ptr(),
                                          keep_bits.data_ptr(), rows, cols, eps, seed, keep_word(keep_below), scale,
                                          kernel_threads(h.numel(), cost=HEAVY_ELEMENT))
    return y, xhat, rstd, keep_bits


def dropout_add_norm_backward(grad: Tensor, xhat: Tensor, rstd: Tensor, gamma: Tensor, keep_bits: Tensor,
                              scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :func:`dropout_add_norm` from that of its result: the residual's, the linear layer's
    (before the mask), and the sums over rows for gamma, beta and the bias."""
    rows, cols = xhat.shape
    grad = grad.contiguous()
    dv, dh, sums = torch.empty_like(xhat), torch.empty_like(xhat), xhat.new_empty(3, cols)
    KERNEL.library().dropout_add_norm_backward_f32(grad.data_ptr(), xhat.data_ptr(), rstd.data_ptr(),
                                                   gamma.data_ptr(), keep_bits.data_ptr(), None, None, None,
                                                   dv.data_ptr(), dh.data_ptr(), None, sums.data_ptr(), rows, cols,
                                                   scale, kernel_threads(grad.numel(), cost=HEAVY_ELEMENT))
    return dv, dh, sums[0], sums[1], sums[2]


def gated_dropout_add_norm_backward(grad: Tensor, xhat: Tensor, rstd: Tensor, gamma: Tensor, keep_bits: Tensor,
                                    scale: float, gate: Tensor, h: Tensor,
                                    bias: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :func:`dropout_add_norm` with a ``gate`` (the forward's ``gate``, ``h`` and ``bias``):
    the residual's, the linear layer's, the gate's pre-activation's (``gate`` being a sigmoid), and the sums
    over rows for gamma, beta, the bias and the gate's bias."""
    rows, cols = xhat.shape
    grad = grad.contiguous()
    dv, dh, dgate = torch.empty_like(xhat), torch.empty_like(xhat), torch.empty_like(xhat)
    sums = xhat.new_empty(4, cols)
    KERNEL.library().dropout_add_norm_backward_f32(grad.data_ptr(), xhat.data_ptr(), rstd.data_ptr(),
                                                   gamma.data_ptr(), keep_bits.data_ptr(), gate.data_ptr(),
                                                   h.data_ptr(), bias.data_ptr(), dv.data_ptr(), dh.data_ptr(),
                                                   dgate.data_ptr(), sums.data_ptr(), rows, cols, scale,
                                                   kernel_threads(grad.numel(), cost=HEAVY_ELEMENT))
    return dv, dh, dgate, sums[0], sums[1], sums[2], sums[3]


def _stream_block_rows(hidden_width: int) -> int:
    """Rows per block of the streamed FFN: a multiple of the column sums' blocks (64 rows) whose elements in the
    hidden layer are a multiple of the mask generator's bulk draws (at most 128 words)."""
    return 64 if 64 * hidden_width % 128 == 0 else 128


def _check_scratch(status: int) -> None:
    if status != 0:
        raise MemoryError("the streamed sublayer kernel could not allocate its packed weights; free memory or set "
                          "GATEDFORMER_PACKED_GEMM=0")


def feed_forward_streamed(blas: PackedGemm, x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, gamma: Tensor,
                          beta: Tensor, eps: float, inner_mask: tuple[int, int], inner_scale: float,
                          outer_mask: tuple[int, int], outer_scale: float) -> tuple[Tensor, ...]:
    """``norm(x + dropout(W2 dropout(relu(W1 x + b1)) + b2))`` on the rows of contiguous float32 ``x``, each thread
    streaming its own blocks of rows through the whole sublayer (MKL's packed products via ``blas``): the result of
    :func:`bias_relu_dropout_` then :func:`dropout_add_norm` on the products, with the same masks. Returns the
    output, the hidden layer, its positive bits, the normalised rows, ``1/std`` per row and the outer mask's bits."""
    rows, width = x.shape
    hidden_width = w1.shape[0]
    block = _stream_block_rows(hidden_width)
    hidden, positive = x.new_empty(rows, hidden_width), torch.empty(-(-rows * hidden_width // 32), dtype=torch.int32)
    xhat, y, rstd = torch.empty_like(x), torch.empty_like(x), x.new_empty(rows)
    keep_bits = torch.empty(rows, -(-width // 32), dtype=torch.int32)
    threads = min(kernel_threads(rows * hidden_width), -(-rows // block))
    _check_scratch(KERNEL.library().ffn_forward_f32(
        blas.pack, blas.compute, blas.local_threads, x.data_ptr(), w1.data_ptr(), b1.data_ptr(), w2.data_ptr(),
        b2.data_ptr(), gamma.data_ptr(), beta.data_ptr(), blas.packed_floats(block, hidden_width, width),
        blas.packed_floats(block, width, hidden_width), hidden.data_ptr(), positive.data_ptr(), xhat.data_ptr(),
        y.data_ptr(), rstd.data_ptr(), keep_bits.data_ptr(),
        rows, width, hidden_width, eps, inner_mask[0], keep_word(inner_mask[1]), inner_scale, outer_mask[0],
        keep_word(outer_mask[1]),
        outer_scale, block, threads))
    return y, hidden, positive, xhat, rstd, keep_bits


def feed_forward_streamed_backward(blas: PackedGemm, grad: Tensor, xhat: Tensor, rstd: Tensor, gamma: Tensor,
                                   keep_bits: Tensor, positive: Tensor, w1: Tensor, w2: Tensor, inner_scale: float,
                                   outer_scale: float, inputs: tuple[Tensor, Tensor] | None = None
                                   ) -> tuple[Tensor | None, ...]:
    """The backward pass of :func:`feed_forward_streamed`: x's gradient (the residual's share plus the body's), those
    of the two products' outputs, the sums for gamma, beta, b2 and b1, then with ``inputs`` (the forward pass's ``x``
    and hidden layer) ``W1``'s and ``W2``'s gradients where the stream runs on several threads (else ``None``)."""
    rows, width = xhat.shape
    hidden_width = w1.shape[0]
    block = _stream_block_rows(hidden_width)
    grad = grad.contiguous()
    grad_x, grad_outer = torch.empty_like(xhat), torch.empty_like(xhat)
    grad_inner, sums = xhat.new_empty(rows, hidden_width), xhat.new_empty(3 * width + hidden_width)
    threads = min(kernel_threads(rows * hidden_width), -(-rows // block))
    x, hidden, grad_weights = _weight_grad_buffers(inputs, threads, xhat, hidden_width)
    _check_scratch(KERNEL.library().ffn_backward_f32(
        blas.pack, blas.compute, blas.local_threads, blas.gemm, _address(x), _address(hidden), _address(grad_weights),
        grad.data_ptr(), xhat.data_ptr(), rstd.data_ptr(),
        gamma.data_ptr(), keep_bits.data_ptr(), positive.data_ptr(), w1.data_ptr(), w2.data_ptr(),
        blas.packed_floats(block, hidden_width, width), blas.packed_floats(block, width, hidden_width),
        grad_x.data_ptr(), grad_outer.data_ptr(), grad_inner.data_ptr(), sums.data_ptr(), rows, width, hidden_width,
        outer_scale, inner_scale, block, threads))
    return (grad_x, grad_outer, grad_inner, sums[:width], sums[width:2 * width], sums[2 * width:3 * width],
            sums[3 * width:], *_ffn_weight_grads(grad_weights, width, hidden_width))


def _weight_grad_buffers(inputs: tuple[Tensor, Tensor] | None, threads: int, like: Tensor,
                         hidden_width: int) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The streamed FFN backward's ``x``, hidden layer and buffer for the weights' gradients, or ``None`` each: on one
    thread the products gain nothing inside the stream (measured 0.97-1.01x), and the caller makes them."""
    if inputs is None or threads < 2:
        return None, None, None
    x, hidden = inputs
    return x, hidden, like.new_empty(2 * hidden_width * like.shape[-1])


def _ffn_weight_grads(grad_weights: Tensor | None, width: int, hidden_width: int) -> tuple[Tensor | None, ...]:
    if grad_weights is None:
        return None, None
    return (grad_weights[:hidden_width * width].view(hidden_width, width),
            grad_weights[hidden_width * width:].view(width, hidden_width))


def feed_forward_body_streamed(blas: PackedGemm, x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor,
                               inner_mask: tuple[int, int], inner_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``W2 dropout(relu(W1 x + b1))`` (no bias) streamed as :func:`feed_forward_streamed`, for a sublayer whose
    gates and LayerNorm come after it: the product, the hidden layer and its positive bits."""
    rows, width = x.shape
    hidden_width = w1.shape[0]
    block = _stream_block_rows(hidden_width)
    hidden, positive = x.new_empty(rows, hidden_width), torch.empty(-(-rows * hidden_width // 32), dtype=torch.int32)
    projected = torch.empty_like(x)
    threads = min(kernel_threads(rows * hidden_width), -(-rows // block))
    _check_scratch(KERNEL.library().ffn_forward_f32(
        blas.pack, blas.compute, blas.local_threads, x.data_ptr(), w1.data_ptr(), b1.data_ptr(), w2.data_ptr(),
        None, None, None, blas.packed_floats(block, hidden_width, width),
        blas.packed_floats(block, width, hidden_width), hidden.data_ptr(), positive.data_ptr(), projected.data_ptr(),
        None, None, None, rows, width, hidden_width, 0.0, inner_mask[0], keep_word(inner_mask[1]), inner_scale, 0, 0,
        0.0, block, threads))
    return projected, hidden, positive


def feed_forward_body_streamed_backward(blas: PackedGemm, grad_projected: Tensor, grad_x: Tensor, positive: Tensor,
                                        w1: Tensor, w2: Tensor, inner_scale: float,
                                        inputs: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor | None, ...]:
    """The backward pass of :func:`feed_forward_body_streamed` from its product's gradient: adds the body's share to
    ``grad_x`` (contiguous, in place) and returns the first product's output gradient and b1's, then with ``inputs``
    (as :func:`feed_forward_streamed_backward`'s) ``W1``'s and ``W2``'s gradients where it made them (else ``None``)."""
    rows, width = grad_x.shape
    hidden_width = w1.shape[0]
    block = _stream_block_rows(hidden_width)
    grad_projected = grad_projected.contiguous()
    grad_inner, sums = grad_x.new_empty(rows, hidden_width), grad_x.new_empty(3 * width + hidden_width)
    threads = min(kernel_threads(rows * hidden_width), -(-rows // block))
    x, hidden, grad_weights = _weight_grad_buffers(inputs, threads, grad_x, hidden_width)
    _check_scratch(KERNEL.library().ffn_backward_f32(
        blas.pack, blas.compute, blas.local_threads, blas.gemm, _address(x), _address(hidden), _address(grad_weights),
        None, None, None, None, None, positive.data_ptr(),
        w1.data_ptr(), w2.data_ptr(), blas.packed_floats(block, hidden_width, width),
        blas.packed_floats(block, width, hidden_width), grad_x.data_ptr(), grad_projected.data_ptr(),
        grad_inner.data_ptr(), sums.data_ptr(), rows, width, hidden_width, 0.0, inner_scale, block, threads))
    return grad_inner, sums[3 * width:], *_ffn_weight_grads(grad_weights, width, hidden_width)


def _block_sequences(length: int) -> int:
    """Sequences per block of the streamed attention sublayer: the fewest whose rows are a whole number of the
    column sums' 64-row blocks."""
    return 64 // math.gcd(length, 64)


def attention_sublayer_streamed(blas: PackedGemm, attend: int, x: Tensor, batch: int, n_heads: int, w_qkv: Tensor,
                                b_qkv: Tensor, w_out: Tensor, b_out: Tensor, gamma: Tensor, beta: Tensor, eps: float,
                                mask: tuple[int, int], scale: float) -> tuple[Tensor, ...]:
    """``norm(x + dropout(Wo attention(Wqkv x + bqkv) + bo))`` on the rows of ``batch`` sequences, each thread
    streaming its own blocks of whole sequences through the sublayer (MKL's packed products via ``blas``; ``attend``:
    the address of the attention kernel's forward function, run on the calling thread). Returns the output, the
    projections (without their bias), the attention's output and log-sum-exps, the normalised rows, ``1/std`` per
    row and the mask's bits."""
    rows, width = x.shape
    length, block = rows // batch, _block_sequences(rows // batch)
    block_rows = block * length
    qkv, attended = x.new_empty(rows, 3 * width), torch.empty_like(x)
    lse = x.new_empty(batch, n_heads, length)
    xhat, y, rstd = torch.empty_like(x), torch.empty_like(x), x.new_empty(rows)
    keep_bits = torch.empty(rows, -(-width // 32), dtype=torch.int32)
    threads = min(kernel_threads(3 * rows * width), -(-batch // block))
    _check_scratch(KERNEL.library().attention_sublayer_forward_f32(
        blas.pack, blas.compute, blas.local_threads, attend, x.data_ptr(), w_qkv.data_ptr(), b_qkv.data_ptr(),
        w_out.data_ptr(), b_out.data_ptr(), gamma.data_ptr(), beta.data_ptr(),
        blas.packed_floats(block_rows, 3 * width, width), blas.packed_floats(block_rows, width, width),
        qkv.data_ptr(), attended.data_ptr(), lse.data_ptr(), xhat.data_ptr(), y.data_ptr(), rstd.data_ptr(),
        keep_bits.data_ptr(), batch, length, n_heads, width, eps, mask[0], keep_word(mask[1]), scale, block,
        threads))
    return y, qkv, attended, lse, xhat, rstd, keep_bits


def attention_body_streamed(blas: PackedGemm, attend: int, x: Tensor, batch: int, n_heads: int, w_qkv: Tensor,
                            b_qkv: Tensor, w_out: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``Wo attention(Wqkv x + bqkv)`` (no bias) streamed as :func:`attention_sublayer_streamed`, for a sublayer whose
    gates and LayerNorm come after it: the product, the projections (without their bias), the attention's output
    and its log-sum-exps."""
    rows, width = x.shape
    length, block = rows // batch, _block_sequences(rows // batch)
    block_rows = block * length
    qkv, attended, projected = x.new_empty(rows, 3 * width), torch.empty_like(x), torch.empty_like(x)
    lse = x.new_empty(batch, n_heads, length)
    threads = min(kernel_threads(3 * rows * width), -(-batch // block))
    _check_scratch(KERNEL.library().attention_sublayer_forward_f32(
        blas.pack, blas.compute, blas.local_threads, attend, x.data_ptr(), w_qkv.data_ptr(), b_qkv.data_ptr(),
        w_out.data_ptr(), None, None, None, blas.packed_floats(block_rows, 3 * width, width),
        blas.packed_floats(block_rows, width, width), qkv.data_ptr(), attended.data_ptr(), lse.data_ptr(),
        projected.data_ptr(), None, None, None, batch, length, n_heads, width, 0.0, 0, 0, 0.0, block, threads))
    return projected, qkv, attended, lse


def attention_body_streamed_backward(blas: PackedGemm, attend_back: int, grad_projected: Tensor, grad_x: Tensor,
                                     qkv: Tensor, b_qkv: Tensor, attended: Tensor, lse: Tensor, w_qkv: Tensor,
                                     w_out: Tensor, bias_grad: bool) -> tuple[Tensor, Tensor | None]:
    """The backward pass of :func:`attention_body_streamed` from its product's gradient: adds the body's share to
    ``grad_x`` (contiguous, in place) and returns the projections' output gradient and (with ``bias_grad``) their
    bias's."""
    rows, width = grad_x.shape
    batch, n_heads, length = lse.shape
    block = _block_sequences(length)
    grad_projected = grad_projected.contiguous()
    grad_attended, grad_qkv, sums = torch.empty_like(grad_x), torch.empty_like(qkv), grad_x.new_empty(3 * width)
    per_sequence = qkv.new_empty(batch, 3 * width) if bias_grad else None
    threads = min(kernel_threads(3 * rows * width), -(-batch // block))
    _check_scratch(KERNEL.library().attention_sublayer_backward_f32(
        blas.pack, blas.compute, blas.local_threads, attend_back, None, None, None, None, None, qkv.data_ptr(),
        b_qkv.data_ptr(), attended.data_ptr(), lse.data_ptr(), w_qkv.data_ptr(), w_out.data_ptr(),
        blas.packed_floats(block * length, width, width), blas.packed_floats(block * length, width, 3 * width),
        grad_x.data_ptr(), grad_projected.data_ptr(), grad_attended.data_ptr(), grad_qkv.data_ptr(),
        None if per_sequence is None else per_sequence.data_ptr(), sums.data_ptr(), batch, length, n_heads, width,
        0.0, block, threads))
    return grad_qkv, None if per_sequence is None else per_sequence.sum(0)


def attention_sublayer_streamed_backward(blas: PackedGemm, attend_back: int, grad: Tensor, xhat: Tensor, rstd: Tensor,
                                         gamma: Tensor, keep_bits: Tensor, qkv: Tensor, b_qkv: Tensor,
                                         attended: Tensor, lse: Tensor, w_qkv: Tensor, w_out: Tensor,
                                         scale: float, bias_grad: bool) -> tuple[Tensor | None, ...]:
    """The backward pass of :func:`attention_sublayer_streamed` up to the weights' gradients: x's, those of the output
    projection's output and of the projections (``Wo``'s and ``Wqkv``'s are their products with the inputs), the
    projections' bias gradient (with ``bias_grad``) and the sums for gamma, beta and bo."""
    rows, width = xhat.shape
    batch, n_heads, length = lse.shape
    block = _block_sequences(length)
    grad = grad.contiguous()
    grad_x, grad_projected, grad_attended = torch.empty_like(xhat), torch.empty_like(xhat), torch.empty_like(xhat)
    grad_qkv, sums = torch.empty_like(qkv), xhat.new_empty(3 * width)
    per_sequence = qkv.new_empty(batch, 3 * width) if bias_grad else None
    threads = min(kernel_threads(3 * rows * width), -(-batch // block))
    _check_scratch(KERNEL.library().attention_sublayer_backward_f32(
        blas.pack, blas.compute, blas.local_threads, attend_back, grad.data_ptr(), xhat.data_ptr(), rstd.data_ptr(),
        gamma.data_ptr(), keep_bits.data_ptr(), qkv.data_ptr(), b_qkv.data_ptr(), attended.data_ptr(),
        lse.data_ptr(), w_qkv.data_ptr(), w_out.data_ptr(), blas.packed_floats(block * length, width, width),
        blas.packed_floats(block * length, width, 3 * width), grad_x.data_ptr(), grad_projected.data_ptr(),
        grad_attended.data_ptr(), grad_qkv.data_ptr(), None if per_sequence is None else per_sequence.data_ptr(),
        sums.data_ptr(), batch, length, n_heads, width, scale, block, threads))
    return (grad_x, grad_projected, grad_qkv, None if per_sequence is None else per_sequence.sum(0), sums[:width],
            sums[width:2 * width], sums[2 * width:])


def _address(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _relative_blocks(batch: int, length: int, work: int, threads: int | None = None) -> tuple[int, int]:
    """Sequences per block and threads for the streamed relative attention sublayer: each thread's share of the batch
    in one block where whole blocks of the column sums' 64 rows allow (the attention kernel packs every head's position
    keys once per call, so once per block). ``threads``: the thread count to plan for (default: this call's)."""
    threads = max(1, min(kernel_threads(work) if threads is None else threads, batch))
    unit = _block_sequences(length)
    share = -(-batch // threads)
    block = -(-share // unit) * unit
    return block, max(1, min(threads, -(-batch // block)))


def _check_relative(status: int) -> None:
    _check_scratch(1 if status == 1 else 0)
    if status:
        raise RuntimeError("the relative attention kernel refused these shapes (heads of more than 128?)")


def relative_sublayer_streamed(blas: PackedGemm, attend: int, x: Tensor, memory: Tensor | None, r: Tensor, u: Tensor,
                               pos_bias: Tensor, w_q: Tensor, w_kv: Tensor, w_out: Tensor, batch: int, n_heads: int,
                               norm: tuple[Tensor, Tensor, float, tuple[int, int], float] | None
                               ) -> tuple[Tensor | None, ...]:
    """Transformer-XL's post-LN attention sublayer ``norm(x + dropout(Wo attend(Wq x, Wkv [memory ∘ x], r)))`` on the
    rows of ``batch`` sequences, ``x (B·L, d)`` and ``memory (B·M, d)`` or ``None``, each thread streaming its own
    blocks of whole sequences through it (MKL's packed products via ``blas``; ``attend``: the relative attention
    kernel's forward function, run on the calling thread). ``r (M+L, d)``: the projected position encodings; ``u``
    and ``pos_bias (H, D)``; ``norm``: the LayerNorm's ``gamma``, ``beta`` and ``eps``, the dropout mask and its
    scale, or ``None`` to stop at the output projection's product (a gated sublayer's tail follows).

    Returns the output (the product without ``norm``), the projections ``(B·L, 3d)`` (queries, then the window's
    keys and values), the memory's keys and values ``(B·M, 2d)`` or ``None``, the attention's output ``(B·L, d)`` and
    log-sum-exps ``(B, H, L)``, then, with ``norm``, the normalised rows, ``1/std`` per row and the mask's bits."""
    rows, width = x.shape
    length, mem = rows // batch, 0 if memory is None else memory.shape[0] // batch
    block, threads = _relative_blocks(batch, length, 3 * rows * width)
    qkv, attended, xhat = x.new_empty(rows, 3 * width), torch.empty_like(x), torch.empty_like(x)
    memory_kv = None if memory is None else x.new_empty(memory.shape[0], 2 * width)
    lse = x.new_empty(batch, n_heads, length)
    gamma = beta = y = rstd = keep_bits = bias = None
    eps, seed, keep, scale = 0.0, 0, 0, 0.0
    if norm is not None:
        gamma, beta, eps, (seed, keep_below), scale = norm
        keep = keep_word(keep_below)
        y, rstd = torch.empty_like(x), x.new_empty(rows)
        keep_bits = torch.empty(rows, -(-width // 32), dtype=torch.int32)
        bias = x.new_zeros(width)  # the tail adds one; the output projection has none
    rows_max = block * max(length, mem)
    _check_relative(KERNEL.library().relative_sublayer_forward_f32(
        blas.pack, blas.compute, blas.local_threads, attend, x.data_ptr(), _address(memory), r.data_ptr(),
        u.data_ptr(), pos_bias.data_ptr(), w_q.data_ptr(), w_kv.data_ptr(), w_out.data_ptr(), _address(bias),
        _address(gamma), _address(beta), blas.packed_floats(rows_max, width, width),
        blas.packed_floats(rows_max, 2 * width, width), blas.packed_floats(rows_max, width, width), qkv.data_ptr(),
        _address(memory_kv), attended.data_ptr(), lse.data_ptr(), xhat.data_ptr(), _address(y), _address(rstd),
        _address(keep_bits), batch, length, mem, n_heads, width, eps, seed, keep, scale, block, threads))
    if norm is None:
        return xhat, qkv, memory_kv, attended, lse, None, None, None
    return y, qkv, memory_kv, attended, lse, xhat, rstd, keep_bits


def relative_sublayer_streamed_backward(blas: PackedGemm, attend_back: int, qkv: Tensor, memory_kv: Tensor | None,
                                        r: Tensor, u: Tensor, pos_bias: Tensor, attended: Tensor, lse: Tensor,
                                        w_q: Tensor, w_kv: Tensor, w_out: Tensor, *,
                                        norm: tuple[Tensor, Tensor, Tensor, Tensor, Tensor, float] | None = None,
                                        grad_projected: Tensor | None = None, grad_x: Tensor | None = None,
                                        inputs: tuple[Tensor, Tensor | None] | None = None
                                        ) -> tuple[Tensor | None, ...]:
    """The backward pass of :func:`relative_sublayer_streamed` (``attend_back``: the kernel's backward function). From
    the output's gradient with ``norm = (grad, xhat, rstd, gamma, keep_bits, scale)``; without it, from
    ``grad_projected``, adding the body's share to ``grad_x`` (contiguous, in place). With ``inputs``, the forward
    pass's ``x`` and ``memory`` rows, the weights' gradients too where the stream runs on several threads.

    Returns x's gradient, the output projection's output gradient, the projections' ``(B·L, 3d)``, the memory's keys'
    and values' (or ``None``), the gradients of ``r``, ``u`` and ``pos_bias``, with ``norm`` gamma's and beta's (else
    ``None``), then the gradients of ``w_out`` and of ``[w_q; w_kv]`` where it made them (else ``None``)."""
    batch, n_heads, length = lse.shape
    rows, width = attended.shape
    mem = 0 if memory_kv is None else memory_kv.shape[0] // batch
    block, threads = _relative_blocks(batch, length, 3 * rows * width)
    dy = xhat = rstd = gamma = keep_bits = None
    scale = 0.0
    if norm is not None:
        dy, xhat, rstd, gamma, keep_bits, scale = norm
        dy = dy.contiguous()
        grad_x, grad_projected = torch.empty_like(attended), torch.empty_like(attended)
    elif grad_projected is None or grad_x is None:
        raise ValueError("relative_sublayer_streamed_backward takes norm, or grad_projected with grad_x")
    else:
        grad_projected = grad_projected.contiguous()
    grad_attended, grad_qkv = torch.empty_like(attended), torch.empty_like(qkv)
    grad_memory_kv = None if memory_kv is None else torch.empty_like(memory_kv)
    grad_r = r.new_empty(batch, *r.shape)  # each sequence's share, summed below
    grad_u, grad_pos_bias = u.new_empty(batch, *u.shape), u.new_empty(batch, *u.shape)
    sums = attended.new_empty(3 * width)
    # On one thread the weights' products gain nothing inside the stream (measured 0.98-0.99x): the caller makes them.
    x, memory = inputs if inputs is not None and threads > 1 else (None, None)
    grad_weights = None if x is None else attended.new_empty(4 * width, width)  # w_out's rows, then w_q's, w_kv's
    _check_relative(KERNEL.library().relative_sublayer_backward_f32(
        blas.pack, blas.compute, blas.local_threads, blas.gemm, _address(x), _address(memory), _address(grad_weights),
        attend_back, _address(dy), _address(xhat), _address(rstd),
        _address(gamma), _address(keep_bits), qkv.data_ptr(), _address(memory_kv), r.data_ptr(), u.data_ptr(),
        pos_bias.data_ptr(), attended.data_ptr(), lse.data_ptr(), w_q.data_ptr(), w_kv.data_ptr(), w_out.data_ptr(),
        blas.packed_floats(block * length, width, width), blas.packed_floats(block * length, width, width),
        blas.packed_floats(block * length, width, 2 * width), grad_x.data_ptr(), grad_projected.data_ptr(),
        grad_attended.data_ptr(), grad_qkv.data_ptr(), _address(grad_memory_kv), grad_r.data_ptr(),
        grad_u.data_ptr(), grad_pos_bias.data_ptr(), sums.data_ptr(), batch, length, mem, n_heads, width, scale,
        block, threads))
    norm_grads = (sums[:width], sums[width:2 * width]) if norm is not None else (None, None)
    weight_grads = (None, None) if grad_weights is None else (grad_weights[:width], grad_weights[width:])
    return (grad_x, grad_projected, grad_qkv, grad_memory_kv, grad_r.sum(0), grad_u.sum(0), grad_pos_bias.sum(0),
            *norm_grads, *weight_grads)


# ---- Transformer-XL's layers in one call (see relative_stack_forward in the C++ source) ---------------------------

_STACK_SLOTS = 54
"""Addresses per layer in the stack kernels' table, in the order of ``StackSlot``."""


MIX_CODE = 5.0
"""The stack kernels' code for a gated MHDPA's tail (the gate kernel's lerp on the body's output)."""


def stack_blocks(batch: int, length: int, width: int, hidden_width: int,
                 threads: int | None = None) -> tuple[int, int, int] | None:
    """Sequences per block, threads and FFN rows per product for :func:`relative_stack_streamed`, or ``None`` where
    its blocks would not start FFN rows at a multiple of the mask generator's bulk draws (an odd FFN width).
    ``threads``: the thread count to plan for (default: the one a call would use now)."""
    block, threads = _relative_blocks(batch, length, 3 * batch * length * width, threads)
    ffn_rows = _stream_block_rows(hidden_width)
    if block * length * hidden_width % 128 or ffn_rows * hidden_width % 128:
        return None
    return block, threads, ffn_rows


def relative_stack_streamed(blas: PackedGemm, attend: int, x: Tensor, memories: list[Tensor | None], r: Tensor,
                            weights: list[tuple[Tensor | None, ...]], settings: list[tuple[float, ...]],
                            masks: list[tuple[tuple[int, int], ...]], batch: int, n_heads: int,
                            tails: tuple[int, int, int] = (0, 0, 0)) -> tuple[list[Tensor], dict[str, Tensor]]:
    """Every layer of a post-LN Transformer-XL, ``FFN-sublayer(attention-sublayer(h, memory, r))`` in turn, in one
    parallel region: what :func:`relative_sublayer_streamed` then :func:`feed_forward_streamed` compute layer by
    layer (and the gates' tails of ``fused_linear._norm_tail``), with the same masks. ``x (B·L, d)``: the first layer's
    input rows; ``memories``: each layer's ``(B·M, d)`` rows (the same ``M``) or all ``None``; ``r (layers, M+L, d)``:
    the projected position encodings; ``weights``: per layer ``(u, pos_bias, w_q, w_kv, w_out, gamma, beta, w1, b1,
    w2, b2, gamma, beta)``, then, for gated layers, the attention's and the FFN's unit's ``Linear(d, 2d)`` weight and
    bias (an SDU's, a highway gate's or a gated MHDPA's), their GRCs' ``Linear(d, d)`` weight and bias and the
    attention's EAU's six parameters (``None`` where there is none); ``settings``: per layer the two LayerNorms' eps,
    the three masks' scales and, for gated layers, the two units' tail codes
    (:data:`~gatedformer.kernels.gate.TAILS`, :data:`MIX_CODE` for a gated MHDPA, -1 for none) and whether
    the attention and the FFN have a GRC and the attention an EAU (1 or 0); ``masks``: per layer the three masks'
    ``(seed, keep_below)`` (the attention's output, the FFN's hidden layer, its output); ``tails``: the gate kernel's
    forward and backward tail functions and its bias-sigmoid, by address (for gated layers).

    Returns every layer's output rows and what :func:`relative_stack_streamed_backward` needs (``"table"`` holds the
    addresses of all of it)."""
    # Long on purpose: it lays out every buffer and address of the kernel's flat per-layer table in the order the C
    # side reads them (csrc/epilogue.cpp, relative_stack_forward_f32), so the two layouts can be read side by side.
    n, (rows, width) = len(weights), x.shape
    length, hidden_width = rows // batch, weights[0][7].shape[0]
    gated = any(w is not None for layer in weights for w in layer[13:])
    weights = [tuple(layer) + (None,) * (27 - len(layer)) for layer in weights]
    settings = [tuple(real) + (-1.0, -1.0, 0.0, 0.0, 0.0)[len(real) - 5 :] for real in settings]
    mem = 0 if memories[0] is None else memories[0].shape[0] // batch
    block, threads, ffn_rows = stack_blocks(batch, length, width, hidden_width)  # type: ignore[misc]
    words = -(-width // 32)
    saved = {
        "qkv": x.new_empty(n, rows, 3 * width), "attended": x.new_empty(n, rows, width),
        "lse": x.new_empty(n, batch, n_heads, length), "xhat_a": x.new_empty(n, rows, width),
        "y_a": x.new_empty(n, rows, width), "rstd_a": x.new_empty(n, rows),
        "keep_a": torch.empty(n, rows, words, dtype=torch.int32), "hidden": x.new_empty(n, rows, hidden_width),
        "positive": torch.empty(n, -(-rows * hidden_width // 32), dtype=torch.int32),
        "xhat_f": x.new_empty(n, rows, width), "rstd_f": x.new_empty(n, rows),
        "keep_f": torch.empty(n, rows, words, dtype=torch.int32), "zero": x.new_zeros(width),
    }
    if mem:
        saved["memory_kv"] = x.new_empty(n, batch * mem, 2 * width)
    if gated:  # each unit's biased product, [a; b] per row, and a gated MHDPA's carry (the body's output)
        saved["sdu_a"], saved["sdu_f"] = x.new_empty(n, rows, 2 * width), x.new_empty(n, rows, 2 * width)
    if any(real[5] == MIX_CODE or real[6] == MIX_CODE or real[7] or real[8] or real[9] for real in settings):
        saved["carry_a"], saved["carry_f"] = x.new_empty(n, rows, width), x.new_empty(n, rows, width)
    if any(real[7] or real[8] for real in settings):  # each GRC's gate
        saved["grc_a"], saved["grc_f"] = x.new_empty(n, rows, width), x.new_empty(n, rows, width)
    if any(real[9] for real in settings):  # each EAU's hidden rows, pre-activations and output
        saved["eau_h"] = x.new_empty(n, rows, width // 2)
        saved["eau_e"], saved["eau_adj"], saved["eau_out"] = (x.new_empty(n, rows, width) for _ in range(3))
    outputs = [x.new_empty(rows, width) for _ in range(n)]

    def layer(t: Tensor) -> range:  # each layer's address in a stacked buffer
        return range(t.data_ptr(), t.data_ptr() + n * t.stride(0) * t.element_size(), t.stride(0) * t.element_size())

    stacked = zip(layer(r), layer(saved["qkv"]), layer(saved["memory_kv"]) if mem else [0] * n,
                  *(layer(saved[name]) for name in ("attended", "lse", "xhat_a", "y_a", "rstd_a", "keep_a", "hidden",
                                                     "positive", "xhat_f", "rstd_f", "keep_f")), strict=True)
    sdu_rows = zip(layer(saved["sdu_a"]), layer(saved["sdu_f"]), strict=True) if gated else [(0, 0)] * n
    carry_rows = (zip(layer(saved["carry_a"]), layer(saved["carry_f"]), strict=True) if "carry_a" in saved
                  else [(0, 0)] * n)
    grc_rows = (zip(layer(saved["grc_a"]), layer(saved["grc_f"]), strict=True) if "grc_a" in saved
                else [(0, 0)] * n)
    eau_names = ("eau_h", "eau_e", "eau_adj", "eau_out")
    eau_rows = (zip(*(layer(saved[name]) for name in eau_names), strict=True) if "eau_h" in saved
                else [(0, 0, 0, 0)] * n)
    table = []
    for i, ((u, pos_bias, w_q, w_kv, w_out, gamma_a, beta_a, w1, b1, w2, b2, gamma_f, beta_f, sdu_w_a, sdu_b_a, sdu_w_f,
             sdu_b_f, grc_w_a, grc_b_a, grc_w_f, grc_b_f, *eau), (r_i, qkv, memory_kv, attended, lse, xhat_a, y_a,
                                                                 rstd_a, keep_a, hidden, positive, xhat_f, rstd_f,
                                                                 keep_f),
            (sdu_a, sdu_f), (carry_a, carry_f), (grc_a, grc_f), eau_buffers) in enumerate(
            zip(weights, stacked, sdu_rows, carry_rows, grc_rows, eau_rows, strict=True)):
        table += [(x if i == 0 else outputs[i - 1]).data_ptr(), _address(memories[i]) or 0, r_i,
                  u.data_ptr(), pos_bias.data_ptr(), w_q.data_ptr(), w_kv.data_ptr(), w_out.data_ptr(),
                  gamma_a.data_ptr(), beta_a.data_ptr(), qkv, memory_kv, attended, lse, xhat_a, y_a, rstd_a, keep_a,
                  w1.data_ptr(), b1.data_ptr(), w2.data_ptr(), b2.data_ptr(), gamma_f.data_ptr(), beta_f.data_ptr(),
                  hidden, positive, xhat_f, outputs[i].data_ptr(), rstd_f, keep_f,
                  _address(sdu_w_a) or 0, _address(sdu_b_a) or 0, sdu_a if sdu_w_a is not None else 0,
                  _address(sdu_w_f) or 0, _address(sdu_b_f) or 0, sdu_f if sdu_w_f is not None else 0,
                  carry_a, carry_f, _address(grc_w_a) or 0, _address(grc_b_a) or 0, grc_a if grc_w_a is not None else 0,
                  _address(grc_w_f) or 0, _address(grc_b_f) or 0, grc_f if grc_w_f is not None else 0,
                  *(_address(w) or 0 for w in eau), *(eau_buffers if eau[0] is not None else (0,) * 4)]
    saved["table"] = torch.tensor(table, dtype=torch.int64)
    saved["reals"] = torch.tensor(settings, dtype=torch.float64)
    seeds = np.array([[seed for seed, _ in three] for three in masks], dtype=np.uint64)
    keeps = np.array([[keep_word(keep) for _, keep in three] for three in masks], dtype=np.uint32)
    saved["sizes"] = torch.tensor([n, batch, length, mem, n_heads, width, hidden_width, block, ffn_rows, int(gated)],
                                  dtype=torch.int64)
    rows_max = block * max(length, mem)
    half = width // 2
    gate_packs = [blas.packed_floats(rows_max, 2 * width, width), blas.packed_floats(ffn_rows, 2 * width, width),
                  blas.packed_floats(rows_max, width, width), blas.packed_floats(ffn_rows, width, width),
                  blas.packed_floats(rows_max, half, width), blas.packed_floats(rows_max, width, half),
                  blas.packed_floats(rows_max, width, width)]
    packed = torch.tensor([blas.packed_floats(rows_max, width, width), blas.packed_floats(rows_max, 2 * width, width),
                           blas.packed_floats(rows_max, width, width),
                           blas.packed_floats(ffn_rows, hidden_width, width),
                           blas.packed_floats(ffn_rows, width, hidden_width), *(gate_packs if gated else [0] * 7)],
                          dtype=torch.int64)
    saved["threads"] = torch.tensor(threads)
    saved["tails"] = torch.tensor(tails, dtype=torch.int64)
    _check_relative(KERNEL.library().relative_stack_forward_f32(
        blas.pack, blas.compute, blas.local_threads, attend, tails[0], tails[2], saved["table"].data_ptr(),
        saved["reals"].data_ptr(),
        seeds.ctypes.data, keeps.ctypes.data, saved["zero"].data_ptr(), packed.data_ptr(), saved["sizes"].data_ptr(),
        threads))
    return outputs, saved


def relative_stack_streamed_backward(blas: PackedGemm, attend_back: int, grad: Tensor, saved: dict[str, Tensor]
                                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The backward pass of :func:`relative_stack_streamed` from the last layer's output gradient ``(B·L, d)``, with
    the forward pass's ``saved`` (its inputs, weights and outputs still alive). Returns the first layer's input
    gradient, then per layer (one row each) the weights' gradients (``w_out``'s, ``[w_q; w_kv]``'s, ``w1``'s, ``w2``'s,
    then with SDUs the attention's and the FFN's SDU weights', flattened), the small ones (``r``'s summed over the
    batch, ``u``'s, ``pos_bias``'s) and the LayerNorms' and biases' (the attention LayerNorm's gamma and beta, the
    output projection's absent bias, the FFN LayerNorm's gamma and beta, ``b2``'s, ``b1``'s, then with SDUs the two
    SDU biases')."""
    n, batch, length, mem, n_heads, width, hidden_width, block, ffn_rows, gated = saved["sizes"].tolist()
    threads = int(saved["threads"])
    grad = grad.contiguous()
    grad_input = torch.empty_like(grad)
    half = width // 2
    weights = grad.new_empty(n, 4 * width * width + 2 * width * hidden_width
                             + (7 * width * width + 2 * half * width if gated else 0))
    small = grad.new_empty(n, (mem + length) * width + 2 * width)
    sums = grad.new_empty(n, 6 * width + hidden_width + (8 * width + half if gated else 0))
    rows_max = block * length
    gate_packs = [blas.packed_floats(rows_max, width, 2 * width), blas.packed_floats(ffn_rows, width, 2 * width),
                  blas.packed_floats(rows_max, width, width), blas.packed_floats(ffn_rows, width, width),
                  blas.packed_floats(rows_max, width, half), blas.packed_floats(rows_max, half, width),
                  blas.packed_floats(rows_max, width, width)]
    packed = torch.tensor([blas.packed_floats(rows_max, width, width), blas.packed_floats(rows_max, width, 2 * width),
                           blas.packed_floats(rows_max, width, width),
                           blas.packed_floats(ffn_rows, width, hidden_width),
                           blas.packed_floats(ffn_rows, hidden_width, width), *(gate_packs if gated else [0] * 7)],
                          dtype=torch.int64)
    library = KERNEL.library()
    # The kernel's gradient buffers and the threads' shares, as a tensor so that memory accounting sees them.
    scratch = grad.new_empty(library.relative_stack_scratch_floats(saved["sizes"].data_ptr(), threads))
    _check_relative(library.relative_stack_backward_f32(
        blas.pack, blas.compute, blas.local_threads, blas.gemm, attend_back, int(saved["tails"][1]),
        saved["table"].data_ptr(),
        saved["reals"].data_ptr(), grad.data_ptr(), grad_input.data_ptr(), weights.data_ptr(), small.data_ptr(),
        sums.data_ptr(), scratch.data_ptr(), packed.data_ptr(), saved["sizes"].data_ptr(), threads))
    return grad_input, weights, small, sums
