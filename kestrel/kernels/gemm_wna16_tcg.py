"""Hopper WNA16 GEMM in Gluon (Triton's explicit-layout dialect), M > 16: the decode of K step s+1 overlaps the
asynchronous wgmma of step s ("tcg" kernel; symmetric int4 g128, bf16 activations, N % BLOCK_N == 0, K % 128 == 0).

Why: the "tc" kernel (gemm_wna16_tc.py) decodes W into shared memory and waits on each wgmma right away (Triton 3.6
pipelines the loads but not a dot whose operand is computed in the loop), so decode and MMA serialise inside a CTA.
Here the loop is written out: a ring of STAGES TMA loads (x tile, packed words, scales) on mbarriers, the decoded
W^T tile double-buffered in shared memory, and warpgroup_mma(is_async) + warpgroup_mma_wait(1), so one wgmma stays
in flight while the next tile is decoded.

Per K step (one planar block, packing.py: word row r of block b, field i holds k = 128 b + 16 i + r): the [16, BN]
words are loaded once; field i is decoded (mantissa trick, one FFMA with the group scale) straight into rows
16 i .. 16 i + 15 of the [128, BN] tile. Split-K: relaxed fp32 atomics into a zeroed y (cast after).

cfg.swap ("swap-AB", _tcgs_kernel; the default from session 4): y^T = W x^T with the decoded W tile as the wgmma
A operand in registers and x^T from the ring as B, int4 g128 or MXFP4; cfg.ws 1/2 warp-specialised variants
(measured slower on the H200 in session 4, with the racy loop; on _swap_kloop's split-step loop since session 11,
not yet GPU-run; ws 2's wgmma serialised by ptxas on 128x256, ws2_regs), cfg.reduce the in-kernel split-K sum. See
the comment above _ASM_QUAD.
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kestrel.kernels.configs import ComputeConfig, nonempty_split
from kestrel.quant.weight import QuantizedWeight

R = gl.constexpr(16)  # word rows per planar block (packing.PLANE_ROWS)
BK = gl.constexpr(128)  # k per planar block of int4 (R * 8 fields)
# the swap kernels' K loop (_swap_kloop): 2 = each step as two wgmma on two halves, each with its own A registers
# (the default); 1 = two K steps per iteration, each with its own A registers; 0 = the racy loop of sessions 4-9,
# kept only so a bench can time the forms against each other in one process
SWAP_LOOP = 2


# two elements (fields j, j + 4 of one word: same word and shift in both operand slots) -> (c - offset) * s as
# bf16x2: codes OR-ed under the exponent of 128 so the subtraction of (128 + offset) is exact, one rounding in the mul
_ASM_PAIR = gl.constexpr("{ .reg .b32 t; shr.u32 t, $1, $3; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; "
                         "sub.rn.bf16x2 t, t, $5; mul.rn.bf16x2 $0, t, $6; }")


@gluon.constexpr_function
def _mma_warps(block_m, num_warps):
    """warps along (M, N) of the wgmma: 4-warp groups along M while M has rows for them, the rest along N."""
    wm = 4
    while wm * 2 <= num_warps and block_m >= 16 * wm * 2:
        wm *= 2
    return [wm, num_warps // wm]


@gluon.constexpr_function
def _mma_layout(block_m, block_n, num_warps):
    w = _mma_warps(block_m, num_warps)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=w, instr_shape=[16, block_n // w[1], 16])


@gluon.jit
def _issue(x_desc, q_desc, s_desc, bar, x_buf, q_buf, s_buf, off_m, off_n, step, pred):
    mbarrier.expect(bar, x_desc.block_type.nbytes + q_desc.block_type.nbytes + s_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(x_desc, [off_m, step * BK], bar, x_buf, pred=pred)
    tma.async_copy_global_to_shared(q_desc, [step * R, off_n], bar, q_buf, pred=pred)
    tma.async_copy_global_to_shared(s_desc, [step, off_n], bar, s_buf, pred=pred)


@gluon.jit
def _tile_and_split(M, K, split_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The (tile, K split) prologue of a 2-D grid: program (pid, pid_k) owns the tile at (off_m, off_n) and its K
    steps [s0, s0 + cnt). M tiles of one N tile run side by side, so each weight tile is read from HBM once."""
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    off_m = (pid % num_pid_m) * BLOCK_M
    off_n = (pid // num_pid_m) * BLOCK_N
    n_steps = K // BK
    per = gl.cdiv(n_steps, split_k)
    s0 = pid_k * per
    cnt = gl.minimum(s0 + per, n_steps) - s0
    return pid, pid_k, off_m, off_n, s0, cnt


@gluon.jit
def _tail_tile_and_split(M, K, n_full, tail_split, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """cfg.tail's prologue (1-D grid): programs 0 .. n_full - 1 are the whole waves' tiles, unsplit; the rest are
    the last partial wave's tiles (n_full + t // tail_split), each split over K in tail_split. Returns the tile
    origin, its K steps [s0, s0 + cnt), and its split count (1 for a whole-wave tile: _swap_store's
    reduction then sums its one partial)."""
    pid = gl.program_id(0)
    full = (pid < n_full).to(gl.int32)
    t = gl.maximum(pid - n_full, 0)
    split = full + (1 - full) * tail_split
    tile = full * pid + (1 - full) * (n_full + t // tail_split)
    pid_k = (1 - full) * (t % tail_split)
    num_pid_m = gl.cdiv(M, BLOCK_M)
    off_m = (tile % num_pid_m) * BLOCK_M
    off_n = (tile // num_pid_m) * BLOCK_N
    n_steps = K // BK
    per = gl.cdiv(n_steps, split)
    s0 = pid_k * per
    cnt = gl.minimum(s0 + per, n_steps) - s0
    return tile, pid_k, off_m, off_n, s0, cnt, split


@gluon.jit
def _tcg_kernel(x_desc, q_desc, s_desc, y_ptr, M, N, K, stride_ym, split_k, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, ATOMIC: gl.constexpr, STAGES: gl.constexpr, CODE_OFFSET: gl.constexpr,
                num_warps: gl.constexpr):
    """split_k is a runtime value (one compile for every split > 1); ATOMIC = split_k > 1."""
    pid, pid_k, off_m, off_n, s0, cnt = _tile_and_split(M, K, split_k, BLOCK_M, BLOCK_N)
    # the host never launches an empty split; without the hint the loop's zero-trip path sets acc = 0 beside the
    # in-flight wgmma and ptxas serialises every wgmma (C7515)
    gl.assume(cnt > 0)

    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BK], x_desc.layout)
    q_smem = gl.allocate_shared_memory(gl.int32, [STAGES, R, BLOCK_N], q_desc.layout)
    s_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 1, BLOCK_N], s_desc.layout)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, BLOCK_N], gl.bfloat16)
    w_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BK, BLOCK_N], w_layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        _issue(x_desc, q_desc, s_desc, bars.index(i), x_smem.index(i), q_smem.index(i), s_smem.index(i), off_m,
               off_n, s0 + i, i < cnt)

    # decode layout [R, 2, 4, BN] (word row, field // 4, field % 4, column): one thread holds all 8 fields of 4
    # consecutive words, the two fields j and j + 4 of a word in adjacent registers, so one lop3 turns the word
    # shifted by 4 j into the bf16x2 pair (128 + c_j, 128 + c_{j+4}) (Marlin's trick) and the pair is finished in
    # packed bf16x2 math (_ASM_PAIR: 2 instructions per weight). Permuted + reshaped to the [BK, BN] tile for ONE
    # shared store (per-field stores into slices of the tile made the membar pass put a CTA barrier between each)
    WR: gl.constexpr = 8 if num_warps > 8 else num_warps  # warps over the 16 word rows (2 per warp), rest over N
    L4: gl.constexpr = gl.BlockedLayout([1, 2, 4, 4], [2, 1, 1, 16], [WR, 1, 1, num_warps // WR], [1, 3, 2, 0])
    q_layout: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L4))
    j_layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4)))
    jsh = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=j_layout) * 4, 0), 1), 3)
    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    for i in range(cnt):
        slot = i % STAGES
        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        q = gl.expand_dims(gl.expand_dims(q_smem.index(slot).load(q_layout), 1), 2)  # [R, 1, 1, BN] int32
        sc = gl.expand_dims(gl.expand_dims(s_smem.index(slot).load(q_layout), 1), 2)  # [1, 1, 1, BN] bf16
        shape: gl.constexpr = [R, 2, 4, BLOCK_N]
        w = gl.inline_asm_elementwise(_ASM_PAIR, "=r,r,r,r,r,r,r",
                                      [q.broadcast_to(shape), jsh.broadcast_to(shape),
                                       gl.full(shape, 128 + CODE_OFFSET, gl.bfloat16, L4),
                                       sc.broadcast_to(shape)], dtype=gl.bfloat16, is_pure=True, pack=2)
        # row of the tile = 16 f + r with f = 4 hi + j
        w = gl.reshape(gl.permute(gl.reshape(w, (R, 8, BLOCK_N)), (1, 0, 2)), (BK, BLOCK_N))
        w_buf = w_smem.index(i % 2)  # read by the wgmma of step i - 2, finished (at most one in flight)
        w_buf.store(w)
        fence_async_shared()  # generic-proxy stores -> visible to the async-proxy wgmma
        gl.thread_barrier()
        acc = warpgroup_mma(x_smem.index(slot), w_buf, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # step i - 1 done: its x slot is free
        gl.thread_barrier()  # ... in every warpgroup, before one thread refills that slot
        nxt = i + STAGES - 1
        ns = nxt % STAGES
        _issue(x_desc, q_desc, s_desc, bars.index(ns), x_smem.index(ns), q_smem.index(ns), s_smem.index(ns), off_m,
               off_n, s0 + nxt, nxt < cnt)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    out_layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [WR, num_warps // WR], [1, 0])
    out = gl.convert_layout(acc, out_layout)
    offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_layout))
    offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_layout))
    ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if not ATOMIC:
        gl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        gl.atomic_add(ptrs, out, mask=mask, sem="relaxed")


