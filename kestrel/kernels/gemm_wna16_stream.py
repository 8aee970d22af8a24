"""Decode WNA16 kernel built for bandwidth ("stream", CUDA cores, M <= 4 rows of x per program).

Each program owns BLOCK_N output columns and a contiguous K slab of the planar weight (packing.py). Per planar block
(PLANE_ROWS word rows = 128 k for 4-bit) it loads one [R, BLOCK_N] word tile straight into registers (16-byte loads
along N, no cp.async / shared memory, so no CTA barriers in the loop), prefetching the next block's tile (and scale
row) one iteration ahead. With BLOCK_N = 128 * num_warps every thread holds all R rows of its 4 columns, so the sum
over k is in-thread: [R, BN] partials take one FMA per weight, rows summed once per scale group. 4-bit ints decode
by mantissa insertion (_nib4: 4 shifts + 8 LOP3 per word; the offset / zero is corrected once per group through
the x sums), other ints into 1 + c / 2^B, minifloats into their bits times a power of two folded into the scale.
The decoded field is reused for every row of x in the program (BLOCK_M in 1, 2, 4: separate accumulators, so
nothing is re-laid out). Under programmatic dependent launch the first block's words are requested before
waiting for the previous kernel.

Split-K reduces in the same launch (gemm_wna16_small._finish: fp32 partials + a per-tile counter, the last split of
a tile sums in split order), so a GEMM is one kernel inside a CUDA graph.

Measured on the H200 (bench/results/gemm_wna16_smallm.md): issue-bound at ~4.3 instructions per weight element,
so slower than the tensor-core mv kernel (2.5 per element for 16 rows) on every shape timed (2-3 % on the small 8B
layers at M = 1, 14-30 % on the large ones); kept as a `kestrel tune` candidate for M <= 4.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kestrel.kernels import gemm_wna16_small as _small
from kestrel.kernels.dequant import decode_scale, int_plane, shift_bits
from kestrel.kernels.gemm_wna16_small import _finish, _workspace


@triton.jit
def _fp_bits(q, FIELD: tl.constexpr, BITS: tl.constexpr, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr):
    """Field FIELD (a minifloat, sign at bit EXP_BITS+MAN_BITS) -> fp32 equal to value * 2^(BIAS-127) (the caller
    multiplies the group result by 2^(127-BIAS) once instead of once per element)."""
    lo: tl.constexpr = FIELD * BITS
    mag = shift_bits(q, (23 - MAN_BITS) - lo) & (((1 << (EXP_BITS + MAN_BITS)) - 1) << (23 - MAN_BITS))
    sign = shift_bits(q, 31 - (lo + EXP_BITS + MAN_BITS)) & (-2147483648)
    return (mag | sign).to(tl.float32, bitcast=True)


@triton.jit
def _x_field(x_ptr, row_off, kx, K, EVEN_K: tl.constexpr):
    """x[row, kx] as a [R, 1] fp32 column (kx: the R contiguous k of one field; two 16-byte loads per thread)."""
    if EVEN_K:
        xi = tl.load(x_ptr + row_off + kx)
    else:
        xi = tl.load(x_ptr + row_off + kx, mask=kx < K, other=0.0)
    return xi.to(tl.float32)[:, None]


@triton.jit
def _nib4(q, FIELD: tl.constexpr):
    """4-bit field FIELD of int32 words -> fp32 1 + c/128 (even fields) or 1 + c/2048 (odd fields): a shared shift
    brings fields (0), (1, 2), (3, 4), (5, 6), (7) to bits 16-19 (even) / 12-15 (odd) and one LOP3 inserts the
    field into the mantissa of 1.0. So 8 fields take 4 shifts + 8 LOP3 (no I2F, no fp16 round trip)."""
    if FIELD == 0:
        src = q << 16
    elif FIELD <= 2:
        src = q << 8
    elif FIELD <= 4:
        src = q
    elif FIELD <= 6:
        src = q >> 8
    else:
        src = q >> 16
    MASK: tl.constexpr = 0x0000F000 if FIELD % 2 == 1 else 0x000F0000
    return ((src & MASK) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _accum(p, xa, xb, w, x, FIRST: tl.constexpr, ODD: tl.constexpr, ROWS2D: tl.constexpr):
    """Add one field's w [R, BN] * x [R, 1] to the group partials. xa / xb: sums of x over the group's even / odd
    fields (the zero correction; odd 4-bit fields decode to 1 + c/2048, so their x is scaled by 16 to give c x
    the even fields' weight 1/128). ROWS2D keeps [R, BN] partials (one FMA per weight, rows summed once per
    group), else the field's rows are summed at once (in-thread adds)."""
    xe = x * 16.0 if ODD else x
    if ROWS2D:
        d = w * xe
        dx = x
    else:
        d = tl.sum(w * xe, axis=0)
        dx = tl.sum(x, axis=0)
    if FIRST:
        p = d
        if ODD:
            xa = tl.zeros_like(dx)
            xb = dx
        else:
            xa = dx
            xb = tl.zeros_like(dx)
    else:
        p = p + d
        if ODD:
            xb = xb + dx
        else:
            xa = xa + dx
    return p, xa, xb


