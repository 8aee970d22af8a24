"""Hopper W4A8 GEMM in Gluon for large M (gemm_w4a8.TCG_MIN_M): int4 g128 weights (the WNA16 planar twin,
W4Weight.wna16) decoded to e4m3 in registers as the wgmma A operand, x fp8 e4m3 from a TMA ring as B (swap-AB,
y^T = W x^T), per-token scales in the epilogue.

Why: a weight group's scale must multiply its K step's product before it joins the sum, and ptxas serialises every
wgmma as soon as a non-wgmma instruction reads or writes any wgmma accumulator while one is in flight (C7514 /
C7515, offline sm_90a compile, bench/w4a8_tcg_compile.py: both a two-accumulator chain rescaled by s_prev / s_i and
partial products added after a wait(1) were serialised). So one warpgroup cannot hide the scaled add behind its own
wgmma; here two consumer warpgroups in their own partitions (plus a loader warp, gemm_wna16_tcg._swap_load_halves)
each take half of the tile's weight rows and run decode -> fresh wgmma -> wait -> acc += product * group scale, the
other warpgroup's wgmma running meanwhile. Left to themselves the two run in lockstep (both decode, both wgmma, both
add), so PP orders their wgmma issues strictly in turn (named barriers, _pp_turn). The fp8 wgmma accumulates within
a K step as Triton's fp8 dots do on sm_90.

Decode: word row r of a planar K step holds field f = k // 16 of k = 16 f + r (packing.py); the fp8 A fragment holds
4 consecutive k per register (k_width 4), i.e. 4 word rows of one field: byte f // 2 of two words per prmt, the
nibble masked under the f16 exponent of 1024 (0x6400 | c = 1024 + c), minus 1032 (exact), cvt to e4m3 pairs. PK
(activations from act_quant.quant_fp8(perm=True)): K permuted within each 128 so a register is one word's 4 nibbles,
decoded with integer ops only (_ASM_PK).
"""
from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kestrel.kernels.configs import nonempty_split
from kestrel.kernels.gemm_wna16_tc import _split_counters
from kestrel.kernels.gemm_wna16_tcg import (BK, R, _halves_ring, _swap_load_halves, _swap_store,
                                             _tile_and_split)

# 4 elements (word rows r .. r + 3 of one field) -> 4 e4m3 (c - 8) in one register: $1..$4 the words, $5 the prmt
# selector of the field's byte (same in $5..$8), $9 its nibble shift (0 / 4, same in $9..$12)
_ASM_E4M3 = gl.constexpr(
    "{ .reg .b32 a, b, m; .reg .b16 lo, hi; mov.b32 m, 0x64086408; "
    "prmt.b32 a, $1, $2, $5; shr.u32 a, a, $9; lop3.b32 a, a, 0x000F000F, 0x64006400, 0xEA; sub.rn.f16x2 a, a, m; "
    "cvt.rn.satfinite.e4m3x2.f16x2 lo, a; "
    "prmt.b32 b, $3, $4, $5; shr.u32 b, b, $9; lop3.b32 b, b, 0x000F000F, 0x64006400, 0xEA; sub.rn.f16x2 b, b, m; "
    "cvt.rn.satfinite.e4m3x2.f16x2 hi, b; mov.b32 $0, {lo, hi}; }")