# swap-AB ("tcgs", cfg.swap): y^T[n, m] = W[n, k] x^T[k, m], the decoded W tile being the wgmma A operand straight
# from registers (no decoded-tile smem store, fence or CTA barrier between decode and MMA; the smem traffic per K
# step is the x tile read by the wgmma). Four elements per PTX block: the pair of words at word rows 2c, 2c + 1
# (adjacent k of the A fragment) shares byte j (fields 2j, 2j + 1): one byte permute, two lop3 (Marlin's magic),
# the subtraction of 128 + offset (exact) and the scale multiply (one rounding) in bf16x2
_ASM_QUAD = gl.constexpr("{ .reg .b32 t, u; prmt.b32 t, $2, $3, $6; lop3.b32 u, t, 0x000F000F, 0x43004300, 0xEA; "
                         "shr.u32 t, t, 4; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; "
                         "sub.rn.bf16x2 u, u, $10; sub.rn.bf16x2 t, t, $11; mul.rn.bf16x2 $0, u, $12; "
                         "mul.rn.bf16x2 $1, t, $13; }")
# MXFP4 (e2m1): sign to bit 15 and (e1 e0 m) to bits 8..6 of a bf16 = value * 2^-126 (an e2m1 subnormal lands on a
# bf16 subnormal, exact), times the e8m0 scale pre-multiplied by 2^(126 - 64) (2^64 goes back on the accumulator)
_ASM_QUAD_FP4 = gl.constexpr("{ .reg .b32 t, a, b; prmt.b32 t, $2, $3, $6; "
                             "shl.b32 a, t, 6; and.b32 a, a, 0x01C001C0; shl.b32 b, t, 12; "
                             "lop3.b32 a, a, b, 0x80008000, 0xF8; mul.rn.bf16x2 $0, a, $10; "
                             "shl.b32 a, t, 2; and.b32 a, a, 0x01C001C0; shl.b32 b, t, 8; "
                             "lop3.b32 a, a, b, 0x80008000, 0xF8; mul.rn.bf16x2 $1, a, $11; }")
FP4_TILE_EXP = gl.constexpr(64)