@triton.jit
def _group_add(acc, p, xa, xb, zero, s, ROWS2D: tl.constexpr, IS_INT: tl.constexpr, NIB4: tl.constexpr,
               BITS: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """acc + one scale group's [BN] result. Decoded ints are 1 + c/128 (even 4-bit fields), 1 + c/2048 (odd,
    against 16 x) or 1 + c/2^B (other widths), so sum (c - zero) x = 128 p - (128 + zero) xa - (2048 + zero) xb,
    resp. 2^B p - (2^B + zero) xa; minifloats need nothing here."""
    if ROWS2D:
        p = tl.sum(p, axis=0)
        xa = tl.sum(xa, axis=0)
        xb = tl.sum(xb, axis=0)
    if NIB4:
        p = p * 128.0 - (128.0 + zero) * xa - (2048.0 + zero) * xb
    elif IS_INT:
        p = p * (1 << BITS) - ((1 << BITS) + zero) * xa
    if PER_CHANNEL:
        return acc + p
    else:
        return acc + p * s


@triton.jit(do_not_specialize=["M", "split_k"])
def _stream_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_ym,
                   split_k,
                   BITS: tl.constexpr, EPW: tl.constexpr, IS_INT: tl.constexpr, EXP_BITS: tl.constexpr,
                   MAN_BITS: tl.constexpr, CODE_OFFSET: tl.constexpr, HAS_ZERO: tl.constexpr,
                   SCALE_KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, PER_CHANNEL: tl.constexpr,
                   HAS_GSCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                   EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, ROWS2D: tl.constexpr, PDL: tl.constexpr,
                   R: tl.constexpr):
    if PDL:  # programmatic dependent launch: the next kernel may start its prologue while this one runs
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    PB: tl.constexpr = R * EPW
    FPG: tl.constexpr = EPW if (PER_CHANNEL or GROUP_SIZE >= PB) else GROUP_SIZE // R  # fields per scale group
    BIAS: tl.constexpr = (1 << (EXP_BITS - 1)) - 1
    # minifloat fields decode to value * 2^(BIAS-127): the power of two is folded into the group scale
    SMUL: tl.constexpr = 1.0 if IS_INT else 2.0 ** (127 - BIAS)
    NIB4: tl.constexpr = IS_INT and BITS == 4
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, R)
    n_blocks = tl.cdiv(K, PB)
    per_split = tl.cdiv(n_blocks, split_k)
    b0 = pid_k * per_split
    b1 = tl.minimum(b0 + per_split, n_blocks)
    # rows of x beyond M read row M - 1 (always in range, no masks in the loop); their outputs are not stored
    m0 = pid_m * BLOCK_M
    r0 = tl.minimum(m0, M - 1) * stride_xm
    r1 = tl.minimum(m0 + 1, M - 1) * stride_xm
    r2 = tl.minimum(m0 + 2, M - 1) * stride_xm
    r3 = tl.minimum(m0 + 3, M - 1) * stride_xm
    acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    zero = tl.zeros((BLOCK_N,), dtype=tl.float32) + CODE_OFFSET
    q_ptrs = qw_ptr + offs_r[:, None] * N + offs_n[None, :]
    ok = n_mask & ((offs_n * 0 + b0) < b1)
    q_nxt = tl.load(q_ptrs + b0 * R * N, mask=ok[None, :], other=0)
    if PDL:  # the weights are constant: the first block is in flight before waiting for the kernel that wrote x
        gdc_wait()  # (and that may still use the split-K workspace)
    for b in tl.range(b0, b1, num_stages=1):
        if PREFETCH:  # the next block's words are in flight while this one is computed
            q = q_nxt
            okn = n_mask & ((offs_n * 0 + b + 1) < b1)
            q_nxt = tl.load(q_ptrs + (b + 1) * R * N, mask=okn[None, :], other=0)
        else:
            q = tl.load(q_ptrs + b * R * N, mask=n_mask[None, :], other=0)
        # placeholders: each scale group's first field starts the partials afresh (_accum with FIRST ignores them)
        p0, xa0, xb0, p1, xa1, xb1, p2, xa2, xb2, p3, xa3, xb3 = q, q, q, q, q, q, q, q, q, q, q, q
        for i in tl.static_range(EPW):
            g = (b * PB + (i - i % FPG) * R) // GROUP_SIZE
            if NIB4:
                w = _nib4(q, i)
            elif IS_INT:
                w = int_plane(q, i, BITS)  # 1 + c / 2^B by mantissa insertion
            else:
                w = _fp_bits(q, i, BITS, EXP_BITS, MAN_BITS)
            kx = b * PB + i * R + offs_r
            # i % FPG == 0: the first field of a scale group starts its partials; odd 4-bit fields pair with 16 x
            p0, xa0, xb0 = _accum(p0, xa0, xb0, w, _x_field(x_ptr, r0, kx, K, EVEN_K), i % FPG == 0,
                                  NIB4 and i % 2 == 1, ROWS2D)
            if BLOCK_M >= 2:
                p1, xa1, xb1 = _accum(p1, xa1, xb1, w, _x_field(x_ptr, r1, kx, K, EVEN_K), i % FPG == 0,
                                      NIB4 and i % 2 == 1, ROWS2D)
            if BLOCK_M >= 4:
                p2, xa2, xb2 = _accum(p2, xa2, xb2, w, _x_field(x_ptr, r2, kx, K, EVEN_K), i % FPG == 0,
                                      NIB4 and i % 2 == 1, ROWS2D)
                p3, xa3, xb3 = _accum(p3, xa3, xb3, w, _x_field(x_ptr, r3, kx, K, EVEN_K), i % FPG == 0,
                                      NIB4 and i % 2 == 1, ROWS2D)
            if (i + 1) % FPG == 0:  # end of a scale group: zero correction and scale once per column
                if HAS_ZERO:
                    zero = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)
                if PER_CHANNEL:
                    s = zero
                else:
                    s = decode_scale(tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0), SCALE_KIND)
                acc0 = _group_add(acc0, p0, xa0, xb0, zero, s, ROWS2D, IS_INT, NIB4, BITS, PER_CHANNEL)
                if BLOCK_M >= 2:
                    acc1 = _group_add(acc1, p1, xa1, xb1, zero, s, ROWS2D, IS_INT, NIB4, BITS, PER_CHANNEL)
                if BLOCK_M >= 4:
                    acc2 = _group_add(acc2, p2, xa2, xb2, zero, s, ROWS2D, IS_INT, NIB4, BITS, PER_CHANNEL)
                    acc3 = _group_add(acc3, p3, xa3, xb3, zero, s, ROWS2D, IS_INT, NIB4, BITS, PER_CHANNEL)
    # gather the BLOCK_M row accumulators into one [BLOCK_M, BLOCK_N] tile for the store / split-K reduction
    offs_m = m0 + tl.arange(0, BLOCK_M)
    sel = tl.arange(0, BLOCK_M)[:, None]
    acc = tl.where(sel == 0, acc0[None, :], 0.0)
    if BLOCK_M >= 2:
        acc = tl.where(sel == 1, acc1[None, :], acc)
    if BLOCK_M >= 4:
        acc = tl.where(sel == 2, acc2[None, :], acc)
        acc = tl.where(sel == 3, acc3[None, :], acc)
    acc = acc * SMUL
    if PER_CHANNEL:
        acc = acc * decode_scale(tl.load(s_ptr + offs_n, mask=n_mask, other=0), SCALE_KIND)[None, :]
    if HAS_GSCALE:
        acc = acc * tl.load(gs_ptr)
    _finish(acc, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, offs_m < M, n_mask, M, N, stride_ym,
            pid_m * tl.num_programs(0) + pid_n, pid_k, split_k, SPLIT)