@gluon.constexpr_function
def _decode_layout8(a_ll):
    """[BN, 8, 16] (n, field, word row) layout whose reshape to [BN, 128] is the fp8 A fragment a_ll, registers
    ordered (row bit 0, row bit 1, ...): one pack-4 asm call gets 4 consecutive rows (k) of one field."""
    conv = lambda b: [b[0], b[1] // 16, b[1] % 16]
    first = [[0, 0, 1], [0, 0, 2]]
    regs = first + [conv(b) for b in a_ll.reg_bases if conv(b) not in first]
    return gl.DistributedLinearLayout(regs, [conv(b) for b in a_ll.lane_bases], [conv(b) for b in a_ll.warp_bases],
                                      [], [a_ll.shape[0], a_ll.shape[1] // 16, 16])


@gluon.jit
def _keep_alive(a):
    """An empty asm reading every register of A (fp8) here, after the wait that retired the wgmma reading it: the
    registers cannot be reused for the next decode before (Triton 3.6's wgmma wait takes no 8-bit deps)."""
    gl.inline_asm_elementwise("", "=r,r", [a], dtype=gl.float8e4nv, is_pure=False, pack=4)


# Ping-pong (PP): named barriers 8 / 9 (Triton's partitions use 0 - 2) order the two consumer warpgroups' wgmma
# issues strictly in turn, so one warpgroup's decode and scaled adds run under the other's wgmma. Left free, the two
# run in lockstep (both decode, then both wgmma queue on the one tensor pipe, then both add): a K step then costs
# about decode + both wgmma + adds, the session 21 timings of the 128- and 256-token tiles (1425 / 2160 clocks a
# step for 512 / 1024 clocks of MMA).
@gluon.constexpr_function
def _pp_asm(op, bar):
    return f"bar.{op} {bar}, 256; mov.b32 $0, $1;"


@gluon.jit
def _bar_asm(ASM: gl.constexpr):
    """One thread-level barrier instruction per thread of the calling 4-warp partition."""
    tok = gl.full([128], 0, gl.int32, layout=gl.BlockedLayout([1], [32], [4], [0]))
    gl.inline_asm_elementwise(ASM, "=r,r", [tok], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _pp_turn(H: gl.constexpr, PP: gl.constexpr):
    """Wait for this warpgroup's turn to issue wgmma (the other's last issue arrived on barrier 8 + H)."""
    if PP:
        _bar_asm(_pp_asm("sync", 8 + H))


@gluon.jit
def _pp_pass(H: gl.constexpr, PP: gl.constexpr):
    """Hand the turn to the other warpgroup (after this one's wgmma issue): barrier 9 - H."""
    if PP:
        _bar_asm(_pp_asm("arrive", 9 - H))


@gluon.jit
def _pp_start(H: gl.constexpr, PP: gl.constexpr):
    """Before the K loop: warpgroup 1 gives warpgroup 0 the first turn."""
    if PP and H == 1:
        _pp_pass(1, PP)


@gluon.jit
def _pp_end(H: gl.constexpr, PP: gl.constexpr):
    """After the K loop: warpgroup 0 takes the turn warpgroup 1's last issue passed, so no barrier is left with
    arrivals pending."""
    if PP and H == 0:
        _pp_turn(0, PP)


@gluon.jit
def _field_consts(L3: gl.constexpr, NF: gl.constexpr, F0: gl.constexpr):
    """The decode constants of fields F0 .. F0 + NF - 1 of a K step's words ([1, NF, 1]): the prmt selector of
    byte field // 2 of both words and the nibble shift; and the fields themselves."""
    f = gl.arange(0, NF, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3))) + F0
    sel = gl.expand_dims(gl.expand_dims((f // 2) | ((f // 2 + 4) << 8), 0), 2)
    sh = gl.expand_dims(gl.expand_dims((f % 2) * 4, 0), 2)
    return sel, sh, f


@gluon.jit
def _int4_decode(q, sel, sh, a_layout: gl.constexpr, HN: gl.constexpr, NF: gl.constexpr):
    """NF fields (_field_consts) of a K step's words q [HN, 1, 16] -> the e4m3 wgmma A operand [HN, 16 NF]
    (codes c - 8)."""
    shape: gl.constexpr = [HN, NF, R]
    a = gl.inline_asm_elementwise(_ASM_E4M3, "=r,r,r,r,r,r,r,r,r,r,r,r,r",
                                  [q.broadcast_to(shape), sel.broadcast_to(shape), sh.broadcast_to(shape)],
                                  dtype=gl.float8e4nv, is_pure=True, pack=4)
    return gl.convert_layout(gl.reshape(a, (HN, NF * R)), a_layout)  # a register renaming (same linear layout)


# PK (permuted K): one register of the fp8 A fragment holds wgmma k = 32 c + 16 h + 4 t + i, i = 0..3, which the
# activations carry from k = 16 (2 i + h) + 4 c + t of the weight's K step (act_quant.quant_fp8(perm=True) stores
# them so): word row 4 c + t, nibbles of one parity h: the 4 bytes of one word shifted by 4 h. A nibble c becomes
# the e4m3 bits of (c - 8) 2^-9 with integer ops only (no f16, no cvt): |c - 8| is an e4m3 subnormal / the first
# normal (0..8 x 2^-9), so the byte is the sign and |c - 8|; the 2^9 goes onto the group scale. $1 the word, $5 the
# shift (same in $1..$4, $5..$8): n = 1 where c < 8 (bit 3 clear), low = (c ^ 7 n) & 7, byte = 0x81 n + low
_ASM_PK = gl.constexpr(
    "{ .reg .b32 w, n, m, l; shr.u32 w, $1, $5; shr.u32 n, w, 3; not.b32 n, n; and.b32 n, n, 0x01010101; "
    "mul.lo.u32 m, n, 7; xor.b32 l, w, m; and.b32 l, l, 0x07070707; mad.lo.u32 $0, n, 0x81, l; }")


@gluon.constexpr_function
def _decode_layout5(a_ll):
    """[HN, C, 2, 4, 4] (n, c, h, t, i) layout whose reshape to [HN, 32 C] is the fp8 A fragment a_ll (k = 32 c +
    16 h + 4 t + i), registers ordered (i bit 0, i bit 1, ...): one pack-4 asm call gets the 4 bytes i of one
    register."""
    conv = lambda b: [b[0], b[1] >> 5, (b[1] >> 4) & 1, (b[1] >> 2) & 3, b[1] & 3]
    first = [[0, 0, 0, 0, 1], [0, 0, 0, 0, 2]]
    regs = first + [conv(b) for b in a_ll.reg_bases if conv(b) not in first]
    return gl.DistributedLinearLayout(regs, [conv(b) for b in a_ll.lane_bases], [conv(b) for b in a_ll.warp_bases],
                                      [], [a_ll.shape[0], a_ll.shape[1] // 32, 2, 4, 4])


@gluon.jit
def _pk_shift(L5: gl.constexpr):
    """The nibble shift 4 h of every (n, c, h, t, i): [1, 1, 2, 1, 1]."""
    h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, L5)))))
    return gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(h * 4, 0), 1), 3), 4)