@gluon.constexpr_function
def _decode_layout(a_ll):
    """The [BN, F, 16] (n, field, word row) layout whose reshape to [BN, 16 F] (k = 16 field + row) is the wgmma A
    fragment a_ll (a DistributedLinearLayout of [BN, 128]), registers ordered (row bit 0, field bit 0, ...) so one
    pack-4 asm call gets both words of a k pair and two fields of the same byte."""
    conv = lambda b: [b[0], b[1] // 16, b[1] % 16]
    regs = [conv(b) for b in a_ll.reg_bases]
    first = [[0, 0, 1], [0, 1, 0]]
    regs = first + [b for b in regs if b not in first]
    return gl.DistributedLinearLayout(regs, [conv(b) for b in a_ll.lane_bases], [conv(b) for b in a_ll.warp_bases],
                                      [], [a_ll.shape[0], a_ll.shape[1] // 16, 16])


@gluon.jit
def _swap_consts(L3: gl.constexpr, N, off_n, BLOCK_N: gl.constexpr, CODE_OFFSET: gl.constexpr, FP4: gl.constexpr,
                 NF: gl.constexpr = 8, F0: gl.constexpr = 0):
    """Loop constants of the decode of fields F0 .. F0 + NF - 1 (all 8: the whole K step): the prmt selector of
    byte j = field // 2 ([1, NF, 1]), the code offset (int4) and the offsets of a K step's scales: int4 g128 one
    per column ([BN, 1, 1]); MXFP4 g32 one per (column, byte) ([BN, NF, 1]: group 4 s + field // 2)."""
    fi = (gl.arange(0, NF, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3))) + F0) // 2
    sel = gl.expand_dims(gl.expand_dims(fi | ((fi + 4) << 8), 0), 2)
    offs_n = gl.expand_dims(gl.expand_dims(off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(
        2, L3))), 1), 2)
    zb = gl.full([BLOCK_N, NF, R], 128 + CODE_OFFSET, gl.bfloat16, L3)
    if FP4:
        s_offs = offs_n + gl.expand_dims(gl.expand_dims(fi, 0), 2) * N
    else:
        s_offs = offs_n
    return sel, zb, s_offs


@gluon.jit
def _swap_a(q_slot, sraw, sel, zb, L3: gl.constexpr, a_layout: gl.constexpr, BLOCK_N: gl.constexpr,
            FP4: gl.constexpr):
    """The decoded W tile of one K step as the wgmma A operand [BN, 128] (registers), from its [16, BN] words in
    shared memory and its raw scales (bf16, or e8m0 codes for MXFP4)."""
    q = gl.expand_dims(q_slot.permute((1, 0)).load(gl.SliceLayout(1, L3)), 1)  # [BN, 1, 16]
    return _swap_dec(q, sraw, sel, zb, L3, a_layout, BLOCK_N, 8, FP4)


@gluon.jit
def _swap_dec(q, sraw, sel, zb, L3: gl.constexpr, a_layout: gl.constexpr, BLOCK_N: gl.constexpr, NF: gl.constexpr,
              FP4: gl.constexpr):
    """Fields sel selects (NF of them, _swap_consts) of a K step's words q [BN, 1, 16] as the wgmma A operand
    [BN, 16 NF]."""
    shape: gl.constexpr = [BLOCK_N, NF, R]
    if FP4:  # bf16 bits of 2^(e - 127 + 126 - 64): exponent field e + 62 (e <= 192: block scales up to 2^65)
        sc = ((sraw.to(gl.int32) + (62 + 64 - FP4_TILE_EXP)) << 7).to(gl.int16).to(gl.bfloat16, bitcast=True)
        w = gl.inline_asm_elementwise(_ASM_QUAD_FP4, "=r,=r,r,r,r,r,r,r,r,r,r,r",
                                      [q.broadcast_to(shape), sel.broadcast_to(shape), sc.broadcast_to(shape)],
                                      dtype=gl.bfloat16, is_pure=True, pack=4)
    else:
        w = gl.inline_asm_elementwise(_ASM_QUAD, "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r",
                                      [q.broadcast_to(shape), sel.broadcast_to(shape), zb,
                                       sraw.broadcast_to(shape)], dtype=gl.bfloat16, is_pure=True, pack=4)
    return gl.convert_layout(gl.reshape(w, (BLOCK_N, NF * R)), a_layout)  # a register renaming (same linear layout)


