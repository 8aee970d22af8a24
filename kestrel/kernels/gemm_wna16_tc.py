"""Tensor-core WNA16 GEMM for M > 16 ("tc" kernel): one wide tl.dot per K step so Triton emits wgmma on Hopper.

Per K step the kernel loads KB planar word tiles (packing.py: block b = word rows b*R .. b*R+R-1, field i of row r
holds k = b*R*EPW + i*R + r), decodes them with broadcast per-field shifts into [KB, R, EPW, BN], permutes to
[KB, EPW, R, BN] (that is k order) and reshapes to one [BK, BN] tile, group scale/zero applied in the tile, then one
dot with K = BK against x[BM, BK]. LAYOUT=1 instead gathers each k row's word (simple, more loads) as a fallback.
SWAP computes y^T = W^T x^T so the decoded weight is the wgmma A operand and a small M is the wgmma N (>= 8).

Decode (fp32, then one rounding to the activation dtype):
- ints: the field rotated into the fp32 mantissa top gives v = 1 + c/2^B exactly; (c - z) s = v*(2^B s) - (2^B+z) s,
  one FFMA with per-column/group coefficients.
- minifloats: exponent/mantissa/sign bits moved into fp32 (value * 2^(bias-127)); the 2^(127-bias) factor is folded
  into the scale together with 2^-TILE_EXP (bf16 only: its fp32 range holds the shrunk tile), and the accumulator
  gets 2^TILE_EXP back, so fp32 never overflows for large block scales (e8m0 / e4m3 NVFP4 scales).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.configs import ComputeConfig
from kestrel.kernels.dequant import decode_scale
from kestrel.quant.weight import QuantizedWeight


@triton.jit
def _rotl(u, sh):
    """Rotate uint32 u left by sh (0..31, tensor or scalar); LLVM turns the idiom into one funnel shift."""
    return (u << sh) | (u >> ((32 - sh) & 31))


@triton.jit
def _coeffs(s_ptr, z_ptr, g, mask, offs_n, N, BITS: tl.constexpr, IS_INT: tl.constexpr, EXP_BITS: tl.constexpr,
            HAS_ZERO: tl.constexpr, CODE_OFFSET: tl.constexpr, SCALE_KIND: tl.constexpr, SCALED: tl.constexpr,
            TILE_EXP: tl.constexpr):
    """Per (group row g, column) decode coefficients: ints -> (2^B s, (2^B + z) s); floats -> (s * 2^(127-bias-T), 0).
    SCALED=False (per-channel: the scale goes on the accumulator) uses s = 1."""
    off = g * N + offs_n
    if SCALED:
        s = decode_scale(tl.load(s_ptr + off, mask=mask, other=0), SCALE_KIND)
    else:
        s = tl.zeros(off.shape, dtype=tl.float32) + 1.0
    if IS_INT:
        if HAS_ZERO:
            z = tl.load(z_ptr + off, mask=mask, other=0).to(tl.float32)
        else:
            z = CODE_OFFSET * 1.0
        a = s * (1 << BITS) * 1.0
        b = ((1 << BITS) + z) * s
    else:
        BIAS: tl.constexpr = (1 << (EXP_BITS - 1)) - 1
        if TILE_EXP:
            a = s * (2.0 ** (127 - BIAS - TILE_EXP))
        else:  # fp16 tile: no shrink, so the 2^(127-bias) factor stays in _decode (a large s would overflow fp32)
            a = s
        b = a * 0.0
    return a, b


@triton.jit
def _decode(q, f, a, b, BITS: tl.constexpr, IS_INT: tl.constexpr, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr,
            TILE_EXP: tl.constexpr):
    """Words q (int32) and field indices f (broadcastable) -> scaled fp32 weights."""
    u = q.to(tl.uint32, bitcast=True)
    lo = (f * BITS).to(tl.uint32)
    if IS_INT:
        mant = _rotl(u, (23 - BITS - lo) & 31) & (((1 << BITS) - 1) << (23 - BITS))
        v = (mant | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + c / 2^BITS
        return v * a - b
    else:
        mag = _rotl(u, (23 - MAN_BITS - lo) & 31) & (((1 << (EXP_BITS + MAN_BITS)) - 1) << (23 - MAN_BITS))
        sign = _rotl(u, (31 - EXP_BITS - MAN_BITS - lo) & 31) & 0x80000000
        v = (mag | sign).to(tl.float32, bitcast=True)
        if TILE_EXP == 0:
            BIAS: tl.constexpr = (1 << (EXP_BITS - 1)) - 1
            v = v * (2.0 ** (127 - BIAS))
        return v * a


@triton.jit
def _tc_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, gs_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
               BITS: tl.constexpr, EPW: tl.constexpr, IS_INT: tl.constexpr, EXP_BITS: tl.constexpr,
               MAN_BITS: tl.constexpr, CODE_OFFSET: tl.constexpr, HAS_ZERO: tl.constexpr,
               SCALE_KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, PER_CHANNEL: tl.constexpr,
               HAS_GSCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr,
               SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr, GROUP_M: tl.constexpr, SWAP: tl.constexpr,
               LAYOUT: tl.constexpr, TILE_EXP: tl.constexpr, DOT_F32: tl.constexpr, R: tl.constexpr):
    PB: tl.constexpr = R * EPW
    BK: tl.constexpr = KB * PB
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # grouped ordering: GROUP_M row tiles walk the N tiles together, so each decoded W tile's words stay in L2
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    n_blocks = tl.cdiv(K, PB)  # packed K is padded to whole planar blocks; x is masked to K
    n_steps = tl.cdiv(n_blocks, KB)
    per_split = tl.cdiv(n_steps, SPLIT_K)
    s0 = pid_k * per_split
    s1 = tl.minimum(s0 + per_split, n_steps)
    SCALED: tl.constexpr = not PER_CHANNEL
    if PER_CHANNEL:  # coefficients are constant over K
        a_pc, b_pc = _coeffs(s_ptr, z_ptr, 0, n_mask, offs_n, N, BITS, IS_INT, EXP_BITS, HAS_ZERO, CODE_OFFSET,
                             SCALE_KIND, False, TILE_EXP)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in tl.range(s0, s1, num_stages=NUM_STAGES):
        kx = step * BK + tl.arange(0, BK)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kx[None, :],
                    mask=m_mask[:, None] & (kx < K)[None, :], other=0.0)
        if LAYOUT == 0:
            blk = step * KB + tl.arange(0, KB)  # [KB]
            bmask = blk < n_blocks
            rows = blk[:, None] * R + tl.arange(0, R)[None, :]  # [KB, R]
            q = tl.load(qw_ptr + rows[:, :, None] * N + offs_n[None, None, :],
                        mask=bmask[:, None, None] & n_mask[None, None, :], other=0)
            f = tl.arange(0, EPW)[None, None, :, None]  # [1, 1, EPW, 1]
            cmask = bmask[:, None, None, None] & n_mask[None, None, None, :]
            if PER_CHANNEL:
                a = a_pc[None, None, None, :]
                b = b_pc[None, None, None, :]
            elif GROUP_SIZE >= PB:  # one group per planar block
                g = (blk * PB // GROUP_SIZE)[:, None, None, None]
                a, b = _coeffs(s_ptr, z_ptr, g, cmask, offs_n[None, None, None, :], N, BITS, IS_INT, EXP_BITS,
                               HAS_ZERO, CODE_OFFSET, SCALE_KIND, True, TILE_EXP)
            else:  # several groups per block: one per field or per run of fields
                g = (blk[:, None, None, None] * PB + f * R) // GROUP_SIZE
                a, b = _coeffs(s_ptr, z_ptr, g, cmask, offs_n[None, None, None, :], N, BITS, IS_INT, EXP_BITS,
                               HAS_ZERO, CODE_OFFSET, SCALE_KIND, True, TILE_EXP)
            w = _decode(q[:, :, None, :], f, a, b, BITS, IS_INT, EXP_BITS, MAN_BITS, TILE_EXP)  # [KB, R, EPW, BN]
            w = tl.reshape(tl.permute(w, (0, 2, 1, 3)), (BK, BLOCK_N))  # row = kb*PB + i*R + r = k - step*BK
        else:
            k = step * BK + tl.arange(0, BK)
            kmask = (k < n_blocks * PB)[:, None] & n_mask[None, :]
            wrow = (k // PB) * R + (k % R)
            q = tl.load(qw_ptr + wrow[:, None] * N + offs_n[None, :], mask=kmask, other=0)
            f = ((k % PB) // R)[:, None]
            if PER_CHANNEL:
                a = a_pc[None, :]
                b = b_pc[None, :]
            else:
                g = (k // GROUP_SIZE)[:, None]
                a, b = _coeffs(s_ptr, z_ptr, g, kmask, offs_n[None, :], N, BITS, IS_INT, EXP_BITS, HAS_ZERO,
                               CODE_OFFSET, SCALE_KIND, True, TILE_EXP)
            w = _decode(q, f, a, b, BITS, IS_INT, EXP_BITS, MAN_BITS, TILE_EXP)
        w = w.to(x_ptr.dtype.element_ty)
        if DOT_F32:  # the CPU interpreter's bf16 dot is wrong; fp32 operands hold the same rounded values
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        if SWAP:
            acc = tl.dot(tl.trans(w), tl.trans(x), acc)
        else:
            acc = tl.dot(x, w, acc)
    if SWAP:
        acc = tl.trans(acc)
    post = 1.0
    if not IS_INT:
        post = 2.0 ** TILE_EXP
    if HAS_GSCALE:
        post = post * tl.load(gs_ptr)
    if PER_CHANNEL:
        acc = acc * (decode_scale(tl.load(s_ptr + offs_n, mask=n_mask, other=0), SCALE_KIND) * post)[None, :]
    elif HAS_GSCALE or not IS_INT:
        acc = acc * post
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask)


LAST_LAUNCH: dict = {}  # the last compiled kernel, for benches that inspect PTX / registers


def gemm_wna16_tc(x2: torch.Tensor, qw: QuantizedWeight, cfg: ComputeConfig, fmt: dict,
                  swap: bool | None = None, layout: int = 0, group_m: int = 8) -> torch.Tensor:
    """x2 [M, K] contiguous (already permuted for act-order) -> y [M, N] in x2's dtype. `fmt` is the format
    constexpr dict of gemm_wna16. cfg.block_k is the K step in planar blocks' elements (0 = one block).
    SWAP (W as the wgmma A operand) defaults to block_m < 64, where a wgmma M of 64 would idle rows."""
    m, _ = x2.shape
    n, k = qw.shape
    pb = fmt["R"] * fmt["EPW"]
    kb = max(1, cfg.block_k // pb)
    swap = cfg.block_m < 64 if swap is None else swap
    split = cfg.split_k
    y = (torch.zeros if split > 1 else torch.empty)((m, n), device=x2.device,
                                                       dtype=torch.float32 if split > 1 else x2.dtype)
    z = qw.zeros if qw.zeros is not None else qw.scales
    gsc = qw.global_scale if qw.global_scale is not None else qw.scales
    tile_exp = 64 if (x2.dtype == torch.bfloat16 and not fmt["IS_INT"]) else 0
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    LAST_LAUNCH["kernel"] = _tc_kernel[grid](x2, qw.qweight, qw.scales, z, gsc, y, m, n, k, x2.stride(0),
                                             y.stride(0), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, KB=kb,
                                             SPLIT_K=split, NUM_STAGES=cfg.num_stages,
                                             GROUP_M=group_m, SWAP=swap, LAYOUT=layout, TILE_EXP=tile_exp,
                                             DOT_F32=x2.device.type != "cuda", num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages, **fmt)
    return y.to(x2.dtype) if split > 1 else y
