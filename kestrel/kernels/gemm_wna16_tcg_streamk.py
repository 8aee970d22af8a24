"""Stream-K schedule of the swap-AB Gluon WNA16 kernel (cfg.streamk): a persistent grid of one CTA per SM.

Why (session 9, issue #3): Humming's Hopper kernel runs a persistent grid that gives the whole waves of output
tiles one per CTA and spreads the leftover tiles' K steps evenly over every CTA (stream-K; with a thin leftover it
also folds one whole wave into the stream-K part), so no SM idles in the last wave. Our 128x128 swap tile runs one
wave of 132 tiles of 70B qkv M = 256 in 56.6 us, but the 160 tiles need 2 waves (113 us) unsplit, and split-K 4 pays
a zeroed fp32 y, atomics and a cast (93 us); Humming: 66 us, ~ the 160 / 132-wave ideal (69 us).

Schedule (plan() on the host, the same arithmetic in the kernel): tiles [0, n_dp) are data-parallel, program p
runs p, p + P, ... over all K; the n_sk tiles after them have n_sk * S K steps (S = K / 128) cut into P ranges of
`per` consecutive steps, program p taking [p per, (p + 1) per), which crosses tile boundaries. A tile covered by one
range stores y; one shared by several ranges goes through the ticketed in-kernel reduction of _swap_store (each
range its fp32 slab, the last to arrive sums them: no waiting on another CTA, so no deadlock whatever the
residency). Own design; the schedule idea is the one of Stream-K (Osama et al. 2023) and Humming's scheduler.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from kestrel.kernels.gemm_wna16_tcg import BK, _decode_layout, _swap_kloop, _swap_ring, _swap_store


def plan(tiles: int, steps: int, num_sms: int, fold: bool = True) -> tuple[int, int, int, int]:
    """-> (programs, n_dp, per, max_parts): n_dp data-parallel tiles (whole waves of `programs`), the rest split in
    ranges of `per` K steps, at most max_parts ranges on one tile. fold: a leftover of at most a third of a wave
    also takes the last whole wave into stream-K (a thin leftover split alone would give each CTA only a few steps;
    but then nearly every tile is shared by 2 CTAs and pays the fp32 slab + ticket fixup). fold=False (cfg.streamk
    3): the whole waves stay data-parallel and only the leftover tiles are spread (each over many CTAs)."""
    p = min(num_sms, tiles * steps)
    n_dp = tiles // p * p
    if fold and n_dp and tiles - n_dp and (tiles - n_dp) * 3 <= p:
        n_dp -= p
    n_sk = tiles - n_dp
    per = -(-n_sk * steps // p) if n_sk else steps
    if not n_dp:  # no program without work (with data-parallel tiles every program has some)
        p = min(p, -(-n_sk * steps // per))
    return p, n_dp, per, -(-steps // per) + 1


@gluon.jit
def _sk_tile(x_desc, q_desc, x_smem, q_smem, bars, s_ptr, N, off_m, off_n, s0, cnt, g, L3: gl.constexpr,
             a_layout: gl.constexpr, mma_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr, CODE_OFFSET: gl.constexpr, FP4: gl.constexpr, num_warps: gl.constexpr,
             LOOP: gl.constexpr):
    """acc[BN, BM] over K steps [s0, s0 + cnt) of one tile. g: K steps this program consumed before (the ring's
    slot and mbarrier phase continue from it across tiles)."""
    gl.assume(cnt > 0)
    fence_async_shared()  # the last tile's generic word loads / wgmma reads of the ring are done in every warp
    gl.thread_barrier()  # ... before one thread refills the ring
    return _swap_kloop(x_desc, q_desc, x_smem, q_smem, bars, s_ptr, N, off_m, off_n, s0, cnt, g, L3, a_layout,
                       mma_layout, BLOCK_M, BLOCK_N, STAGES, CODE_OFFSET, FP4, num_warps, LOOP)


@gluon.jit
def _tcgsk_kernel(x_desc, q_desc, s_ptr, y_ptr, M, N, K, stride_ym, n_dp, per, ws_ptr, cnt_ptr, max_parts,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CODE_OFFSET: gl.constexpr,
                  FP4: gl.constexpr, num_warps: gl.constexpr, ATOMIC: gl.constexpr = False,
                  LOOP: gl.constexpr = 2, OWN: gl.constexpr = False):
    """Persistent swap-AB kernel (see the module doc): data-parallel tiles, then this program's stream-K range.
    ATOMIC (cfg.streamk 2): every tile's partial goes by fp32 atomics into a zeroed y (cast after) instead of the
    ticketed reduction / direct store. LOOP: gemm_wna16_tcg._swap_kloop's K loop (SWAP_LOOP). OWN: the shared
    tiles' last range sums from its own partial in registers (_swap_store, cfg.fixup_own)."""
    p = gl.program_id(0)
    P = gl.num_programs(0)
    S = K // BK
    num_pid_m = gl.cdiv(M, BLOCK_M)
    n_tiles = num_pid_m * (N // BLOCK_N)
    x_smem, q_smem, bars = _swap_ring(x_desc, q_desc, BLOCK_M, BLOCK_N, STAGES)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    L3: gl.constexpr = _decode_layout(gl.to_linear_layout(a_layout, [BLOCK_N, BK]))
    g = 0
    for t in range(p, n_dp, P):  # data-parallel: whole tiles
        off_m = (t % num_pid_m) * BLOCK_M
        off_n = (t // num_pid_m) * BLOCK_N
        acc = _sk_tile(x_desc, q_desc, x_smem, q_smem, bars, s_ptr, N, off_m, off_n, 0, S, g, L3, a_layout,
                       mma_layout, BLOCK_M, BLOCK_N, STAGES, CODE_OFFSET, FP4, num_warps, LOOP)
        g += S
        _swap_store(acc, y_ptr, M, N, stride_ym, off_m, off_n, BLOCK_M, BLOCK_N, ATOMIC, FP4, num_warps)
    T = (n_tiles - n_dp) * S  # stream-K steps
    lo = gl.minimum(p * per, T)
    hi = gl.minimum(lo + per, T)
    for u in range(lo // S, (hi + S - 1) // S):  # the stream-K tiles this range touches (none when lo == hi)
        a0 = gl.maximum(lo, u * S)
        a1 = gl.minimum(hi, (u + 1) * S)
        first = (u * S) // per  # the ranges that cover tile u: first .. last
        parts = ((u + 1) * S - 1) // per - first + 1
        t = n_dp + u
        off_m = (t % num_pid_m) * BLOCK_M
        off_n = (t // num_pid_m) * BLOCK_N
        acc = _sk_tile(x_desc, q_desc, x_smem, q_smem, bars, s_ptr, N, off_m, off_n, a0 - u * S, a1 - a0, g, L3,
                       a_layout, mma_layout, BLOCK_M, BLOCK_N, STAGES, CODE_OFFSET, FP4, num_warps, LOOP)
        g += a1 - a0
        if ATOMIC:
            _swap_store(acc, y_ptr, M, N, stride_ym, off_m, off_n, BLOCK_M, BLOCK_N, True, FP4, num_warps)
        elif parts == 1:
            _swap_store(acc, y_ptr, M, N, stride_ym, off_m, off_n, BLOCK_M, BLOCK_N, False, FP4, num_warps)
        else:  # slab (part, u) of max_parts x n_sk; counter u
            _swap_store(acc, y_ptr, M, N, stride_ym, off_m, off_n, BLOCK_M, BLOCK_N, False, FP4, num_warps, True,
                        ws_ptr, cnt_ptr, u, n_tiles - n_dp, p - first, parts, OWN)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def launch(x_desc, q_desc, qw, x2: torch.Tensor, cfg, num_sms: int) -> torch.Tensor:
    """y [M, N] bf16 of the stream-K schedule (cfg: block_m, block_n, num_warps, num_stages; split_k unused;
    streamk 1 / 3: the ticketed reduction, 3 without plan's fold; 2: fp32 atomics)."""
    from kestrel.kernels import gemm_wna16_tcg as tcg
    from kestrel.kernels.gemm_wna16_tc import _split_counters
    m, k = x2.shape
    n = qw.shape[0]
    bm, bn = cfg.block_m, cfg.block_n
    tiles = -(-m // bm) * (n // bn)
    progs, n_dp, per, max_parts = plan(tiles, k // BK.value, num_sms, fold=cfg.streamk != 3)
    n_sk = tiles - n_dp
    atomic = cfg.streamk == 2
    y = torch.zeros((m, n), device=x2.device, dtype=torch.float32) if atomic else torch.empty(
        (m, n), device=x2.device, dtype=x2.dtype)
    wsp = torch.empty(max(1, max_parts * n_sk * bm * bn), device=x2.device, dtype=torch.float32)
    _tcgsk_kernel[(progs, )](x_desc, q_desc, qw.scales, y, m, n, k, y.stride(0), n_dp, per, wsp,
                             _split_counters(x2.device, max(1, n_sk)), max_parts, BLOCK_M=bm, BLOCK_N=bn,
                             STAGES=cfg.num_stages, CODE_OFFSET=qw.spec.code_offset,
                             FP4=qw.spec.weight_dtype == "fp4_e2m1", num_warps=cfg.num_warps, ATOMIC=atomic,
                             LOOP=tcg.SWAP_LOOP, OWN=bool(cfg.fixup_own))
    return y.to(x2.dtype) if atomic else y