@gluon.jit
def _swap_ring(x_desc, q_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The swap kernels' TMA ring (plain and stream-K): STAGES slots of an x tile [BM, 128] and a word tile
    [16, BN], one mbarrier each (initialised)."""
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BK], x_desc.layout)
    q_smem = gl.allocate_shared_memory(gl.int32, [STAGES, R, BLOCK_N], q_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    return x_smem, q_smem, bars


@gluon.jit
def _swap_refill(x_desc, q_desc, x_smem, q_smem, bars, off_m, off_n, s0, g, j, cnt, STAGES: gl.constexpr):
    """TMA of K step j of [s0, s0 + cnt) (nothing past its end) into ring slot (g + j) % STAGES: the prologue's
    fills, and each step's refill of the slot a retired wgmma freed (after the fence + CTA barrier)."""
    sl = (g + j) % STAGES
    mbarrier.expect(bars.index(sl), x_desc.block_type.nbytes + q_desc.block_type.nbytes, pred=j < cnt)
    tma.async_copy_global_to_shared(x_desc, [off_m, (s0 + j) * BK], bars.index(sl), x_smem.index(sl), pred=j < cnt)
    tma.async_copy_global_to_shared(q_desc, [(s0 + j) * R, off_n], bars.index(sl), q_smem.index(sl), pred=j < cnt)


# The async wgmma reads its A operand from registers until a wait retires it (PTX ISA, wgmma.mma_async: touching
# them before that is undefined). A loop of one decode + one wgmma per step with one wgmma left in flight rewrites
# the A registers of step i - 1's wgmma with step i's decode while that wgmma may still read them: the PTX names
# the same registers every iteration. That race is what made the 128x128 8-warp stream-K kernel wrong on every
# tile (session 9: raw code bits as bf16 -> inf / NaN; whether a compile loses it depends on ptxas' schedule, so
# 4-warp / 128x256 / atomic-store compiles of the same loop came out right). Now each A register set is rewritten
# only after the wait that retired its wgmma, and each wait keeps the A of the wgmma it retires alive (deps): two
# wgmma per step on halves of the tile (_swap_half_step, _swap_khalf_step) or two K steps per iteration
# (_swap_step) - what CUTLASS's register-A mainloops do with one fragment per k block; Triton's own pipeliner
# refuses to leave such a wgmma in flight at all.
@gluon.jit
def _swap_step(x_desc, q_desc, x_smem, q_smem, bars, s_ptr, N, off_m, off_n, s0, cnt, g, i, s_next, acc, a_prev,
               sel, zb, s_offs, L3: gl.constexpr, a_layout: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, FP4: gl.constexpr, KEEP: gl.constexpr = True):
    """K step i of [s0, s0 + cnt): decode into A, async wgmma, retire step i - 1's wgmma (KEEP: a_prev, its A,
    kept alive up to that wait), refill its ring slot with step i + STAGES - 1. g: ring steps consumed before (the
    slot and mbarrier phase go on from it). -> (acc, the next step's scales, A)."""
    SPS: gl.constexpr = 4 if FP4 else 1  # scale rows per K step
    slot = (g + i) % STAGES
    sraw = s_next
    s_next = gl.load(s_ptr + (s0 + gl.minimum(i + 1, cnt - 1)) * SPS * N + s_offs)  # prefetched a step ahead
    mbarrier.wait(bars.index(slot), ((g + i) // STAGES) & 1)
    a = _swap_a(q_smem.index(slot), sraw, sel, zb, L3, a_layout, BLOCK_N, FP4)
    acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
    if KEEP:
        acc, a_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_prev))  # step i - 1 done: slot + A free
    else:
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
    fence_async_shared()  # the generic-proxy word loads before the TMA (async proxy) refill
    gl.thread_barrier()  # ... in every warpgroup, before one thread refills them
    _swap_refill(x_desc, q_desc, x_smem, q_smem, bars, off_m, off_n, s0, g, i + STAGES - 1, cnt, STAGES)
    return acc, s_next, a


@gluon.jit
def _swap_qslot(q_smem, slot, QS: gl.constexpr, QH: gl.constexpr):
    """The word tile of ring slot `slot`: q_smem[slot], or with ws 2 (one word tile per consumer warpgroup, QS = 2
    tiles per slot) this warpgroup's q_smem[QS slot + QH]."""
    if QS == 1:
        return q_smem.index(slot)
    else:
        return q_smem.index(QS * slot + QH)


@gluon.jit
def _swap_release(x_desc, q_desc, x_smem, q_smem, bars, empty, off_m, off_n, s0, g, i, cnt, STAGES: gl.constexpr,
                  WS: gl.constexpr):
    """After K step i (step i - 1's wgmma retired): hand step i - 1's ring slot back. Without a loader warp one
    thread refills it with step i + STAGES - 1 behind a CTA barrier; WS (loader warp): one arrival on its empty
    barrier. The fence orders this partition's generic-proxy word loads before the TMA (async-proxy) refill."""
    fence_async_shared()
    if WS:
        mbarrier.arrive(empty.index((g + i + STAGES - 1) % STAGES), pred=i > 0)
    else:
        gl.thread_barrier()  # ... in every warpgroup, before one thread refills step i - 1's slot (retired)
        _swap_refill(x_desc, q_desc, x_smem, q_smem, bars, off_m, off_n, s0, g, i + STAGES - 1, cnt, STAGES)


@gluon.jit
def _swap_half_step(x_smem, q_smem, bars, s_ptr, N, s0, cnt, g, i, s_next0, s_next1, acc0, acc1, a1_prev, sel, zb,
                    s_offs, L3: gl.constexpr, a_layout: gl.constexpr, HN: gl.constexpr, STAGES: gl.constexpr,
                    FP4: gl.constexpr, QS: gl.constexpr = 1, QH: gl.constexpr = 0):
    """K step i as two wgmma on the tile's two row halves (HALVES): half 0 is decoded while step i - 1's half 1 is
    in flight and half 1 while half 0 is, each into its own A registers, each rewritten only after the wait that
    retired the wgmma reading it. No more registers than one full-tile A (where two full-tile A do not fit: the
    128x256 tile, ptxas then serialises every wgmma, C7511)."""
    SPS: gl.constexpr = 4 if FP4 else 1
    slot = (g + i) % STAGES
    sraw0 = s_next0
    sraw1 = s_next1
    s_row = s_ptr + (s0 + gl.minimum(i + 1, cnt - 1)) * SPS * N  # the next step's scales of both halves
    s_next0 = gl.load(s_row + s_offs)
    s_next1 = gl.load(s_row + HN + s_offs)
    mbarrier.wait(bars.index(slot), ((g + i) // STAGES) & 1)
    xs = x_smem.index(slot).permute((1, 0))
    q = _swap_qslot(q_smem, slot, QS, QH)
    a0 = _swap_a(q.slice(0, HN, dim=1), sraw0, sel, zb, L3, a_layout, HN, FP4)
    acc0 = warpgroup_mma(a0, xs, acc0, is_async=True)
    acc1, a1_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc1, a1_prev))  # step i - 1 done
    a1 = _swap_a(q.slice(HN, HN, dim=1), sraw1, sel, zb, L3, a_layout, HN, FP4)
    acc1 = warpgroup_mma(a1, xs, acc1, is_async=True)
    acc0, acc1, a0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0, acc1, a0))  # half 0 done
    return acc0, acc1, s_next0, s_next1, a1


