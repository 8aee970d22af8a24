"""Tensor-core WNA16 GEMM for M > 16 ("tc" kernel): one wide tl.dot per K step so Triton emits wgmma on Hopper.

Per K step the kernel loads KB planar word tiles (packing.py: block b = word rows b*R .. b*R+R-1, field i of row r
holds k = b*R*EPW + i*R + r) as [KB, R, 1, BN] (the decode keeps the coalesced load layout: consecutive n per
thread, so the decoded tile goes to shared memory in vector stores), broadcasts over the EPW fields, permutes to
[KB, EPW, R, BN] (k order) and reshapes to one [BK, BN] tile with the group scale/zero applied, then one dot with
K = BK against x[BM, BK]. LAYOUT=1 instead gathers each k row's word (simple, more loads). SWAP computes
y^T = W^T x^T (decoded W as the wgmma A operand). Grouped tile order for L2 reuse; split-K by fp32 atomics.

Decode:
- DEC 1/2 (GPU, symmetric int4 and bf16 fp4 e2m1): inline PTX on register pairs, bf16x2/f16x2 math, no fp32 round
  trip (_decode_int4_x2 / _decode_fp4_x2); DEC 2 shares one byte permute + shift per pair (needs the pair to lie in
  one field: only on tiles whose compiled layout guarantees it, see gemm_wna16_tc and bench/wna16_tc_sass.py).
- DEC 0 (every format, and the CPU interpreter), in fp32 then one rounding: ints: the field rotated into the fp32
  mantissa top gives v = 1 + c/2^B exactly, (c - z) s = v*(2^B s) - (2^B+z) s in one FFMA; minifloats: their bits
  moved into fp32 (value * 2^(bias-127)), the 2^(127-bias) factor folded into the scale with 2^-TILE_EXP (bf16
  only: its fp32 range holds the shrunk tile) and 2^TILE_EXP put back on the accumulator, so no fp32 overflow for
  large block scales (e8m0 / e4m3 NVFP4).
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
    """Rotate uint32 u left by sh (0..31). The field index sits in registers, so sh folds to a constant per
    register and the compiler emits one plain shift (seen in the sm_90 SASS)."""
    return (u << sh) | (u >> ((32 - sh) & 31))


@triton.jit
def _coeffs(s_ptr, z_ptr, g, mask, offs_n, N, BITS: tl.constexpr, IS_INT: tl.constexpr, EXP_BITS: tl.constexpr,
            HAS_ZERO: tl.constexpr, CODE_OFFSET: tl.constexpr, SCALE_KIND: tl.constexpr, SCALED: tl.constexpr,
            TILE_EXP: tl.constexpr):
    """Per (group row g, column) decode coefficients: ints -> (2^B s, (2^B + z) s); floats -> (s * 2^(127-bias-T), 0).
    SCALED=False (per-channel: the scale goes on the accumulator) uses s = 1."""
    off = g * N + offs_n
    if SCALED:
        if mask is None:
            s = decode_scale(tl.load(s_ptr + off), SCALE_KIND)
        else:
            s = decode_scale(tl.load(s_ptr + off, mask=mask, other=0), SCALE_KIND)
    else:
        s = tl.zeros(off.shape, dtype=tl.float32) + 1.0
    if IS_INT:
        if HAS_ZERO:
            if mask is None:
                z = tl.load(z_ptr + off).to(tl.float32)
            else:
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


def _asm_int4(shared: bool, fp16: bool) -> tl.constexpr:
    """PTX for two int4 codes -> (c - z) * s as one bf16x2/f16x2 register (operands: see _decode_int4_x2)."""
    if shared:
        body = "prmt.b32 t, $1, $2, $3; shr.u32 t, t, $5; "
        zs = "$7", "$8"
    else:
        body = "shr.u32 a, $1, $3; shr.u32 b, $2, $4; prmt.b32 t, a, b, 0x5410; "
        zs = "$5", "$6"
    magic, ty = ("0x64006400", "f16x2") if fp16 else ("0x43004300", "bf16x2")
    return tl.constexpr("{ .reg .b32 a, b, t; " + body + f"lop3.b32 t, t, 0x000F000F, {magic}, 0xEA; "
                        f"sub.rn.{ty} t, t, {zs[0]}; mul.rn.{ty} $0, t, {zs[1]}; }}")


_ASM_SH_BF16 = _asm_int4(True, False)
_ASM_SH_F16 = _asm_int4(True, True)
_ASM_BF16 = _asm_int4(False, False)
_ASM_F16 = _asm_int4(False, True)


@triton.jit
def _decode_int4_x2(q, f, s, zb, SHARED: tl.constexpr, DT: tl.constexpr):
    """Symmetric int4 fields -> (c - offset) * s in the activation dtype, two elements per PTX block (packed
    bf16x2/f16x2 math, no fp32 round trip): codes are OR-ed under the exponent of 128 (bf16) / 1024 (fp16), so
    the subtraction of (magic + offset) is exact and the scale multiply rounds once. SHARED assumes the two
    elements of a pair (adjacent registers) share a field: one byte permute then one shift; the host enables it
    only on tiles whose compiled layout pairs along n or r (bench/wna16_tc_sass.py --pairs)."""
    if SHARED:
        j = f // 2
        sel = tl.broadcast_to(j | ((j + 4) << 8), q.shape)
        sh = tl.broadcast_to((f % 2) * 4, q.shape)
        if DT == tl.float16:
            return tl.inline_asm_elementwise(_ASM_SH_F16, "=r,r,r,r,r,r,r,r,r", [q, sel, sh, zb, s], dtype=zb.dtype,
                                             is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(_ASM_SH_BF16, "=r,r,r,r,r,r,r,r,r", [q, sel, sh, zb, s], dtype=zb.dtype,
                                             is_pure=True, pack=2)
    else:
        sh = tl.broadcast_to(f * 4, q.shape)
        if DT == tl.float16:
            return tl.inline_asm_elementwise(_ASM_F16, "=r,r,r,r,r,r,r", [q, sh, zb, s], dtype=zb.dtype, is_pure=True,
                                             pack=2)
        else:
            return tl.inline_asm_elementwise(_ASM_BF16, "=r,r,r,r,r,r,r", [q, sh, zb, s], dtype=zb.dtype,
                                             is_pure=True, pack=2)


def _asm_fp4(shared: bool) -> tl.constexpr:
    """PTX for two e2m1 codes -> bf16x2 of value * 2^-126 (sign to bit 15, exponent/mantissa to bits 8..6; an
    e2m1 subnormal lands on a bf16 subnormal, exact) times the pre-scaled scale pair."""
    body = ("prmt.b32 t, $1, $2, $3; shr.u32 t, t, $5; " if shared else
            "shr.u32 a, $1, $3; shr.u32 b, $2, $4; prmt.b32 t, a, b, 0x5410; ")
    return tl.constexpr("{ .reg .b32 a, b, t, u; " + body + "shl.b32 u, t, 6; shl.b32 t, t, 12; "
                        "and.b32 u, u, 0x01C001C0; and.b32 t, t, 0x80008000; or.b32 t, t, u; "
                        "mul.rn.bf16x2 $0, t, " + ("$7" if shared else "$5") + "; }")


_ASM_FP4_SH = _asm_fp4(True)
_ASM_FP4 = _asm_fp4(False)


@triton.jit
def _decode_fp4_x2(q, f, s, SHARED: tl.constexpr):
    """fp4 e2m1 fields -> bf16 value * s (s already carries 2^126), two elements per PTX block."""
    if SHARED:
        j = f // 2
        sel = tl.broadcast_to(j | ((j + 4) << 8), q.shape)
        sh = tl.broadcast_to((f % 2) * 4, q.shape)
        return tl.inline_asm_elementwise(_ASM_FP4_SH, "=r,r,r,r,r,r,r,r", [q, sel, sh, s], dtype=s.dtype,
                                         is_pure=True, pack=2)
    else:
        sh = tl.broadcast_to(f * 4, q.shape)
        return tl.inline_asm_elementwise(_ASM_FP4, "=r,r,r,r,r,r", [q, sh, s], dtype=s.dtype, is_pure=True,
                                         pack=2)


@triton.jit
def _w_tile(qw_ptr, s_ptr, z_ptr, step, n_blocks, offs_n, n_mask, N, a_pc, b_pc,
            BITS: tl.constexpr, EPW: tl.constexpr, IS_INT: tl.constexpr, EXP_BITS: tl.constexpr,
            MAN_BITS: tl.constexpr, CODE_OFFSET: tl.constexpr, HAS_ZERO: tl.constexpr, SCALE_KIND: tl.constexpr,
            GROUP_SIZE: tl.constexpr, PER_CHANNEL: tl.constexpr, KB: tl.constexpr, BLOCK_N: tl.constexpr,
            LAYOUT: tl.constexpr, EVEN_K: tl.constexpr, TILE_EXP: tl.constexpr, R: tl.constexpr,
            DEC: tl.constexpr = 0, DT: tl.constexpr = tl.bfloat16):
    """W^T tile [BK, BN] in the activation dtype DT of K step `step` (row j = input channel step*BK + j), decoded in
    fp32 (DEC 0) or with packed int4 asm (DEC 1/2). offs_n are already clamped when N is ragged."""
    PB: tl.constexpr = R * EPW
    BK: tl.constexpr = KB * PB
    if LAYOUT == 0:
        blk = step * KB + tl.arange(0, KB)  # [KB]
        rows = blk[:, None] * R + tl.arange(0, R)[None, :]  # [KB, R]
        # loaded as [KB, R, 1, BN] so the decode keeps the load's layout (consecutive n per thread: vector
        # stores of the bf16 tile); the broadcast over fields stays in registers
        ptrs = qw_ptr + rows[:, :, None, None] * N + offs_n[None, None, None, :]
        if EVEN_K:
            q = tl.load(ptrs)
            cmask = None
        else:
            cmask = (blk < n_blocks)[:, None, None, None] & n_mask[None, None, None, :]
            q = tl.load(ptrs, mask=cmask, other=0)
        f = tl.arange(0, EPW)[None, None, :, None]  # [1, 1, EPW, 1]
        if DEC:  # packed asm decode: symmetric int4 or fp4 e2m1, grouped scales (host checks)
            if GROUP_SIZE >= PB:
                g = (blk * PB // GROUP_SIZE)[:, None, None, None]
            else:
                g = (blk[:, None, None, None] * PB + f * R) // GROUP_SIZE
            sp = s_ptr + g * N + offs_n[None, None, None, :]
            if cmask is None:
                sc = tl.load(sp)
            else:
                sc = tl.load(sp, mask=cmask, other=0)
            sc = decode_scale(sc, SCALE_KIND)
            qf = tl.broadcast_to(q, (KB, R, EPW, BLOCK_N))
            if IS_INT:
                sc = tl.broadcast_to(sc.to(DT), (KB, R, EPW, BLOCK_N))
                magic: tl.constexpr = 1024 if DT == tl.float16 else 128
                zb = tl.full((KB, R, EPW, BLOCK_N), magic + CODE_OFFSET, DT)
                w = _decode_int4_x2(qf, f, sc, zb, DEC == 2, DT)
            else:  # e2m1 bits under the bf16 exponent: value * 2^-126, folded into the scale with 2^-TILE_EXP
                sc = tl.broadcast_to((sc * (2.0 ** (126 - TILE_EXP))).to(DT), (KB, R, EPW, BLOCK_N))
                w = _decode_fp4_x2(qf, f, sc, DEC == 2)
            return tl.reshape(tl.permute(w, (0, 2, 1, 3)), (BK, BLOCK_N))
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
        w = _decode(q, f, a, b, BITS, IS_INT, EXP_BITS, MAN_BITS, TILE_EXP).to(DT)  # [KB, R, EPW, BN]
        return tl.reshape(tl.permute(w, (0, 2, 1, 3)), (BK, BLOCK_N))  # row = kb*PB + i*R + r
    else:
        k = step * BK + tl.arange(0, BK)
        wrow = (k // PB) * R + (k % R)
        if EVEN_K:
            kmask = None
            q = tl.load(qw_ptr + wrow[:, None] * N + offs_n[None, :])
        else:
            kmask = (k < n_blocks * PB)[:, None] & n_mask[None, :]
            q = tl.load(qw_ptr + wrow[:, None] * N + offs_n[None, :], mask=kmask, other=0)
        f = ((k % PB) // R)[:, None]
        if PER_CHANNEL:
            a = a_pc[None, :]
            b = b_pc[None, :]
        else:
            g = (k // GROUP_SIZE)[:, None]
            a, b = _coeffs(s_ptr, z_ptr, g, kmask, offs_n[None, :], N, BITS, IS_INT, EXP_BITS, HAS_ZERO,
                           CODE_OFFSET, SCALE_KIND, True, TILE_EXP)
        return _decode(q, f, a, b, BITS, IS_INT, EXP_BITS, MAN_BITS, TILE_EXP).to(DT)


@triton.jit
def _epilogue(acc, y_ptr, s_ptr, gs_ptr, offs_m, offs_n, offs_n_ld, M, N, stride_ym, IS_INT: tl.constexpr,
              SCALE_KIND: tl.constexpr, PER_CHANNEL: tl.constexpr, HAS_GSCALE: tl.constexpr,
              TILE_EXP: tl.constexpr, SPLIT: tl.constexpr, REDUCE: tl.constexpr = 0, ws_ptr=None, cnt_ptr=None,
              slab=0, n_slabs=1, pid_k=0, ATOMIC_SEM: tl.constexpr = "relaxed", split_k=1):
    """REDUCE 1 (split-K): each split stores its fp32 partial in its own workspace slab, then takes a ticket on
    the tile's counter; the split that comes last sums the slabs, stores y in its dtype and resets the counter for
    the next call. No zeroed fp32 y, no atomics on y, no cast kernel: one launch instead of three."""
    post = 1.0
    if not IS_INT:
        post = 2.0 ** TILE_EXP
    if HAS_GSCALE:
        post = post * tl.load(gs_ptr)
    if PER_CHANNEL:
        acc = acc * (decode_scale(tl.load(s_ptr + offs_n_ld), SCALE_KIND) * post)[None, :]
    elif HAS_GSCALE or not IS_INT:
        acc = acc * post
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if not SPLIT:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    elif REDUCE == 0:  # relaxed: the order of the partial sums is free; tl.atomic_add's default acq_rel put a
        # MEMBAR.ALL.GPU beside each of the 8 vector atomics per thread (sm_90 SASS, 64x128 tile, Triton 3.6)
        tl.atomic_add(y_ptrs, acc, mask=mask, sem=ATOMIC_SEM)
    else:
        BM: tl.constexpr = acc.shape[0]
        BN: tl.constexpr = acc.shape[1]
        rows = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        tl.store(ws_ptr + (pid_k * n_slabs + slab) * (BM * BN) + rows, acc)
        tl.debug_barrier()  # every thread's partial is written before the ticket (acq_rel) is taken
        ticket = tl.atomic_add(cnt_ptr + slab, 1, sem="acq_rel")
        if ticket == split_k - 1:
            tot = tl.zeros((BM, BN), dtype=tl.float32)
            for j in range(split_k):  # .cg: the other splits' partials were written through other SMs' L1s
                tot += tl.load(ws_ptr + (j * n_slabs + slab) * (BM * BN) + rows, cache_modifier=".cg")
            tl.store(y_ptrs, tot.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + slab, 0)


@triton.jit
def _tc_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, gs_ptr, y_ptr, M, N, K, stride_xm, stride_ym, split_k,
               BITS: tl.constexpr, EPW: tl.constexpr, IS_INT: tl.constexpr, EXP_BITS: tl.constexpr,
               MAN_BITS: tl.constexpr, CODE_OFFSET: tl.constexpr, HAS_ZERO: tl.constexpr,
               SCALE_KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, PER_CHANNEL: tl.constexpr,
               HAS_GSCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr,
               SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr, GROUP_M: tl.constexpr, SWAP: tl.constexpr,
               LAYOUT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, NH: tl.constexpr,
               DEC: tl.constexpr, TILE_EXP: tl.constexpr, DOT_F32: tl.constexpr, R: tl.constexpr,
               ws_ptr=None, cnt_ptr=None, REDUCE: tl.constexpr = 0, ATOMIC_SEM: tl.constexpr = "relaxed"):
    """NH = 2 runs a BLOCK_N tile as two halves (two decodes, two dots, two accumulators) sharing each x tile:
    half the x traffic of two CTAs, while each half keeps the 128-wide layout (vector stores, paired decode)."""
    PB: tl.constexpr = R * EPW
    BK: tl.constexpr = KB * PB
    HN: tl.constexpr = BLOCK_N // NH
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # grouped ordering: GROUP_M row tiles walk the N tiles together, so each decoded W tile's words stay in L2
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tl.swizzle2d(pid // num_pid_n, pid % num_pid_n, num_pid_m, num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, HN)  # first half; the second is offs_n + HN
    # x loads use clamped rows instead of masks (fewer predicates in the loop; the store is masked); W columns
    # are clamped only when N is ragged (tl.minimum would hide their contiguity from the vectoriser)
    offs_m_ld = tl.minimum(offs_m, M - 1)
    if EVEN_N:
        offs_n_ld = offs_n
        offs_n_ld2 = offs_n + HN
    else:
        offs_n_ld = tl.minimum(offs_n, N - 1)
        offs_n_ld2 = tl.minimum(offs_n + HN, N - 1)
    n_mask = offs_n < N
    n_mask2 = offs_n + HN < N
    n_blocks = tl.cdiv(K, PB)  # packed K is padded to whole planar blocks; x is masked to K
    n_steps = tl.cdiv(n_blocks, KB)
    per_split = tl.cdiv(n_steps, split_k)
    s0 = pid_k * per_split
    s1 = tl.minimum(s0 + per_split, n_steps)
    a_pc = None
    b_pc = None
    a_pc2 = None
    b_pc2 = None
    if PER_CHANNEL:  # coefficients are constant over K
        a_pc, b_pc = _coeffs(s_ptr, z_ptr, 0, None, offs_n_ld, N, BITS, IS_INT, EXP_BITS, HAS_ZERO, CODE_OFFSET,
                             SCALE_KIND, False, TILE_EXP)
        if NH == 2:
            a_pc2, b_pc2 = _coeffs(s_ptr, z_ptr, 0, None, offs_n_ld2, N, BITS, IS_INT, EXP_BITS, HAS_ZERO,
                                   CODE_OFFSET, SCALE_KIND, False, TILE_EXP)
    if SWAP:
        acc = tl.zeros((HN, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, HN), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, HN), dtype=tl.float32)
    for step in tl.range(s0, s1, num_stages=NUM_STAGES):
        kx = step * BK + tl.arange(0, BK)
        x_ptrs = x_ptr + offs_m_ld[:, None] * stride_xm + kx[None, :]
        if EVEN_K:
            x = tl.load(x_ptrs)
        else:
            x = tl.load(x_ptrs, mask=(kx < K)[None, :], other=0.0)
        if DOT_F32:  # the CPU interpreter's bf16 dot is wrong; fp32 operands hold the same rounded values
            x = x.to(tl.float32)
        # decode + MMA serialise inside a CTA (Triton waits on the wgmma right away); two CTAs per SM overlap them
        w = _w_tile(qw_ptr, s_ptr, z_ptr, step, n_blocks, offs_n_ld, n_mask, N, a_pc, b_pc, BITS, EPW, IS_INT,
                    EXP_BITS, MAN_BITS, CODE_OFFSET, HAS_ZERO, SCALE_KIND, GROUP_SIZE, PER_CHANNEL, KB, HN, LAYOUT,
                    EVEN_K, TILE_EXP, R, DEC, x_ptr.dtype.element_ty)
        if DOT_F32:
            w = w.to(tl.float32)
        if SWAP:
            acc = tl.dot(tl.trans(w), tl.trans(x), acc)
        else:
            acc = tl.dot(x, w, acc)
        if NH == 2:
            w2 = _w_tile(qw_ptr, s_ptr, z_ptr, step, n_blocks, offs_n_ld2, n_mask2, N, a_pc2, b_pc2, BITS, EPW,
                         IS_INT, EXP_BITS, MAN_BITS, CODE_OFFSET, HAS_ZERO, SCALE_KIND, GROUP_SIZE, PER_CHANNEL, KB,
                         HN, LAYOUT, EVEN_K, TILE_EXP, R, DEC, x_ptr.dtype.element_ty)
            if DOT_F32:
                w2 = w2.to(tl.float32)
            acc2 = tl.dot(x, w2, acc2)
    if SWAP:
        acc = tl.trans(acc)
    n_slabs = num_pid_m * num_pid_n * NH  # REDUCE 1: one workspace slab + counter per (tile, half)
    _epilogue(acc, y_ptr, s_ptr, gs_ptr, offs_m, offs_n, offs_n_ld, M, N, stride_ym, IS_INT, SCALE_KIND,
              PER_CHANNEL, HAS_GSCALE, TILE_EXP, SPLIT, REDUCE, ws_ptr, cnt_ptr, pid * NH, n_slabs, pid_k,
              ATOMIC_SEM, split_k)
    if NH == 2:
        _epilogue(acc2, y_ptr, s_ptr, gs_ptr, offs_m, offs_n + HN, offs_n_ld2, M, N, stride_ym, IS_INT,
                  SCALE_KIND, PER_CHANNEL, HAS_GSCALE, TILE_EXP, SPLIT, REDUCE, ws_ptr, cnt_ptr, pid * NH + 1,
                  n_slabs, pid_k, ATOMIC_SEM, split_k)


LAST_LAUNCH: dict = {}  # the last compiled kernel, for benches that inspect PTX / registers


def gemm_wna16_tc(x2: torch.Tensor, qw: QuantizedWeight, cfg: ComputeConfig, fmt: dict,
                  swap: bool | None = None, layout: int = 0, dec: int | None = None,
                  group_m: int = 8, atomic_sem: str = "relaxed") -> torch.Tensor:
    """x2 [M, K] contiguous (already permuted for act-order) -> y [M, N] in x2's dtype. `fmt` is the format
    constexpr dict of gemm_wna16. cfg.block_k is the K step in planar blocks' elements (0 = one block).
    swap (W as the wgmma A operand, x^T as B) defaults to cfg.swap. atomic_sem: memory order of the split-K
    atomics (reduce 0); "acq_rel" (Triton's default, the kernel before 2026-12-03 #3) only for A/B benches."""
    m, _ = x2.shape
    n, k = qw.shape
    pb = fmt["R"] * fmt["EPW"]
    kb = max(1, cfg.block_k // pb)
    swap = cfg.swap if swap is None else swap
    split = cfg.split_k
    reduce = int(split > 1 and cfg.reduce)
    y = (torch.zeros if split > 1 and not reduce else torch.empty)(
        (m, n), device=x2.device, dtype=torch.float32 if split > 1 and not reduce else x2.dtype)
    z = qw.zeros if qw.zeros is not None else qw.scales
    gsc = qw.global_scale if qw.global_scale is not None else qw.scales
    # 256-wide tiles (not swapped) run as two 128-wide halves: a single 256-wide decode loses the vector layout
    nh = 2 if (cfg.block_n == 256 and not swap and layout == 0) else 1
    # packed-asm decode: GPU only (the interpreter runs no PTX), symmetric int4 or (bf16) fp4 e2m1 with grouped
    # scales. dec 2 assumes the two registers of a pair share a field; bench/wna16_tc_sass.py (and a test) read
    # that off the compiled layout: it holds for 8-warp 128-wide tiles, one planar block per step, even N; it
    # does not for e.g. 4-warp or 256-wide tiles, which use the robust dec 1
    int4 = fmt["IS_INT"] and fmt["BITS"] == 4 and not fmt["HAS_ZERO"]
    fp4 = (not fmt["IS_INT"] and (fmt["EXP_BITS"], fmt["MAN_BITS"]) == (2, 1) and x2.dtype == torch.bfloat16)
    if not (x2.device.type == "cuda" and layout == 0 and (int4 or fp4) and not fmt["PER_CHANNEL"]):
        dec = 0
    elif dec is None:
        dec = 2 if (cfg.block_n // nh == 128 and cfg.num_warps == 8 and kb == 1 and n % 128 == 0) else 1
    tile_exp = 64 if (x2.dtype == torch.bfloat16 and not fmt["IS_INT"]) else 0
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), split)
    ws = cnt = None
    if reduce:
        ws = torch.empty(split * grid[0] * cfg.block_m * cfg.block_n, device=x2.device, dtype=torch.float32)
        cnt = _split_counters(x2.device, grid[0] * nh)
    # split_k is a runtime value (SPLIT: split_k > 1 picks the epilogue): one compile for every split > 1
    LAST_LAUNCH["kernel"] = _tc_kernel[grid](x2, qw.qweight, qw.scales, z, gsc, y, m, n, k, x2.stride(0),
                                             y.stride(0), split, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, KB=kb,
                                             SPLIT=split > 1, NUM_STAGES=cfg.num_stages,
                                             GROUP_M=group_m, SWAP=swap, LAYOUT=layout,
                                             DEC=dec, EVEN_K=k % (kb * pb) == 0, EVEN_N=n % cfg.block_n == 0, NH=nh,
                                             TILE_EXP=tile_exp,
                                             DOT_F32=x2.device.type != "cuda", num_warps=cfg.num_warps,
                                             num_stages=cfg.num_stages, ws_ptr=ws, cnt_ptr=cnt, REDUCE=reduce,
                                             ATOMIC_SEM=atomic_sem,
                                             **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}), **fmt)
    return y.to(x2.dtype) if split > 1 and not reduce else y


