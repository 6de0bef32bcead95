"""Triton kernels of the SRU recurrence (the forward and the backward pass); see
:mod:`gatedformer.kernels.triton.sru`, which imports this module on first use only.

Each program walks ``BLOCK`` columns through every time step. The loads of a step do not depend on the
cell carried from the step before, so the loop is software-pipelined (``STAGES``): the loads of later
steps are in flight while a step computes, which hides most of their latency.
"""

import triton
import triton.language as tl


@triton.jit
def sru_forward_kernel(u_ptr, xs_ptr, vf_ptr, vr_ptr, bf_ptr, br_ptr, c0_ptr, h_ptr, c_ptr,
                       su_t, su_b, su_d, su_k, sx_t, sx_b, sx_d, alpha, L, B, D, H, BLOCK: tl.constexpr,
                       STAGES: tl.constexpr):
    n = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    N = B * D * H
    mask = n < N
    j, d, b = n % H, (n // H) % D, n // (D * H)
    dh = d * H + j
    vf = tl.load(vf_ptr + dh, mask=mask, other=0.0)
    vr = tl.load(vr_ptr + dh, mask=mask, other=0.0)
    bf = tl.load(bf_ptr + dh, mask=mask, other=0.0)
    br = tl.load(br_ptr + dh, mask=mask, other=0.0)
    c = tl.load(c0_ptr + n, mask=mask, other=0.0)
    u_col = b * su_b + d * su_d + j
    x_col = b * sx_b + d * sx_d + j
    backwards = d == 1
    for i in tl.range(0, L, num_stages=STAGES):
        t = tl.where(backwards, L - 1 - i, i).to(tl.int64)
        u_at = u_ptr + t * su_t + u_col
        x = tl.load(u_at, mask=mask, other=0.0)
        f = 1.0 / (1.0 + tl.exp(-(tl.load(u_at + su_k, mask=mask, other=0.0) + vf * c + bf)))
        r = 1.0 / (1.0 + tl.exp(-(tl.load(u_at + 2 * su_k, mask=mask, other=0.0) + vr * c + br)))
        s = tl.load(xs_ptr + t * sx_t + x_col, mask=mask, other=0.0)
        c = x + f * (c - x)
        tl.store(c_ptr + t * N + n, c, mask=mask)
        tl.store(h_ptr + t * N + n, alpha * s + r * (c - alpha * s), mask=mask)


@triton.jit
def sru_backward_kernel(u_ptr, xs_ptr, vf_ptr, vr_ptr, bf_ptr, br_ptr, c0_ptr, c_ptr, gh_ptr, gcl_ptr,
                        gu_ptr, gxs_ptr, part_ptr, gc0_ptr,
                        su_t, su_b, su_d, su_k, sx_t, sx_b, sx_d, sgx_t, sgx_b, sgx_d, alpha, L, B, D, H,
                        HAS_GRAD_C: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    n = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    N = B * D * H
    mask = n < N
    j, d, b = n % H, (n // H) % D, n // (D * H)
    dh = d * H + j
    vf = tl.load(vf_ptr + dh, mask=mask, other=0.0)
    vr = tl.load(vr_ptr + dh, mask=mask, other=0.0)
    bf = tl.load(bf_ptr + dh, mask=mask, other=0.0)
    br = tl.load(br_ptr + dh, mask=mask, other=0.0)
    c0 = tl.load(c0_ptr + n, mask=mask, other=0.0)
    if HAS_GRAD_C:
        gc = tl.load(gcl_ptr + n, mask=mask, other=0.0)
    else:
        gc = tl.full([BLOCK], 0.0, c0.dtype)
    acc_vf = tl.full([BLOCK], 0.0, c0.dtype)
    acc_vr = tl.full([BLOCK], 0.0, c0.dtype)
    acc_bf = tl.full([BLOCK], 0.0, c0.dtype)
    acc_br = tl.full([BLOCK], 0.0, c0.dtype)
    u_col = b * su_b + d * su_d + j
    x_col = b * sx_b + d * sx_d + j
    gx_col = b * sgx_b + d * sgx_d + j
    backwards = d == 1
    for k in tl.range(0, L, num_stages=STAGES):
        i = L - 1 - k  # position in the recurrence's own order, last first
        t = tl.where(backwards, L - 1 - i, i).to(tl.int64)
        # The step before in the recurrence's order; at its first step c0, and a harmless in-bounds read.
        t_prev = tl.where(i > 0, tl.where(backwards, t + 1, t - 1), t)
        c_prev = tl.where(i > 0, tl.load(c_ptr + t_prev * N + n, mask=mask, other=0.0), c0)
        u_at = u_ptr + t * su_t + u_col
        x = tl.load(u_at, mask=mask, other=0.0)
        f = 1.0 / (1.0 + tl.exp(-(tl.load(u_at + su_k, mask=mask, other=0.0) + vf * c_prev + bf)))
        r = 1.0 / (1.0 + tl.exp(-(tl.load(u_at + 2 * su_k, mask=mask, other=0.0) + vr * c_prev + br)))
        s = tl.load(xs_ptr + t * sx_t + x_col, mask=mask, other=0.0)
        c = tl.load(c_ptr + t * N + n, mask=mask, other=0.0)
        gh = tl.load(gh_ptr + t * N + n, mask=mask, other=0.0)
        g_c = gc + gh * r
        g_pr = gh * (c - alpha * s) * r * (1.0 - r)
        g_pf = g_c * (c_prev - x) * f * (1.0 - f)
        g_at = gu_ptr + t * su_t + u_col
        tl.store(g_at, g_c * (1.0 - f), mask=mask)
        tl.store(g_at + su_k, g_pf, mask=mask)
        tl.store(g_at + 2 * su_k, g_pr, mask=mask)
        tl.store(gxs_ptr + t * sgx_t + gx_col, gh * (1.0 - r) * alpha, mask=mask)
        acc_vf += g_pf * c_prev
        acc_vr += g_pr * c_prev
        acc_bf += g_pf
        acc_br += g_pr
        gc = g_c * f + g_pf * vf + g_pr * vr
    tl.store(part_ptr + n, acc_vf, mask=mask)
    tl.store(part_ptr + N + n, acc_vr, mask=mask)
    tl.store(part_ptr + 2 * N + n, acc_bf, mask=mask)
    tl.store(part_ptr + 3 * N + n, acc_br, mask=mask)
    tl.store(gc0_ptr + n, gc, mask=mask)