@gluon.jit
def _swap_khalf_step(x_smem, q_smem, bars, s_ptr, N, s0, cnt, g, i, s_next0, s_next1, acc, a1_prev, sel0, sel1, zb,
                     s_offs0, s_offs1, L3: gl.constexpr, a_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, FP4: gl.constexpr, QS: gl.constexpr = 1, QH: gl.constexpr = 0):
    """K step i as two wgmma on its two K halves (fields 0-3 = k 0-63, 4-7 = k 64-127), for tiles of one 16-row
    slice per warp (128x128 w8), where two full-step A sets cost ~36 registers and 1-5 % (H200 s10 R1): the same
    alternation as _swap_half_step with one accumulator and the words loaded once."""
    SPS: gl.constexpr = 4 if FP4 else 1
    slot = (g + i) % STAGES
    sraw0 = s_next0
    sraw1 = s_next1
    s_row = s_ptr + (s0 + gl.minimum(i + 1, cnt - 1)) * SPS * N
    s_next0 = gl.load(s_row + s_offs0)
    s_next1 = gl.load(s_row + s_offs1)
    mbarrier.wait(bars.index(slot), ((g + i) // STAGES) & 1)
    xs = x_smem.index(slot)
    q = gl.expand_dims(_swap_qslot(q_smem, slot, QS, QH).permute((1, 0)).load(gl.SliceLayout(1, L3)), 1)  # [BN,1,16]
    a0 = _swap_dec(q, sraw0, sel0, zb, L3, a_layout, BLOCK_N, 4, FP4)
    acc = warpgroup_mma(a0, xs.slice(0, BK // 2, dim=1).permute((1, 0)), acc, is_async=True)
    acc, a1_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a1_prev))  # step i - 1 done
    a1 = _swap_dec(q, sraw1, sel1, zb, L3, a_layout, BLOCK_N, 4, FP4)
    acc = warpgroup_mma(a1, xs.slice(BK // 2, BK // 2, dim=1).permute((1, 0)), acc, is_async=True)
    acc, a0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a0))  # the first half done
    return acc, s_next0, s_next1, a1


@gluon.jit
def _swap_kloop(x_desc, q_desc, x_smem, q_smem, bars, s_ptr, N, off_m, off_n, s0, cnt, g, L3: gl.constexpr,
                a_layout: gl.constexpr, mma_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                STAGES: gl.constexpr, CODE_OFFSET: gl.constexpr, FP4: gl.constexpr, num_warps: gl.constexpr,
                LOOP: gl.constexpr = 2, WS: gl.constexpr = False, empty=None, QS: gl.constexpr = 1,
                QH: gl.constexpr = 0):
    """acc[BN, BM] (all wgmma retired) over K steps [s0, s0 + cnt) of one tile (cnt > 0): the TMA ring's prologue
    and the K loop of the swap kernels without a loader warp (plain and stream-K), ring slots from g on.
    WS: the consumer partition of the loader-warp kernels (ws 1 / 2: no prologue, bars are the loader's "ready"
    barriers, each retired step's slot goes back by an arrival on `empty`; x_desc / q_desc unused), LOOP 2 only;
    QS / QH: _swap_qslot (ws 2). num_warps: the warps of the partition that runs the loop.
    LOOP (SWAP_LOOP) 2: each step as two wgmma on the tile's row halves (two 16-row slices per warp, e.g. 128x256
    with 8 warps: _swap_half_step) or K halves (_swap_khalf_step); 1: two K steps per iteration (_swap_step);
    0: the racy one-register-set loop of sessions 4-9 (A/B timing only)."""
    SPS: gl.constexpr = 4 if FP4 else 1
    gl.static_assert(LOOP == 2 or not WS)
    if not WS:
        for i in gl.static_range(STAGES - 1):
            _swap_refill(x_desc, q_desc, x_smem, q_smem, bars, off_m, off_n, s0, g, i, cnt, STAGES)
    if LOOP == 2 and BLOCK_N == 32 * num_warps:
        HN: gl.constexpr = BLOCK_N // 2
        L3h: gl.constexpr = _decode_layout(gl.to_linear_layout(a_layout, [HN, BK]))
        sel, zb, s_offs = _swap_consts(L3h, N, off_n, HN, CODE_OFFSET, FP4)
        s_next0 = gl.load(s_ptr + s0 * SPS * N + s_offs)
        s_next1 = gl.load(s_ptr + s0 * SPS * N + HN + s_offs)
        acc0 = gl.zeros((HN, BLOCK_M), dtype=gl.float32, layout=mma_layout)
        acc1 = gl.zeros((HN, BLOCK_M), dtype=gl.float32, layout=mma_layout)
        a1 = gl.zeros((HN, BK), dtype=gl.bfloat16, layout=a_layout)  # "step -1's half 1": nothing in flight
        for i in range(cnt):
            acc0, acc1, s_next0, s_next1, a1 = _swap_half_step(x_smem, q_smem, bars, s_ptr, N, s0, cnt, g, i, s_next0,
                                                               s_next1, acc0, acc1, a1, sel, zb, s_offs, L3h,
                                                               a_layout, HN, STAGES, FP4, QS, QH)
            _swap_release(x_desc, q_desc, x_smem, q_smem, bars, empty, off_m, off_n, s0, g, i, cnt, STAGES, WS)
        acc1, a1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, a1))
        # rows h * HN + r of the tile: the full tile's wgmma layout up to the order of registers
        acc = gl.convert_layout(gl.reshape(gl.permute(gl.join(acc0, acc1), (2, 0, 1)), (BLOCK_N, BLOCK_M)),
                                mma_layout)
    elif LOOP == 2:
        acc = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=mma_layout)
        L3k: gl.constexpr = _decode_layout(gl.to_linear_layout(a_layout, [BLOCK_N, BK // 2]))
        sel0, zb, s_offs0 = _swap_consts(L3k, N, off_n, BLOCK_N, CODE_OFFSET, FP4, 4, 0)
        sel1, zb, s_offs1 = _swap_consts(L3k, N, off_n, BLOCK_N, CODE_OFFSET, FP4, 4, 4)
        s_next0 = gl.load(s_ptr + s0 * SPS * N + s_offs0)
        s_next1 = gl.load(s_ptr + s0 * SPS * N + s_offs1)
        a1 = gl.zeros((BLOCK_N, BK // 2), dtype=gl.bfloat16, layout=a_layout)  # nothing in flight yet
        for i in range(cnt):
            acc, s_next0, s_next1, a1 = _swap_khalf_step(x_smem, q_smem, bars, s_ptr, N, s0, cnt, g, i, s_next0,
                                                         s_next1, acc, a1, sel0, sel1, zb, s_offs0, s_offs1, L3k,
                                                         a_layout, BLOCK_N, STAGES, FP4, QS, QH)
            _swap_release(x_desc, q_desc, x_smem, q_smem, bars, empty, off_m, off_n, s0, g, i, cnt, STAGES, WS)
        acc, a1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a1))
    else:  # LOOP 0 / 1
        acc = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=mma_layout)
        sel, zb, s_offs = _swap_consts(L3, N, off_n, BLOCK_N, CODE_OFFSET, FP4)
        s_next = gl.load(s_ptr + s0 * SPS * N + s_offs)  # a K step's scales, prefetched a step ahead
        a_odd = gl.zeros((BLOCK_N, BK), dtype=gl.bfloat16, layout=a_layout)  # "step -1's A": nothing in flight
        if LOOP == 1:
            for j in range(cnt // 2):
                acc, s_next, a_even = _swap_step(x_desc, q_desc, x_smem, q_smem, bars, s_ptr, N, off_m, off_n, s0,
                                                 cnt, g, 2 * j, s_next, acc, a_odd, sel, zb, s_offs, L3, a_layout,
                                                 BLOCK_N, STAGES, FP4)
                acc, s_next, a_odd = _swap_step(x_desc, q_desc, x_smem, q_smem, bars, s_ptr, N, off_m, off_n, s0,
                                                cnt, g, 2 * j + 1, s_next, acc, a_even, sel, zb, s_offs, L3, a_layout,
                                                BLOCK_N, STAGES, FP4)
            if cnt % 2:
                acc, s_next, a_odd = _swap_step(x_desc, q_desc, x_smem, q_smem, bars, s_ptr, N, off_m, off_n, s0,
                                                cnt, g, cnt - 1, s_next, acc, a_odd, sel, zb, s_offs, L3, a_layout,
                                                BLOCK_N, STAGES, FP4)
            acc, a_odd = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_odd))
        else:
            for i in range(cnt):
                acc, s_next, a = _swap_step(x_desc, q_desc, x_smem, q_smem, bars, s_ptr, N, off_m, off_n, s0, cnt, g,
                                            i, s_next, acc, a_odd, sel, zb, s_offs, L3, a_layout, BLOCK_N, STAGES,
                                            FP4, False)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    return acc


@gluon.jit
def _swap_consume(x_smem, q_smem, ready, empty, s_ptr, N, off_n, s0, cnt, L3: gl.constexpr,
                  mma_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  CODE_OFFSET: gl.constexpr, FP4: gl.constexpr, num_warps: gl.constexpr):
    """Warp-specialised consumer (ws 1): _swap_kloop's half-step loop on the loader's ready barriers, each retired
    step's slot handed back to the loader warp (empty barrier): no CTA barrier in the loop."""
    gl.assume(cnt > 0)  # the kernel's assumption does not reach into the partition
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    acc = _swap_kloop(None, None, x_smem, q_smem, ready, s_ptr, N, 0, off_n, s0, cnt, 0, L3, a_layout, mma_layout,
                      BLOCK_M, BLOCK_N, STAGES, CODE_OFFSET, FP4, num_warps, 2, True, empty)
    return (acc, )  # warp_specialize flattens a tuple


@gluon.jit
def _swap_load(x_desc, q_desc, x_smem, q_smem, ready, empty, off_m, off_n, s0, cnt, STAGES: gl.constexpr):
    """Warp-specialised loader (one warp): refill each slot once the consumers have released it."""
    nbytes: gl.constexpr = x_desc.block_type.nbytes + q_desc.block_type.nbytes
    for i in range(cnt):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
        mbarrier.expect(ready.index(slot), nbytes)
        tma.async_copy_global_to_shared(x_desc, [off_m, (s0 + i) * BK], ready.index(slot), x_smem.index(slot))
        tma.async_copy_global_to_shared(q_desc, [(s0 + i) * R, off_n], ready.index(slot), q_smem.index(slot))


@gluon.jit
def _tcgs_kernel(x_desc, q_desc, s_ptr, y_ptr, M, N, K, stride_ym, split_k, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, ATOMIC: gl.constexpr, STAGES: gl.constexpr, CODE_OFFSET: gl.constexpr,
                 WS: gl.constexpr, FP4: gl.constexpr, num_warps: gl.constexpr, REDUCE: gl.constexpr = False,
                 ws_ptr=None, cnt_ptr=None, TAIL: gl.constexpr = False, n_full=0, n_tiles=0,
                 LOOP: gl.constexpr = 2, OWN: gl.constexpr = False):
    """WS: a loader warp (warp_specialize) instead of the single-thread TMA issue behind a CTA barrier.
    REDUCE: split-K summed in the kernel (_swap_store) instead of fp32 atomics into a zeroed y.
    FP4: MXFP4 weights (e2m1 codes, e8m0 scales per 32) instead of symmetric int4 g128.
    TAIL (with REDUCE, cfg.tail): only the tiles after the n_full of the whole waves are split (in split_k), see
    _tail_tile_and_split. LOOP: the K loop of _swap_kloop (SWAP_LOOP). OWN: _swap_store's (cfg.fixup_own)."""
    if TAIL:
        pid, pid_k, off_m, off_n, s0, cnt, my_split = _tail_tile_and_split(M, K, n_full, split_k, BLOCK_M, BLOCK_N)
        n_red = n_tiles
    else:
        pid, pid_k, off_m, off_n, s0, cnt = _tile_and_split(M, K, split_k, BLOCK_M, BLOCK_N)
        my_split = split_k
        n_red = gl.num_programs(0)
    gl.assume(cnt > 0)

    x_smem, q_smem, bars = _swap_ring(x_desc, q_desc, BLOCK_M, BLOCK_N, STAGES)
    # wgmma M = BLOCK_N (weight rows), N = BLOCK_M (x rows): warps along the weight rows
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    L3: gl.constexpr = _decode_layout(gl.to_linear_layout(a_layout, [BLOCK_N, BK]))
    if WS:
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(empty.index(i), count=1)
        acc, = gl.warp_specialize([
            (_swap_consume, (x_smem, q_smem, bars, empty, s_ptr, N, off_n, s0, cnt, L3, mma_layout, BLOCK_M,
                             BLOCK_N, STAGES, CODE_OFFSET, FP4, num_warps)),
            (_swap_load, (x_desc, q_desc, x_smem, q_smem, bars, empty, off_m, off_n, s0, cnt, STAGES)),
        ], [1], [40])
    else:
        acc = _swap_kloop(x_desc, q_desc, x_smem, q_smem, bars, s_ptr, N, off_m, off_n, s0, cnt, 0, L3, a_layout,
                          mma_layout, BLOCK_M, BLOCK_N, STAGES, CODE_OFFSET, FP4, num_warps, LOOP)

    _swap_store(acc, y_ptr, M, N, stride_ym, off_m, off_n, BLOCK_M, BLOCK_N, ATOMIC, FP4, num_warps, REDUCE,
                ws_ptr, cnt_ptr, pid, n_red, pid_k, my_split, OWN)


@gluon.jit
def _swap_store(acc, y_ptr, M, N, stride_ym, off_m, off_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                ATOMIC: gl.constexpr, FP4: gl.constexpr, num_warps: gl.constexpr, REDUCE: gl.constexpr = False,
                ws_ptr=None, cnt_ptr=None, tile=0, n_tiles=1, pid_k=0, split_k=1, OWN: gl.constexpr = False):
    """y[m, n] = acc[n, m]: consecutive n per thread, a warp along up to 128 n (coalesced), warps along m.
    REDUCE (split-K): each split stores its fp32 partial in its own workspace slab and takes a ticket on the
    tile's counter; the last one sums the slabs, stores y in its dtype and resets the counter (one launch: no
    zeroed fp32 y, no cast kernel). OWN (cfg.fixup_own): the last one starts from its own partial in registers
    and does not reload its slab (1 / split_k of the fixup's slab reads: half at stream-K's usual 2 parts)."""
    SPT: gl.constexpr = 4 if BLOCK_N >= 128 else BLOCK_N // 32
    out_layout: gl.constexpr = gl.BlockedLayout([SPT, 1], [32, 1], [1, num_warps], [0, 1])
    out = gl.convert_layout(acc, out_layout)
    if FP4:
        out = out * (2.0 ** FP4_TILE_EXP)
    rn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout))
    rm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout))
    offs_n = off_n + rn
    offs_m = off_m + rm
    ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    mask = (offs_m < M)[None, :] & (offs_n < N)[:, None]
    if REDUCE:
        idx = rm[None, :] * BLOCK_N + rn[:, None]
        gl.store(ws_ptr + (pid_k * n_tiles + tile) * (BLOCK_M * BLOCK_N) + idx, out)
        gl.thread_barrier()  # every thread's partial is written before the ticket (acq_rel) is taken
        ticket = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if ticket == split_k - 1:
            if OWN:
                tot = out
                for j in range(split_k):  # the others' slabs (the masked own one moves no data)
                    tot += gl.load(ws_ptr + (j * n_tiles + tile) * (BLOCK_M * BLOCK_N) + idx,
                                   mask=gl.full([BLOCK_N, BLOCK_M], j, gl.int32, out_layout) != pid_k, other=0.0,
                                   cache_modifier=".cg")
            else:
                tot = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, out_layout)
                for j in range(split_k):  # .cg: the other splits' partials were written through other SMs' L1s
                    tot += gl.load(ws_ptr + (j * n_tiles + tile) * (BLOCK_M * BLOCK_N) + idx, cache_modifier=".cg")
            gl.store(ptrs, tot.to(y_ptr.dtype.element_ty), mask=mask)
            gl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")  # ready for the next call
    elif not ATOMIC:
        gl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        gl.atomic_add(ptrs, out, mask=mask, sem="relaxed")