_COUNTERS: dict = {}


def _split_counters(device, n: int) -> torch.Tensor:
    """Zeroed int32 tile counters of the in-kernel split-K reduction, kept per (device, stream): every kernel
    leaves them at zero again (the last split of a tile resets its counter), so they are allocated once and not
    cleared per call (no memset in a CUDA graph). Per stream, so two GEMMs in flight never share one."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[key] = torch.zeros(max(n, 1024), device=device, dtype=torch.int32)
    return buf


@triton.jit
def _dequant_tc_kernel(qw_ptr, s_ptr, z_ptr, gs_ptr, w_ptr, N, K, N0, N1,
                       BITS: tl.constexpr, EPW: tl.constexpr, IS_INT: tl.constexpr, EXP_BITS: tl.constexpr,
                       MAN_BITS: tl.constexpr, CODE_OFFSET: tl.constexpr, HAS_ZERO: tl.constexpr,
                       SCALE_KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, PER_CHANNEL: tl.constexpr,
                       HAS_GSCALE: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr, EVEN_K: tl.constexpr,
                       EVEN_N: tl.constexpr, DEC: tl.constexpr, TILE_EXP: tl.constexpr, R: tl.constexpr):
    """W[N, K] in w's dtype, one [BK, BN] planar tile per program, decoded by the GEMM's own _w_tile (each word
    loaded once, packed decode where the format has one), stored transposed (k contiguous). Columns N0 .. N1-1
    of the weight (row stride N) go to rows 0 .. N1-N0-1 of w."""
    PB: tl.constexpr = R * EPW
    BK: tl.constexpr = KB * PB
    step = tl.program_id(1)
    offs_n = N0 + tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N1
    if EVEN_N:
        offs_n_ld = offs_n
    else:
        offs_n_ld = tl.minimum(offs_n, N1 - 1)
    n_blocks = tl.cdiv(K, PB)
    a_pc = None
    b_pc = None
    if PER_CHANNEL:
        a_pc, b_pc = _coeffs(s_ptr, z_ptr, 0, None, offs_n_ld, N, BITS, IS_INT, EXP_BITS, HAS_ZERO, CODE_OFFSET,
                             SCALE_KIND, False, TILE_EXP)
    DT: tl.constexpr = w_ptr.dtype.element_ty
    w = _w_tile(qw_ptr, s_ptr, z_ptr, step, n_blocks, offs_n_ld, n_mask, N, a_pc, b_pc, BITS, EPW, IS_INT, EXP_BITS,
                MAN_BITS, CODE_OFFSET, HAS_ZERO, SCALE_KIND, GROUP_SIZE, PER_CHANNEL, KB, BLOCK_N, 0, EVEN_K,
                TILE_EXP, R, DEC, DT)  # [BK, BN]
    if PER_CHANNEL or HAS_GSCALE or TILE_EXP:  # what the GEMM epilogue would multiply in
        post = tl.zeros((BLOCK_N,), dtype=tl.float32) + 2.0 ** TILE_EXP
        if PER_CHANNEL:
            post = post * decode_scale(tl.load(s_ptr + offs_n_ld), SCALE_KIND)
        if HAS_GSCALE:
            post = post * tl.load(gs_ptr)
        w = (w.to(tl.float32) * post[None, :]).to(DT)
    k = step * BK + tl.arange(0, BK)
    ptrs = w_ptr + (offs_n - N0)[None, :] * K + k[:, None]
    if EVEN_K and EVEN_N:
        tl.store(ptrs, w)
    else:
        tl.store(ptrs, w, mask=(k < K)[:, None] & n_mask[None, :])


def _dec_for(x_device, fmt: dict, dtype, block_n: int, num_warps: int, n: int, kb: int = 1) -> int:
    int4 = fmt["IS_INT"] and fmt["BITS"] == 4 and not fmt["HAS_ZERO"]
    fp4 = (not fmt["IS_INT"] and (fmt["EXP_BITS"], fmt["MAN_BITS"]) == (2, 1) and dtype == torch.bfloat16)
    if not (x_device.type == "cuda" and (int4 or fp4) and not fmt["PER_CHANNEL"]):
        return 0
    return 2 if (block_n == 128 and num_warps == 8 and kb == 1 and n % 128 == 0) else 1


def dequantize_tc(qw: QuantizedWeight, fmt: dict, dtype=torch.bfloat16, block_n: int = 128, num_warps: int = 8,
                  out: torch.Tensor | None = None, dec: int | None = None, n0: int = 0,
                  n1: int | None = None) -> torch.Tensor:
    """W[n0:n1, K] in `dtype` (the dequant half of the large-M dequant + cuBLAS path) with the tc kernel's decode."""
    n, k = qw.shape
    n1 = n if n1 is None else n1
    pb = fmt["R"] * fmt["EPW"]
    w = torch.empty((n1 - n0, k), device=qw.qweight.device, dtype=dtype) if out is None else out
    z = qw.zeros if qw.zeros is not None else qw.scales
    gsc = qw.global_scale if qw.global_scale is not None else qw.scales
    if dec is None:
        dec = _dec_for(qw.qweight.device, fmt, dtype, block_n, num_warps, n1 - n0)
        if n0 % 128:  # dec 2 pairs along n from 128-aligned columns
            dec = min(dec, 1)
    tile_exp = 64 if (dtype == torch.bfloat16 and not fmt["IS_INT"]) else 0
    grid = (triton.cdiv(n1 - n0, block_n), triton.cdiv(k, pb))
    _dequant_tc_kernel[grid](qw.qweight, qw.scales, z, gsc, w, n, k, n0, n1, BLOCK_N=block_n, KB=1,
                             EVEN_K=k % pb == 0, EVEN_N=(n1 - n0) % block_n == 0, DEC=dec, TILE_EXP=tile_exp, num_warps=num_warps, **fmt)
    return w