def gemm_stream(x2: torch.Tensor, qw, cfg, fmt: dict) -> torch.Tensor:
    """x2 [M, K] contiguous (act-order already applied) -> y [M, N]; cfg.block_m (1, 2, 4) rows of x per program,
    cfg.num_stages: 2 = prefetch the next block's words into registers, 1 = no prefetch. The [R, BN] per-row
    partials (one FMA per weight, ROWS2D) are kept while they take <= 64 registers per thread; else each field's
    rows are summed at once (a multiply and an add per weight)."""
    m, k = x2.shape
    n = qw.shape[0]
    split = cfg.split_k
    bm = cfg.block_m
    if bm not in (1, 2, 4):
        raise ValueError(f"stream kernel takes block_m 1, 2 or 4, got {bm}")
    y = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    z = qw.zeros if qw.zeros is not None else qw.scales
    gsc = qw.global_scale if qw.global_scale is not None else qw.scales
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, bm), split)
    if split > 1:
        ws, cnt = _workspace(x2.device, split * m * n, grid[0] * grid[1])
    else:
        ws, cnt = y, y  # unused
    pdl = _small.use_pdl(x2.device)
    _stream_kernel[grid](x2, qw.qweight, qw.scales, z, gsc, y, ws, cnt, m, n, k, x2.stride(0), y.stride(0), split,
                         BLOCK_M=bm, BLOCK_N=cfg.block_n, SPLIT=split > 1,
                         EVEN_K=k % (fmt["R"] * fmt["EPW"]) == 0, PREFETCH=cfg.num_stages >= 2,
                         ROWS2D=bm * fmt["R"] * cfg.block_n <= 64 * 32 * cfg.num_warps, PDL=pdl, launch_pdl=pdl,
                         num_warps=cfg.num_warps, num_stages=1, **fmt)
    return y