@gluon.jit
def _swap_consume_half(x_smem, q_smem, ready, empty, s_ptr, y_ptr, M, N, stride_ym, off_m, off_n, s0, cnt,
                       H: gl.constexpr, BLOCK_M: gl.constexpr, HN: gl.constexpr, STAGES: gl.constexpr,
                       CODE_OFFSET: gl.constexpr, FP4: gl.constexpr, ATOMIC: gl.constexpr):
    """ws=2: one of two consumer warpgroups (its own partition, so neither waits for the other): the weight rows
    off_n + H * HN .. + HN of the tile, from its own half of each K step's words; it releases a slot by one of the
    two arrivals its empty barrier counts, and stores its half of y."""
    gl.assume(cnt > 0)  # the kernel's assumption does not reach into the partition
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    L3: gl.constexpr = _decode_layout(gl.to_linear_layout(a_layout, [HN, BK]))
    n0 = off_n + H * HN
    acc = _swap_kloop(None, None, x_smem, q_smem, ready, s_ptr, N, off_m, n0, s0, cnt, 0, L3, a_layout, mma_layout,
                      BLOCK_M, HN, STAGES, CODE_OFFSET, FP4, 4, 2, True, empty, 2, H)
    _swap_store(acc, y_ptr, M, N, stride_ym, off_m, n0, BLOCK_M, HN, ATOMIC, FP4, 4)