@gluon.jit
def _pk_decode(q_tile, sh5, L5: gl.constexpr, a_layout: gl.constexpr, HN: gl.constexpr):
    """A K step's word tile q_tile (smem [16, HN], word row 4 c + t) -> PK's e4m3 A operand [HN, 128]. (No K halves:
    a slice of the reshaped tile fails Triton 3.6's lowering.)"""
    C: gl.constexpr = 4
    words = q_tile.reshape((4, 4, HN)).permute((2, 0, 1))  # [HN, c, t]: row 4 c + t
    q = gl.expand_dims(gl.expand_dims(words.load(gl.SliceLayout(2, gl.SliceLayout(4, L5))), 2), 4)
    shape: gl.constexpr = [HN, C, 2, 4, 4]
    a = gl.inline_asm_elementwise(_ASM_PK, "=r,r,r,r,r,r,r,r,r", [q.broadcast_to(shape), sh5.broadcast_to(shape)],
                                  dtype=gl.float8e4nv, is_pure=True, pack=4)
    return gl.convert_layout(gl.reshape(a, (HN, 32 * C)), a_layout)  # a register renaming (same linear layout)


@gluon.jit
def _reduce_store(out, y_ptr, M, N, stride_ym, off_m, off_n, BM: gl.constexpr, BN: gl.constexpr, ATOMIC: gl.constexpr,
                  REDUCE: gl.constexpr, ws_ptr, cnt_ptr, sub, n_sub, pid_k, split_k, L: gl.constexpr):
    """A consumer's [BN, BM] sub-tile `out` (layout L) of y^T (weight rows off_n.., tokens off_m..): stored, or
    atomically added (split-K into a zeroed fp32 y: gemm_wna16_tcg._swap_store), or with REDUCE summed in the kernel:
    each split stores its partial in its own fp32 slab of sub-tile `sub` (of n_sub) straight from the wgmma layout
    (no layout conversion: 8 lanes fill each 32-byte sector of y's row-major order) and takes a ticket on the
    sub-tile's counter; the last one adds the slabs in split order (deterministic) in 32-token chunks, so only a chunk
    is live in registers (the whole-tile conversion and sum spilled: 712 / 1960 stack bytes, offline sm_90a), writes y
    in its dtype and resets the counter."""
    if REDUCE:
        rn = gl.arange(0, BN, layout=gl.SliceLayout(1, L))
        rm = gl.arange(0, BM, layout=gl.SliceLayout(0, L))
        gl.store(ws_ptr + (pid_k * n_sub + sub) * (BM * BN) + gl.expand_dims(rm, 0) * BN + gl.expand_dims(rn, 1), out)
        gl.thread_barrier()  # every thread's partial is written before the ticket (acq_rel) is taken
        ticket = gl.atomic_add(cnt_ptr + sub, 1, sem="acq_rel")
        if ticket == split_k - 1:
            CH: gl.constexpr = 32
            lay: gl.constexpr = gl.BlockedLayout([BN // 32, 1], [32, 1], [1, 4], [0, 1])  # lanes along n: coalesced
            cn = gl.arange(0, BN, layout=gl.SliceLayout(1, lay))
            cm = gl.arange(0, CH, layout=gl.SliceLayout(0, lay))
            offs_n = off_n + cn
            for c in gl.static_range(BM // CH):
                idx = gl.expand_dims(c * CH + cm, 0) * BN + gl.expand_dims(cn, 1)
                tot = gl.zeros([BN, CH], gl.float32, lay)
                for j in range(split_k):  # .cg: the other splits' partials were written through other SMs' L1s
                    tot += gl.load(ws_ptr + (j * n_sub + sub) * (BM * BN) + idx, cache_modifier=".cg")
                offs_m = off_m + c * CH + cm
                gl.store(y_ptr + gl.expand_dims(offs_m, 0) * stride_ym + gl.expand_dims(offs_n, 1),
                         tot.to(y_ptr.dtype.element_ty),
                         mask=gl.expand_dims(offs_m < M, 0) & gl.expand_dims(offs_n < N, 1))
            gl.atomic_xchg(cnt_ptr + sub, 0, sem="relaxed")  # ready for the next call
    else:
        _swap_store(out, y_ptr, M, N, stride_ym, off_m, off_n, BM, BN, ATOMIC, False, 4)


@gluon.jit
def _w4a8_consume(x_smem, q_smem, ready, empty, s_ptr, as_ptr, y_ptr, M, N, stride_ym, off_m, off_n, s0, cnt,
                  GSTEPS: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr, HN: gl.constexpr, STAGES: gl.constexpr,
                  ATOMIC: gl.constexpr, MH: gl.constexpr, KH: gl.constexpr = False, PP: gl.constexpr = False,
                  PK: gl.constexpr = False, REDUCE: gl.constexpr = False, ws_ptr=None, cnt_ptr=None, pid=0, pid_k=0,
                  split_k=1, n_sub=1):
    """One of the two consumer warpgroups (its own partition): weight rows off_n + H * HN .. + HN of the tile from
    its half of each K step's words; per step decode, wgmma (unscaled, fresh), wait, acc += product * group scale,
    release the slot (one of the two arrivals its empty barrier counts); then the per-token scales and y.
    MH = BLOCK_M // 2 (token halves): one decode feeds two wgmma, tokens [0, MH) and [MH, BLOCK_M) of the x tile,
    each into the same fresh product p and added to its own accumulator; the decode (half of a step's
    instructions at 128 tokens) is paid once per 256 tokens, and p + two accumulators fit where two full-width
    ones (256-token acc + p) would not.
    KH (with token halves): the step's A as two K halves in their own registers, the second half decoded while the
    first half's wgmma runs (_fold_consume's KH scheme).
    PP: the two warpgroups' wgmma issues in turn (_pp_turn), one turn per wgmma group (token half).
    PK: the activations' K permuted within each 128 (_ASM_PK): the integer-only decode of one word per register.
    REDUCE (split-K): the splits' partials summed in the kernel (_reduce_store)."""
    gl.assume(cnt > 0)  # the kernel's assumption does not reach into the partition
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, MH, 32])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=4)
    NF: gl.constexpr = 4 if KH else 8  # fields per decode
    L3: gl.constexpr = _decode_layout8(gl.to_linear_layout(a_layout, [HN, NF * R]))
    srow: gl.constexpr = gl.SliceLayout(1, mma_layout)
    n0 = off_n + H * HN
    sel, sh, _ = _field_consts(L3, NF, 0)
    sel1, sh1, _ = _field_consts(L3, NF, 4)  # (KH: the second half)
    gl.static_assert(not (PK and KH), "PK decodes whole K steps")
    L5: gl.constexpr = _decode_layout5(gl.to_linear_layout(a_layout, [HN, BK]))
    sh5 = _pk_shift(L5)
    s_offs = n0 + gl.arange(0, HN, layout=srow)
    HALVES: gl.constexpr = BLOCK_M // MH
    acc = gl.zeros((HN, MH), dtype=gl.float32, layout=mma_layout)
    acc2 = gl.zeros((HN, MH), dtype=gl.float32, layout=mma_layout)  # tokens [MH, 2 MH) (unused when HALVES 1)
    p = gl.zeros((HN, MH), dtype=gl.float32, layout=mma_layout)
    sc_next = gl.load(s_ptr + (s0 // GSTEPS) * N + s_offs)
    _pp_start(H, PP)
    for i in range(cnt):
        slot = i % STAGES
        # the group scales one step ahead: their load's latency stays off the step that uses them
        sc = sc_next.to(gl.float32)
        if PK:
            sc = sc * 512.0  # PK's e4m3 weights are (c - 8) 2^-9
        sc_next = gl.load(s_ptr + ((s0 + gl.minimum(i + 1, cnt - 1)) // GSTEPS) * N + s_offs)
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        xs = x_smem.index(slot)
        if PK:
            a = _pk_decode(q_smem.index(2 * slot + H), sh5, L5, a_layout, HN)
        else:
            q = gl.expand_dims(q_smem.index(2 * slot + H).permute((1, 0)).load(gl.SliceLayout(1, L3)), 1)  # [HN,1,16]
            a = _int4_decode(q, sel, sh, a_layout, HN, NF)
        if KH:
            gl.static_assert(HALVES == 2)
            _pp_turn(H, PP)
            p = warpgroup_mma(a, xs.slice(0, MH).slice(0, BK // 2, dim=1).permute((1, 0)), p, use_acc=False,
                              is_async=True)
            a1 = _int4_decode(q, sel1, sh1, a_layout, HN, NF)  # while the first half's wgmma runs
            p = warpgroup_mma(a1, xs.slice(0, MH).slice(BK // 2, BK // 2, dim=1).permute((1, 0)), p, is_async=True)
            _pp_pass(H, PP)
            p = warpgroup_mma_wait(num_outstanding=0, deps=(p, ))
            acc += p * gl.expand_dims(sc, 1)
            _pp_turn(H, PP)
            p = warpgroup_mma(a, xs.slice(MH, MH).slice(0, BK // 2, dim=1).permute((1, 0)), p, use_acc=False,
                              is_async=True)
            p = warpgroup_mma(a1, xs.slice(MH, MH).slice(BK // 2, BK // 2, dim=1).permute((1, 0)), p,
                              is_async=True)
            _pp_pass(H, PP)
            p = warpgroup_mma_wait(num_outstanding=0, deps=(p, ))
            _keep_alive(a1)
        else:
            if HALVES == 2:
                _pp_turn(H, PP)
                p = warpgroup_mma(a, xs.slice(0, MH).permute((1, 0)), p, use_acc=False, is_async=True)
                _pp_pass(H, PP)
                p = warpgroup_mma_wait(num_outstanding=0, deps=(p, ))
                acc += p * gl.expand_dims(sc, 1)
                xs = xs.slice(MH, MH)
            _pp_turn(H, PP)
            p = warpgroup_mma(a, xs.permute((1, 0)), p, use_acc=False, is_async=True)
            _pp_pass(H, PP)
            p = warpgroup_mma_wait(num_outstanding=0, deps=(p, ))
        _keep_alive(a)
        fence_async_shared()  # the generic-proxy word loads before the loader's TMA (async proxy) refill
        mbarrier.arrive(empty.index(slot))
        if HALVES == 2:
            acc2 += p * gl.expand_dims(sc, 1)
        else:
            acc += p * gl.expand_dims(sc, 1)  # while the other warpgroup's wgmma runs
    _pp_end(H, PP)
    for h in gl.static_range(HALVES):
        rm = off_m + h * MH + gl.arange(0, MH, layout=gl.SliceLayout(0, mma_layout))
        out = acc2 if h == 1 else acc
        out = out * gl.expand_dims(gl.load(as_ptr + rm, mask=rm < M, other=0.0), 0)  # per-token activation scales
        _reduce_store(out, y_ptr, M, N, stride_ym, off_m + h * MH, n0, MH, HN, ATOMIC, REDUCE, ws_ptr, cnt_ptr,
                      (pid * 2 + H) * HALVES + h, n_sub, pid_k, split_k, mma_layout)


@gluon.jit
def _w4a8_tcg_kernel(x_desc, q_desc, s_ptr, as_ptr, y_ptr, M, N, K, stride_ym, split_k, GSTEPS: gl.constexpr,
                     BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, ATOMIC: gl.constexpr, STAGES: gl.constexpr,
                     CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
                     MH: gl.constexpr = 0, KH: gl.constexpr = False, PP: gl.constexpr = False,
                     PK: gl.constexpr = False, REDUCE: gl.constexpr = False, ws_ptr=None, cnt_ptr=None, n_sub=1):
    """y[M, N] (+= with ATOMIC, split_k > 1) = a_scale[m] * sum_k x[m, k] (c[k, n] - 8) s[k // group, n];
    GSTEPS = group // 128 (K // 128 per channel; a constant: no integer division per K step). Launched with
    num_warps = 4: two consumer warpgroups in two partitions plus a loader warp (gemm_wna16_tcg._swap_load_halves:
    x tile + both halves of the words)."""
    pid, pid_k, off_m, off_n, s0, cnt = _tile_and_split(M, K, split_k, BLOCK_M, BLOCK_N)
    gl.assume(cnt > 0)
    HN: gl.constexpr = BLOCK_N // 2
    TOK: gl.constexpr = MH if MH > 0 else BLOCK_M
    x_smem, q_smem, ready, empty = _halves_ring(x_desc, q_desc, gl.float8e4nv, BLOCK_M, HN, STAGES)
    gl.warp_specialize([
        (_w4a8_consume, (x_smem, q_smem, ready, empty, s_ptr, as_ptr, y_ptr, M, N, stride_ym, off_m, off_n, s0, cnt,
                         GSTEPS, 0, BLOCK_M, HN, STAGES, ATOMIC, TOK, KH, PP, PK, REDUCE, ws_ptr, cnt_ptr, pid, pid_k,
                         split_k, n_sub)),
        (_w4a8_consume, (x_smem, q_smem, ready, empty, s_ptr, as_ptr, y_ptr, M, N, stride_ym, off_m, off_n, s0, cnt,
                         GSTEPS, 1, BLOCK_M, HN, STAGES, ATOMIC, TOK, KH, PP, PK, REDUCE, ws_ptr, cnt_ptr, pid, pid_k,
                         split_k, n_sub)),
        (_swap_load_halves, (x_desc, q_desc, x_smem, q_smem, ready, empty, off_m, off_n, s0, cnt, STAGES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# MXFP4: 4 elements (word rows r .. r + 3 of one field) -> 4 e4m3 of code x 2^-down in one register: the e2m1
# nibble's sign to bit 15 and (e1 e0 m) to bits 11..9 of an f16 (= value x 2^-14, an e2m1 subnormal on an f16
# subnormal), times $13 / $14 = f16x2 2^(14 - down) (exact, down <= FOLD_SPAN), cvt (exact: lowbit_tma.mxfp4_fold_to_fp8's
# argument); $5 / $9 as in _ASM_E4M3
_ASM_FP4_E4M3 = gl.constexpr(
    "{ .reg .b32 a, b, c; .reg .b16 lo, hi; "
    "prmt.b32 a, $1, $2, $5; shr.u32 a, a, $9; shl.b32 b, a, 9; and.b32 b, b, 0x0E000E00; shl.b32 c, a, 12; "
    "lop3.b32 b, b, c, 0x80008000, 0xF8; mul.rn.f16x2 b, b, $13; cvt.rn.satfinite.e4m3x2.f16x2 lo, b; "
    "prmt.b32 a, $3, $4, $5; shr.u32 a, a, $9; shl.b32 b, a, 9; and.b32 b, b, 0x0E000E00; shl.b32 c, a, 12; "
    "lop3.b32 b, b, c, 0x80008000, 0xF8; mul.rn.f16x2 b, b, $14; cvt.rn.satfinite.e4m3x2.f16x2 hi, b; "
    "mov.b32 $0, {lo, hi}; }")


@gluon.jit
def _fold_fields(L3: gl.constexpr, N, n0, HN: gl.constexpr, NF: gl.constexpr, F0: gl.constexpr):
    """_field_consts of fields F0 .. F0 + NF - 1 and the offsets of their groups' multipliers (group 4 s +
    field // 2, [HN, NF, 1])."""
    sel, sh, f = _field_consts(L3, NF, F0)
    m_offs = (gl.expand_dims(gl.expand_dims(n0 + gl.arange(0, HN, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3))),
                                            1), 2) + gl.expand_dims(gl.expand_dims(f // 2, 0), 2) * N)
    return sel, sh, m_offs


@gluon.jit
def _fold_decode(q, sel, sh, mult, a_layout: gl.constexpr, HN: gl.constexpr, NF: gl.constexpr):
    """NF fields of a K step's words q [HN, 1, 16] with their multipliers (int16 f16 bits) -> e4m3 A [HN, 16 NF]."""
    shape: gl.constexpr = [HN, NF, R]
    a = gl.inline_asm_elementwise(_ASM_FP4_E4M3, "=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
                                  [q.broadcast_to(shape), sel.broadcast_to(shape), sh.broadcast_to(shape),
                                   mult.to(gl.float16, bitcast=True).broadcast_to(shape)], dtype=gl.float8e4nv,
                                  is_pure=True, pack=4)
    return gl.convert_layout(gl.reshape(a, (HN, NF * R)), a_layout)  # a register renaming (same linear layout)


@gluon.jit
def _fold_consume(x_smem, q_smem, ready, empty, m_ptr, cs_ptr, as_ptr, y_ptr, M, N, stride_ym, off_m, off_n, s0,
                  cnt, H: gl.constexpr, BLOCK_M: gl.constexpr, HN: gl.constexpr, STAGES: gl.constexpr,
                  ATOMIC: gl.constexpr, KH: gl.constexpr, PP: gl.constexpr = False, REDUCE: gl.constexpr = False,
                  ws_ptr=None, cnt_ptr=None, pid=0, pid_k=0, split_k=1, n_sub=1):
    """_w4a8_consume for MXFP4 with the group scales folded into the decoded e4m3 weights (m_ptr: f16 bits of
    2^(14 - down), [K // 32, N], loaded a step ahead: the decode needs them): no per-group rescale, so each K
    step's wgmma adds into one accumulator chain of the whole BLOCK_M-token width (one decode per BLOCK_M tokens);
    the channel scales cs_ptr (2^base) and per-token scales go on in the epilogue.
    KH: each K step as two wgmma on its K halves, each half's A in its own registers, the second half decoded while
    the first half's wgmma runs, both retired per step (a wait(1) form carrying an A set over the loop's back edge
    made ptxas serialise every wgmma, C7512)."""
    gl.assume(cnt > 0)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_M, 32])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=4)
    NF: gl.constexpr = 4 if KH else 8  # fields per decode
    L3: gl.constexpr = _decode_layout8(gl.to_linear_layout(a_layout, [HN, NF * R]))
    n0 = off_n + H * HN
    sel0, sh0, m_offs0 = _fold_fields(L3, N, n0, HN, NF, 0)
    sel1, sh1, m_offs1 = _fold_fields(L3, N, n0, HN, NF, 4)  # (KH: the second half)
    acc = gl.zeros((HN, BLOCK_M), dtype=gl.float32, layout=mma_layout)
    m_next0 = gl.load(m_ptr + s0 * 4 * N + m_offs0)
    m_next1 = gl.load(m_ptr + s0 * 4 * N + m_offs1) if KH else m_next0
    _pp_start(H, PP)
    for i in range(cnt):
        slot = i % STAGES
        mult0 = m_next0
        mult1 = m_next1
        m_row = m_ptr + (s0 + gl.minimum(i + 1, cnt - 1)) * 4 * N
        m_next0 = gl.load(m_row + m_offs0)
        if KH:
            m_next1 = gl.load(m_row + m_offs1)
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        q = gl.expand_dims(q_smem.index(2 * slot + H).permute((1, 0)).load(gl.SliceLayout(1, L3)), 1)  # [HN,1,16]
        xs = x_smem.index(slot)
        a = _fold_decode(q, sel0, sh0, mult0, a_layout, HN, NF)
        _pp_turn(H, PP)
        if KH:
            acc = warpgroup_mma(a, xs.slice(0, BK // 2, dim=1).permute((1, 0)), acc, is_async=True)
            a1 = _fold_decode(q, sel1, sh1, mult1, a_layout, HN, NF)  # while the first half's wgmma runs
            acc = warpgroup_mma(a1, xs.slice(BK // 2, BK // 2, dim=1).permute((1, 0)), acc, is_async=True)
            _pp_pass(H, PP)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            _keep_alive(a1)
        else:
            acc = warpgroup_mma(a, xs.permute((1, 0)), acc, is_async=True)
            _pp_pass(H, PP)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        _keep_alive(a)
        fence_async_shared()  # the generic-proxy word loads before the loader's TMA (async proxy) refill
        mbarrier.arrive(empty.index(slot))
    _pp_end(H, PP)
    srow: gl.constexpr = gl.SliceLayout(1, mma_layout)
    rm = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_layout))
    acc = (acc * gl.expand_dims(gl.load(cs_ptr + n0 + gl.arange(0, HN, layout=srow)), 1)
           * gl.expand_dims(gl.load(as_ptr + rm, mask=rm < M, other=0.0), 0))
    _reduce_store(acc, y_ptr, M, N, stride_ym, off_m, n0, BLOCK_M, HN, ATOMIC, REDUCE, ws_ptr, cnt_ptr, pid * 2 + H,
                  n_sub, pid_k, split_k, mma_layout)


@gluon.jit
def _w4a8_fold_kernel(x_desc, q_desc, m_ptr, cs_ptr, as_ptr, y_ptr, M, N, K, stride_ym, split_k,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, ATOMIC: gl.constexpr, STAGES: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
                      KH: gl.constexpr = False, PP: gl.constexpr = False, REDUCE: gl.constexpr = False,
                      ws_ptr=None, cnt_ptr=None, n_sub=1):
    """y[M, N] (+= with ATOMIC) = a_scale[m] * cs[n] * sum_k x[m, k] e2m1(c[k, n]) 2^-down[k // 32, n]: the MXFP4
    twin's codes with mxfp4_fold_base's exponents; the warp-specialised layout of _w4a8_tcg_kernel (KH: the
    consumers' K-halves loop, _fold_consume)."""
    pid, pid_k, off_m, off_n, s0, cnt = _tile_and_split(M, K, split_k, BLOCK_M, BLOCK_N)
    gl.assume(cnt > 0)
    HN: gl.constexpr = BLOCK_N // 2
    x_smem, q_smem, ready, empty = _halves_ring(x_desc, q_desc, gl.float8e4nv, BLOCK_M, HN, STAGES)
    gl.warp_specialize([
        (_fold_consume, (x_smem, q_smem, ready, empty, m_ptr, cs_ptr, as_ptr, y_ptr, M, N, stride_ym, off_m, off_n,
                         s0, cnt, 0, BLOCK_M, HN, STAGES, ATOMIC, KH, PP, REDUCE, ws_ptr, cnt_ptr, pid, pid_k, split_k,
                         n_sub)),
        (_fold_consume, (x_smem, q_smem, ready, empty, m_ptr, cs_ptr, as_ptr, y_ptr, M, N, stride_ym, off_m, off_n,
                         s0, cnt, 1, BLOCK_M, HN, STAGES, ATOMIC, KH, PP, REDUCE, ws_ptr, cnt_ptr, pid, pid_k, split_k,
                         n_sub)),
        (_swap_load_halves, (x_desc, q_desc, x_smem, q_smem, ready, empty, off_m, off_n, s0, cnt, STAGES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# split-K (M = 256 on the 70B shapes: pick_tile / the tuned winners split 2 or 4) summed in the kernel (_reduce_store:
# fp32 slabs + a ticket counter per sub-tile, the last split writes y in its dtype) instead of fp32 atomics into a
# zeroed y and a cast launch: two launches and the zero fill less. Opt-in until GPU-timed.
REDUCE = os.environ.get("KESTREL_W4A8_TCG_REDUCE", "0") == "1"

# (consumer, loader) register budgets (setmaxnreg): the loader at 120 left a 16-byte stack on 128x128 (offline
# sm_90a compile, bench/w4a8_tcg_compile.py), at 40 none
WS_REGS = (232, 40)


def supported(a_q: torch.Tensor | None, N: int, K: int, block_n: int = 128, device=None) -> bool:
    """A Hopper GPU, fp8 activations whose rows TMA can read (a_q None: ones still to be quantized, on `device`),
    N a multiple of the tile, K of 128."""
    device = a_q.device if a_q is not None else torch.device(device)
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9 and N % block_n == 0
            and K % 128 == 0 and (a_q is None or (a_q.is_contiguous() and a_q.data_ptr() % 16 == 0)))


def _wave_split(tiles: int, sms: int) -> int:
    """K splits (1 / 2 / 4) doubled while a grid of `tiles` CTAs stays under one wave."""
    split = 1
    while tiles * split * 2 <= sms and split < 4:
        split *= 2
    return split


def pick_tile(M: int, N: int, K: int, sms: int, block_n: int = 128) -> tuple[int, int, int]:
    """(block_m, mh, split_k) by heuristic: 256-token tiles in two halves (one decode per 256 tokens) once M fills
    them, split over K while the grid is under one wave (nonempty_split keeps every split's K steps)."""
    block_m, mh = (256, 128) if M > 128 else (128, 0)
    return block_m, mh, nonempty_split(_wave_split(-(-M // block_m) * (N // block_n), sms), K // BK.value)


def _sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if torch.cuda.is_available() else 132


def tile_candidates(M: int, N: int, K: int, sms: int = 132) -> list:
    """`kestrel tune --lowbit w4a8tcg-*`'s search space as GemmConfigs (BM = token tile, 256 in two halves for
    int4; SPLIT_K; num_stages): pick_tile's choice first (the launch's untuned default)."""
    from kestrel.kernels.lowbit_gemm import GemmConfig
    bm, _, sp = pick_tile(M, N, K, sms)
    first = GemmConfig(BM=bm, BN=128, BK=128, SPLIT_K=sp, num_warps=4, num_stages=4)
    rest = [GemmConfig(BM=b, BN=128, BK=128, SPLIT_K=nonempty_split(k, K // BK.value), num_warps=4, num_stages=st)
            for b in (128, 256) for k in (1, 2, 4) for st in (3, 4)]
    return list(dict.fromkeys([first] + rest))


def _tuned(kind: str, M: int, N: int, K: int, block_m, split_k, stages):
    """(block_m, split_k, stages): the tune cache's `kind` winner where none of the three was given, else as given
    (None where the caller's heuristic decides). This shape's own entry only: the split and tile follow from this N's
    tile count against the SMs (pick_tile), so a neighbour's are no guide. With the nearest shape, 4096x14336 M = 256
    would take 8192x8192's 128-token tile, split 1 (61.3 us, H100 s22) over pick_tile's 256 split 4 (43.3)."""
    if block_m is None and split_k is None and stages is None:
        from kestrel.kernels.lowbit_tune import lookup
        cfg = lookup(kind, M, N, K, nearest=False)
        if cfg is not None:
            return cfg.BM, cfg.SPLIT_K, cfg.num_stages
    return block_m, split_k, stages


def _launch(kernel, a_q, a_scale, qw, lead: tuple, tail: tuple, block_m: int, block_n: int, split_k: int,
            stages: int, out_dtype, **consts) -> torch.Tensor:
    """Both Gluon kernels' launch: the x / word TMA descriptors, K split to non-empty parts (summed in the kernel
    with REDUCE, else fp32 atomics into a zeroed y, then a cast), the (tile, split) grid. lead / tail: the kernel's
    own arguments before a_scale and after split_k."""
    M, K = a_q.shape
    N = qw.shape[0]
    lay = gl.NVMMASharedLayout.get_default_for
    x_desc = TensorDescriptor.from_tensor(a_q, [block_m, BK.value], lay([block_m, BK.value], gl.float8e4nv))
    hn = block_n // 2
    q_desc = TensorDescriptor.from_tensor(qw.qweight, [R.value, hn], lay([R.value, hn], gl.int32))
    split_k = nonempty_split(split_k, K // BK.value)
    grid = (-(-M // block_m) * (N // block_n), split_k)
    reduce = REDUCE and split_k > 1
    atomic = split_k > 1 and not reduce
    y = (torch.zeros if atomic else torch.empty)((M, N), device=a_q.device,
                                                    dtype=torch.float32 if atomic else out_dtype)
    # REDUCE: a workspace slab per (split, sub-tile): each consumer warpgroup stores its rows, in token halves
    mh = consts.get("MH", 0)
    n_sub = grid[0] * 2 * (2 if 0 < mh < block_m else 1)
    # (without REDUCE the kernel never touches ws / cnt: y and the cached counters stand in, nothing is allocated)
    ws = torch.empty(split_k * grid[0] * block_m * block_n, device=a_q.device, dtype=torch.float32) if reduce else y
    cnt = _split_counters(a_q.device, n_sub if reduce else 1)
    kernel[grid](x_desc, q_desc, *lead, a_scale.float().reshape(M).contiguous(), y, M, N, K, y.stride(0), split_k,
                 *tail, BLOCK_M=block_m, BLOCK_N=block_n, ATOMIC=atomic, STAGES=stages,
                 CONSUMER_REGS=WS_REGS[0], LOADER_REGS=WS_REGS[1], num_warps=4, REDUCE=reduce, ws_ptr=ws,
                 cnt_ptr=cnt, n_sub=n_sub, **consts)
    return y.to(out_dtype) if atomic else y


def gemm_w4a8_tcg(a_q: torch.Tensor, a_scale: torch.Tensor, qw, out_dtype=torch.bfloat16, block_m: int | None = None,
                  block_n: int = 128, stages: int | None = None, split_k: int | None = None, mh: int | None = None,
                  kh: bool = False, pp: bool = False, a_perm: bool = False) -> torch.Tensor:
    """a_q fp8 [M, K] (per-token a_scale [M]) x the planar int4 QuantizedWeight qw [N, K] (symmetric, bf16 scales,
    group a multiple of 128 or per channel) -> [M, N]. block_m / split_k / stages all None: the tune cache's
    "w4a8tcg-int4" winner, else pick_tile's choice; mh None: two token halves (block_m // 2) for 256-token tiles,
    0 = one; kh (with token halves): the K-halves consumer; pp: the consumers' wgmma issues in turn (_pp_turn);
    a_perm: a_q from act_quant.quant_fp8(perm=True) (K permuted within each 128: the PK decode)."""
    M, K = a_q.shape
    N = qw.shape[0]
    block_m, split_k, stages = _tuned("w4a8tcg-int4", M, N, K, block_m, split_k, stages)
    if block_m is None or split_k is None:
        bm, _, sp = pick_tile(M, N, K, _sms(a_q.device), block_n)
        block_m = bm if block_m is None else block_m
        split_k = sp if split_k is None else split_k
    mh = (block_m // 2 if block_m == 256 else 0) if mh is None else mh
    if mh and block_m != 2 * mh:
        raise ValueError(f"mh {mh}: the token halves split block_m {block_m} in two")
    if a_perm and kh and mh:
        raise ValueError("a_perm (the PK decode) takes whole K steps: no kh")
    return _launch(_w4a8_tcg_kernel, a_q, a_scale, qw, (qw.scales, ), (qw.group_size // BK.value, ), block_m,
                   block_n, split_k, 4 if stages is None else stages, out_dtype, MH=mh, KH=bool(kh and mh), PP=pp,
                   PK=a_perm)


def fold_multipliers(down: torch.Tensor) -> torch.Tensor:
    """mxfp4_fold_base's down exponents [N, K // 32] (0 .. FOLD_SPAN) -> the f16 bits of 2^(14 - down) [K // 32, N]
    int16 (_ASM_FP4_E4M3's multiplier: exponent field 14 - down + 15)."""
    return ((29 - down.to(torch.int32)) << 10).to(torch.int16).t().contiguous()


def gemm_w4a8_fold_tcg(a_q: torch.Tensor, a_scale: torch.Tensor, qw, mult: torch.Tensor, chan: torch.Tensor,
                       out_dtype=torch.bfloat16, block_m: int | None = None, block_n: int = 128,
                       stages: int | None = None, split_k: int | None = None, kh: bool = False,
                       pp: bool = False) -> torch.Tensor:
    """a_q fp8 [M, K] (per-token a_scale [M]) x the MXFP4 planar twin qw [N, K] with its group scales folded
    (mult = fold_multipliers(down), chan [N] fp32 channel scales: W4Weight.fold_base) -> [M, N]. block_m /
    split_k / stages all None: the tune cache's "w4a8tcg-mxfp4" winner, else 256 tokens, 4 stages and split_k
    doubled while the grid is under one wave; kh: the K-halves consumer; pp: wgmma issues in turn."""
    M, K = a_q.shape
    N = qw.shape[0]
    block_m, split_k, stages = _tuned("w4a8tcg-mxfp4", M, N, K, block_m, split_k, stages)
    block_m = 256 if block_m is None else block_m
    if split_k is None:
        split_k = _wave_split(-(-M // block_m) * (N // block_n), _sms(a_q.device))
    return _launch(_w4a8_fold_kernel, a_q, a_scale, qw, (mult, chan), (), block_m, block_n, split_k,
                   4 if stages is None else stages, out_dtype, KH=kh, PP=pp)