_SIDE_STREAMS: dict = {}


def dequant_matmul_streamed(x2: torch.Tensor, qw: QuantizedWeight, fmt: dict, chunks: int = 4,
                            block_n: int = 128, num_warps: int = 8) -> torch.Tensor:
    """y = x2 @ dequant(W)^T with N cut into `chunks` column blocks: a side stream dequantizes block i+1 (memory-bound)
    while cuBLAS multiplies block i (compute-bound) on the caller's stream, so the two can overlap on the GPU. The
    whole bf16 W is rebuilt every call (no caching). H200 round 1: within noise of the one-pass path (smaller cuBLAS
    problems lose what the overlap gains), so it is a tuner candidate, not a default."""
    n, k = qw.shape
    m = x2.shape[0]
    step = -(-(-(-n // chunks)) // 128) * 128  # 128-aligned blocks keep the paired decode
    bounds = [(n0, min(n, n0 + step)) for n0 in range(0, n, step)]
    y = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    w = torch.empty((n, k), device=x2.device, dtype=x2.dtype)
    if x2.device.type != "cuda":  # CPU interpreter: same blocks, one stream
        for n0, n1 in bounds:
            dequantize_tc(qw, fmt, x2.dtype, block_n, num_warps, out=w[n0:n1], n0=n0, n1=n1)
            y[:, n0:n1] = (x2.float() @ w[n0:n1].float().t()).to(x2.dtype)
        return y
    main = torch.cuda.current_stream(x2.device)
    side = _SIDE_STREAMS.get(x2.device)
    if side is None:
        side = _SIDE_STREAMS[x2.device] = torch.cuda.Stream(x2.device)
    side.wait_stream(main)  # the weight, x2 and the fresh w are ready
    for n0, n1 in bounds:
        with torch.cuda.stream(side):
            dequantize_tc(qw, fmt, x2.dtype, block_n, num_warps, out=w[n0:n1], n0=n0, n1=n1)
            ev = torch.cuda.Event()
            ev.record(side)
        main.wait_event(ev)
        torch.matmul(x2, w[n0:n1].t(), out=y[:, n0:n1])
    main.wait_stream(side)  # join the side stream (required to end a CUDA graph capture)
    w.record_stream(side)  # allocated on main, written on side: the allocator must not hand it out early
    return y