@gluon.jit
def _swap_load_halves(x_desc, q_desc, x_smem, q_smem, ready, empty, off_m, off_n, s0, cnt, STAGES: gl.constexpr):
    """ws=2 loader warp: each K step's x tile and the two halves of its words (q_desc blocks are half a tile)."""
    HN: gl.constexpr = q_desc.block_type.shape[1]
    nbytes: gl.constexpr = x_desc.block_type.nbytes + 2 * q_desc.block_type.nbytes
    for i in range(cnt):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, nbytes)
        tma.async_copy_global_to_shared(x_desc, [off_m, (s0 + i) * BK], bar, x_smem.index(slot))
        tma.async_copy_global_to_shared(q_desc, [(s0 + i) * R, off_n], bar, q_smem.index(2 * slot))
        tma.async_copy_global_to_shared(q_desc, [(s0 + i) * R, off_n + HN], bar, q_smem.index(2 * slot + 1))


@gluon.jit
def _halves_ring(x_desc, q_desc, X_DTYPE: gl.constexpr, BLOCK_M: gl.constexpr, HN: gl.constexpr,
                 STAGES: gl.constexpr):
    """The two-consumer kernels' ring (_swap_load_halves fills it): STAGES x tiles [BM, 128], two word tiles
    [16, HN] per slot, a ready barrier per slot and an empty one counting both consumers' arrivals."""
    x_smem = gl.allocate_shared_memory(X_DTYPE, [STAGES, BLOCK_M, BK], x_desc.layout)
    q_smem = gl.allocate_shared_memory(gl.int32, [2 * STAGES, R, HN], q_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    return x_smem, q_smem, ready, empty


@gluon.jit
def _tcgs2_kernel(x_desc, q_desc, s_ptr, y_ptr, M, N, K, stride_ym, split_k, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, ATOMIC: gl.constexpr, STAGES: gl.constexpr, CODE_OFFSET: gl.constexpr,
                  FP4: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
                  LOADER_REGS: gl.constexpr = 24):
    """ws=2 (launched with num_warps=4): two consumer warpgroups in two partitions plus a loader warp.
    CONSUMER_REGS / LOADER_REGS: the partitions' register budgets (setmaxnreg), ws2_regs."""
    pid, pid_k, off_m, off_n, s0, cnt = _tile_and_split(M, K, split_k, BLOCK_M, BLOCK_N)
    gl.assume(cnt > 0)
    HN: gl.constexpr = BLOCK_N // 2
    x_smem, q_smem, ready, empty = _halves_ring(x_desc, q_desc, gl.bfloat16, BLOCK_M, HN, STAGES)
    gl.warp_specialize([
        (_swap_consume_half, (x_smem, q_smem, ready, empty, s_ptr, y_ptr, M, N, stride_ym, off_m, off_n, s0, cnt, 0,
                              BLOCK_M, HN, STAGES, CODE_OFFSET, FP4, ATOMIC)),
        (_swap_consume_half, (x_smem, q_smem, ready, empty, s_ptr, y_ptr, M, N, stride_ym, off_m, off_n, s0, cnt, 1,
                              BLOCK_M, HN, STAGES, CODE_OFFSET, FP4, ATOMIC)),
        (_swap_load_halves, (x_desc, q_desc, x_smem, q_smem, ready, empty, off_m, off_n, s0, cnt, STAGES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def ws2_regs(block_n: int) -> tuple[int, int]:
    """(consumer, loader) register budgets (setmaxnreg) of the ws 2 kernel's partitions. With the loader at 24
    ptxas serialises every wgmma of both consumers (C7512) on every tile; at 120 it does not on the 128-wide tiles
    (64x128, 128x128; int4 + MXFP4, atomic too: offline sm_90a compile, session 11; 88-104 and 152 serialise
    again: ptxas-fragile, re-check with bench/wna16_tcg_compile.py after a change). The 128x256 tile is serialised
    (or spills) at every split tried: it keeps the old 24."""
    return 232, 120 if block_n == 128 else 24


def tail_plan(tiles: int, max_split: int, steps: int, num_sms: int) -> tuple[int, int, int]:
    """cfg.tail's grid: (n_full, n_tail, tail_split). The whole waves' tiles (n_full, a multiple of num_sms) run
    unsplit; the n_tail tiles left over are split over K in the most splits (<= max_split, none empty) that still
    fit one wave. tail_split 1: nothing to split (the grid is whole waves, or the tail fills a wave already)."""
    n_full = tiles // num_sms * num_sms
    n_tail = tiles - n_full
    sk = nonempty_split(min(max_split, num_sms // n_tail), steps) if n_tail else 1
    return (n_full, n_tail, sk) if sk > 1 else (tiles, 0, 1)


@functools.lru_cache(maxsize=None)
def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def supports(qw: QuantizedWeight, x2: torch.Tensor, cfg: ComputeConfig) -> bool:
    """On the GPU with bf16 x (act-order is already applied to x by gemm_wna16); ComputeConfig.valid_for checks
    the format and the tile."""
    tma_ok = all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (x2, qw.qweight, qw.scales))
    fp4 = qw.spec.weight_dtype == "fp4_e2m1"
    return (x2.is_cuda and x2.dtype == torch.bfloat16 and qw.zeros is None and qw.global_scale is None
            and qw.scales.dtype == (torch.uint8 if fp4 else torch.bfloat16) and (cfg.swap or not fp4)
            and qw.qweight.dtype == torch.int32 and tma_ok
            and torch.cuda.get_device_capability(x2.device)[0] == 9)


def gemm_wna16_tcg(x2: torch.Tensor, qw: QuantizedWeight, cfg: ComputeConfig) -> torch.Tensor:
    """x2 [M, K] bf16 contiguous -> y [M, N] bf16; cfg: block_m (64/128), block_n, split_k, num_warps (4/8),
    num_stages (TMA ring depth)."""
    m, k = x2.shape
    n = qw.shape[0]
    bm, bn, split = cfg.block_m, cfg.block_n, cfg.split_k
    r, bk = R.value, BK.value
    lay = gl.NVMMASharedLayout.get_default_for
    x_desc = TensorDescriptor.from_tensor(x2, [bm, bk], lay([bm, bk], gl.bfloat16))
    q_desc = TensorDescriptor.from_tensor(qw.qweight, [r, bn], lay([r, bn], gl.int32))
    grid = (-(-m // bm) * (n // bn), split)
    if cfg.swap and cfg.ws == 0 and cfg.streamk:  # persistent stream-K schedule
        from kestrel.kernels.gemm_wna16_tcg_streamk import launch
        return launch(x_desc, q_desc, qw, x2, cfg, _num_sms(x2.device))
    if cfg.swap and cfg.ws == 0 and cfg.tail:  # split only the last partial wave's tiles
        n_full, n_tail, tail_split = tail_plan(grid[0], split, k // bk, _num_sms(x2.device))
        if tail_split > 1:
            from kestrel.kernels.gemm_wna16_tc import _split_counters
            y = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
            # a slab and a counter per tile: the whole-wave tiles go through the reduction too, with one partial
            wsp = torch.empty(tail_split * grid[0] * bm * bn, device=x2.device, dtype=torch.float32)
            _tcgs_kernel[(n_full + n_tail * tail_split, 1)](
                x_desc, q_desc, qw.scales, y, m, n, k, y.stride(0), tail_split, BLOCK_M=bm, BLOCK_N=bn,
                ATOMIC=False, STAGES=cfg.num_stages, CODE_OFFSET=qw.spec.code_offset, WS=False,
                FP4=qw.spec.weight_dtype == "fp4_e2m1", num_warps=cfg.num_warps, REDUCE=True, ws_ptr=wsp,
                cnt_ptr=_split_counters(x2.device, grid[0]), TAIL=True, n_full=n_full, n_tiles=grid[0],
                LOOP=SWAP_LOOP, OWN=bool(cfg.fixup_own))
            return y
        split, grid = 1, (grid[0], 1)  # whole waves (or a tail too wide to split): the plain launch
    if cfg.swap and cfg.ws == 0 and cfg.reduce and split > 1:  # in-kernel split-K sum: one launch
        from kestrel.kernels.gemm_wna16_tc import _split_counters
        y = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
        wsp = torch.empty(split * grid[0] * bm * bn, device=x2.device, dtype=torch.float32)
        _tcgs_kernel[grid](x_desc, q_desc, qw.scales, y, m, n, k, y.stride(0), split, BLOCK_M=bm, BLOCK_N=bn,
                           ATOMIC=False, STAGES=cfg.num_stages, CODE_OFFSET=qw.spec.code_offset, WS=False,
                           FP4=qw.spec.weight_dtype == "fp4_e2m1", num_warps=cfg.num_warps, REDUCE=True,
                           ws_ptr=wsp, cnt_ptr=_split_counters(x2.device, grid[0]), LOOP=SWAP_LOOP,
                           OWN=bool(cfg.fixup_own))
        return y
    y = (torch.zeros if split > 1 else torch.empty)((m, n), device=x2.device,
                                                       dtype=torch.float32 if split > 1 else x2.dtype)
    if cfg.swap and cfg.ws == 2:  # two consumer warpgroups in their own partitions + a loader warp
        q_desc = TensorDescriptor.from_tensor(qw.qweight, [r, bn // 2], lay([r, bn // 2], gl.int32))
        _tcgs2_kernel[grid](x_desc, q_desc, qw.scales, y, m, n, k, y.stride(0), split, BLOCK_M=bm, BLOCK_N=bn,
                            ATOMIC=split > 1, STAGES=cfg.num_stages, CODE_OFFSET=qw.spec.code_offset,
                            FP4=qw.spec.weight_dtype == "fp4_e2m1", CONSUMER_REGS=ws2_regs(bn)[0], num_warps=4,
                            LOADER_REGS=ws2_regs(bn)[1])
        return y.to(x2.dtype) if split > 1 else y
    if cfg.swap:
        ws = bool(cfg.ws)
        _tcgs_kernel[grid](x_desc, q_desc, qw.scales, y, m, n, k, y.stride(0), split, BLOCK_M=bm, BLOCK_N=bn,
                           ATOMIC=split > 1, STAGES=cfg.num_stages, CODE_OFFSET=qw.spec.code_offset,
                           WS=ws, FP4=qw.spec.weight_dtype == "fp4_e2m1", num_warps=cfg.num_warps,
                           LOOP=SWAP_LOOP)
        return y.to(x2.dtype) if split > 1 else y
    s_desc = TensorDescriptor.from_tensor(qw.scales, [1, bn], lay([1, bn], gl.bfloat16))
    _tcg_kernel[grid](x_desc, q_desc, s_desc, y, m, n, k, y.stride(0), split, BLOCK_M=bm, BLOCK_N=bn,
                      ATOMIC=split > 1, STAGES=cfg.num_stages, CODE_OFFSET=qw.spec.code_offset,
                      num_warps=cfg.num_warps)
    return y.to(x2.dtype) if split > 1 else y
