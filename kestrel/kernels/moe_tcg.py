"""Grouped MoE GEMM for planar int4 g128 experts (moe_mv.PlanarW4) at large token counts, in Gluon: the decode of
K step s+1 overlaps the asynchronous wgmma of step s ("tcg": the dense gemm_wna16_tcg.py loop, adapted to experts).

Why: moe_tc.py (Triton) decodes the weight tile into shared memory and waits on each wgmma right away (Triton 3.6
does not pipeline a dot whose operand is computed in the loop), so decode and MMA serialise inside a CTA; at
M = 1024 it reached 0.57x of Humming's MoE GEMM on Qwen3-30B-A3B's up projection (bench/results/moe_h200_run6.md).
Here the loop is written out as in the dense tcg kernel: a ring of STAGES loads, the decoded W tile double-buffered
in shared memory, warpgroup_mma(is_async) + warpgroup_mma_wait(1).

Differences from the dense kernel: the x rows of an expert block are gathered (token ids from moe_align), so x is
loaded with cp.async (one commit group per K step; TMA cannot gather on Hopper); the packed words and the fp32 group
scales come by TMA from 2-D views [E * K / 8, N] / [E * K / 128, N] at the expert's row offset. Epilogue as moe_tc:
routing weight, bf16 store into the slot rows or relaxed fp32 atomics into token rows (reduce_k).

Numerics as moe_tc DEC 1/2: (c - 8) * bf16(scale) rounded to bf16 once (packed bf16x2 PTX), fp32 accumulation.
GPU only (no interpreter for Gluon): moe_gemm falls back to moe_tc where `supports` is false.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kestrel.kernels import gemm_wna16_tcg as dense
# the dense kernel's planar block (16 word rows = 128 k), pair decode and wgmma layout: one copy for both
from kestrel.kernels.gemm_wna16_tcg import BK, R, _ASM_PAIR, _mma_layout
from kestrel.kernels.moe_mv import BLOCK_K, PlanarW4

@dataclass(frozen=True)
class TcgConfig:
    """compute config of the grouped Gluon kernel (BM = rows per expert block, shared with moe_align)."""
    BM: int = 64
    BN: int = 128
    num_warps: int = 8
    num_stages: int = 3  # depth of the load ring (x by cp.async, words + scales by TMA)
    GROUP_M: int = 8  # expert blocks that walk the N tiles together (0: all blocks of one N tile first)
    SWAP: int = 0  # 1: W decoded straight into the wgmma's register A operand, x^T the shared B (_moe_tcgs_kernel);
    # 2: the same as the dense swap kernel's loop (_moe_tcgp_kernel: one wgmma kept in flight, scales prefetched)
    REFILL: int = 0  # swapped kernel: 1 refills the previous step's ring slot after the pre-MMA barrier (one CTA
    # barrier per step instead of two). BROKEN on the H200 (err 0.25, session 4 R2): `supports` refuses it
    MAXNREG: int = 0  # > 0: register cap per thread (ptxas maxnreg), e.g. 128 for 2 CTAs of 8 warps per SM
    PROBE: int = 0  # SWAP 2 timing probe, WRONG results (benches only; `supports` refuses it): 1 skips the decode
    # (a constant A operand), 2 skips the per-step wgmma (decode kept alive by a sum, one wgmma at the end): which of
    # decode and MMA bounds the loop
    PERSIST: int = 0  # SWAP 2: 1 = one program per SM walking its tiles through one load ring (_moe_tcgq_kernel)
    WS: int = 0  # SWAP 2: 1 = a loader partition feeds the ring, mbarrier hand-over (_moe_tcgw_kernel); 2 the same
    # without the fence before the slot release (one partition barrier a step instead of two)
    LOOP: int = 0  # SWAP 2 (tcgp / WS): 2 = the K loop without the register-A race (two wgmma a step, each A
    # rewritten only after its wgmma retired: _ws_consume_halves, _tcgp_kloop2; WS needs BN >= 32 warps); 0 = the
    # one-A loop of sessions 5-10 (writes the in-flight wgmma's A registers: right on the H200 so far by ptxas'
    # schedule only)
    SPLIT_K = 1  # no K split (class constant, as TcConfig)

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> "TcgConfig":
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@gluon.jit
def _issue(q_desc, s_desc, bar, q_buf, s_buf, x_buf, x_ptrs, qrow0, srow0, off_n, step, pred):
    """step's loads into one ring slot: words + scales by TMA (on bar), the gathered x rows by cp.async (one
    commit group, committed even when pred is false so the group count stays one per step)."""
    mbarrier.expect(bar, q_desc.block_type.nbytes + s_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(q_desc, [qrow0 + step * R, off_n], bar, q_buf, pred=pred)
    tma.async_copy_global_to_shared(s_desc, [srow0 + step, off_n], bar, s_buf, pred=pred)
    async_copy.async_copy_global_to_shared(x_buf, x_ptrs + step * BK, mask=gl.full(x_ptrs.shape, 1, gl.int1,
                                                                                  x_ptrs.type.layout) & pred)
    async_copy.commit_group()


@gluon.jit
def _moe_tcg_kernel(x_ptr, q_desc, s_desc, y_ptr, topk_w_ptr, sorted_ptr, expert_ptr, npost_ptr, num_valid, a_div,
                    out_div, N, K, stride_xm, stride_ym, num_m_blocks, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, GROUP_M: gl.constexpr, MUL_ROUTED: gl.constexpr, REDUCE: gl.constexpr,
                    num_warps: gl.constexpr):
    pid_m, pid_n = _block_of(gl.program_id(0), num_m_blocks, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= gl.load(npost_ptr):  # padding blocks past the last expert's run
        return
    expert = gl.load(expert_ptr + pid_m)
    off_n = pid_n * BLOCK_N
    n_steps = K // BK
    gl.assume(n_steps > 0)  # (dense tcg: without it the zero-trip path serialises every wgmma)
    qrow0 = expert * (K // 8)
    srow0 = expert * n_steps

    x_ptrs = _gather_ptrs(x_ptr, sorted_ptr, pid_m * BLOCK_M, num_valid, a_div, stride_xm, BLOCK_M, num_warps)

    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BK], gl.bfloat16)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BK], x_layout)
    q_smem = gl.allocate_shared_memory(gl.int32, [STAGES, R, BLOCK_N], q_desc.layout)
    s_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_N], s_desc.layout)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, BLOCK_N], gl.bfloat16)
    w_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BK, BLOCK_N], w_layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        _issue(q_desc, s_desc, bars.index(i), q_smem.index(i), s_smem.index(i), x_smem.index(i), x_ptrs, qrow0,
               srow0, off_n, i, i < n_steps)

    # decode as gemm_wna16_tcg: [R, 2, 4, BN] (word row, field // 4, field % 4, column), the two fields of a
    # bf16x2 pair in adjacent registers, permuted + reshaped into the [BK, BN] tile for one shared store
    WR: gl.constexpr = 8 if num_warps > 8 else num_warps
    L4: gl.constexpr = gl.BlockedLayout([1, 2, 4, 4], [2, 1, 1, 16], [WR, 1, 1, num_warps // WR], [1, 3, 2, 0])
    q_layout: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L4))
    j_layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4)))
    jsh = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=j_layout) * 4, 0), 1), 3)
    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
    for i in range(n_steps):
        slot = i % STAGES
        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        q = gl.expand_dims(gl.expand_dims(q_smem.index(slot).load(q_layout), 1), 2)  # [R, 1, 1, BN] int32
        sc = gl.expand_dims(gl.expand_dims(s_smem.index(slot).load(q_layout).to(gl.bfloat16), 1), 2)
        shape: gl.constexpr = [R, 2, 4, BLOCK_N]
        w = gl.inline_asm_elementwise(_ASM_PAIR, "=r,r,r,r,r,r,r",
                                      [q.broadcast_to(shape), jsh.broadcast_to(shape),
                                       gl.full(shape, 136, gl.bfloat16, L4), sc.broadcast_to(shape)],
                                      dtype=gl.bfloat16, is_pure=True, pack=2)
        w = gl.reshape(gl.permute(gl.reshape(w, (R, 8, BLOCK_N)), (1, 0, 2)), (BK, BLOCK_N))
        w_buf = w_smem.index(i % 2)  # read by the wgmma of step i - 2, finished (at most one in flight)
        w_buf.store(w)
        async_copy.wait_group(STAGES - 2)  # this thread's cp.async of step i landed (one group per step)
        fence_async_shared()  # generic-proxy stores / cp.async -> visible to the async-proxy wgmma
        gl.thread_barrier()  # ... from every thread
        acc = warpgroup_mma(x_smem.index(slot), w_buf, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # step i - 1 done: its ring slot is free
        gl.thread_barrier()  # ... in every warpgroup, before the slot is refilled
        nxt = i + STAGES - 1
        ns = nxt % STAGES
        _issue(q_desc, s_desc, bars.index(ns), q_smem.index(ns), s_smem.index(ns), x_smem.index(ns), x_ptrs, qrow0,
               srow0, off_n, nxt, nxt < n_steps)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    async_copy.wait_group(0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    out_layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [WR, num_warps // WR], [1, 0])
    out = gl.convert_layout(acc, out_layout)
    otok = gl.load(sorted_ptr + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_layout)))
    row_ok = otok < num_valid
    offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, out_layout))
    if MUL_ROUTED:
        out = out * gl.expand_dims(gl.load(topk_w_ptr + otok, mask=row_ok, other=0.0), 1)
    mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(offs_n < N, 0)
    if REDUCE:  # each slot into its token's row (zeroed by the host), relaxed fp32 atomics
        y_rows = (otok // out_div).to(gl.int64)
        gl.atomic_add(y_ptr + gl.expand_dims(y_rows * stride_ym, 1) + gl.expand_dims(offs_n, 0), out, mask=mask,
                      sem="relaxed")
    else:
        ptrs = y_ptr + gl.expand_dims(otok.to(gl.int64) * stride_ym, 1) + gl.expand_dims(offs_n, 0)
        gl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _moe_tcgs_kernel(x_ptr, q_desc, s_desc, s_ptr, y_ptr, topk_w_ptr, sorted_ptr, expert_ptr, npost_ptr, num_valid, a_div,
                     out_div, N, K, stride_xm, stride_ym, num_m_blocks, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, MUL_ROUTED: gl.constexpr,
                     REDUCE: gl.constexpr, EARLY_REFILL: gl.constexpr, num_warps: gl.constexpr):
    """acc^T [BN, BM] = W tile (registers, decoded) @ x^T (shared): no shared store of the decoded weights, no
    fence / barrier between decode and MMA for them; the decode of step i + 1 runs while the wgmma of step i does."""
    pid_m, pid_n = _block_of(gl.program_id(0), num_m_blocks, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= gl.load(npost_ptr):
        return
    expert = gl.load(expert_ptr + pid_m)
    off_n = pid_n * BLOCK_N
    n_steps = K // BK
    gl.assume(n_steps > 0)
    qrow0 = expert * (K // 8)
    srow0 = expert * n_steps

    x_ptrs = _gather_ptrs(x_ptr, sorted_ptr, pid_m * BLOCK_M, num_valid, a_div, stride_xm, BLOCK_M, num_warps)

    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BK], gl.bfloat16)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BK], x_layout)
    q_smem = gl.allocate_shared_memory(gl.int32, [STAGES, R, BLOCK_N], q_desc.layout)
    s_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_N], s_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        _issue(q_desc, s_desc, bars.index(i), q_smem.index(i), s_smem.index(i), x_smem.index(i), x_ptrs, qrow0,
               srow0, off_n, i, i < n_steps)

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    L3: gl.constexpr = dense._decode_layout(gl.to_linear_layout(a_layout, [BLOCK_N, BK]))
    sel, zb, s_offs = dense._swap_consts(L3, N, off_n, BLOCK_N, 8, False)  # (the dense swap kernel's decode)
    s_ok = s_offs < N
    s_base = s_ptr + srow0.to(gl.int64) * N + s_offs  # the step's scales straight from global memory (L2)
    acc = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=mma_layout)
    mbarrier.wait(bars.index(0), 0)
    w = dense._swap_a(q_smem.index(0), gl.load(s_base, mask=s_ok, other=0.0).to(gl.bfloat16), sel, zb, L3, a_layout,
                      BLOCK_N, False)
    for i in range(n_steps):
        slot = i % STAGES
        if EARLY_REFILL:  # groups: STAGES (prologue) + one per earlier iteration; step i's is at most STAGES - 2 old
            async_copy.wait_group(STAGES - 2)
        else:
            async_copy.wait_group(STAGES - 1)  # this thread's cp.async of step i landed (one group per step)
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(w, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
        if EARLY_REFILL:
            # past the barrier every warpgroup has finished iteration i - 1 (its wgmma waited, step i decoded), so
            # slot (i - 1) % STAGES is free: refill it here and save the second CTA barrier per step
            ps = (i + STAGES - 1) % STAGES
            _issue(q_desc, s_desc, bars.index(ps), q_smem.index(ps), s_smem.index(ps), x_smem.index(ps), x_ptrs,
                   qrow0, srow0, off_n, i + STAGES - 1, (i > 0) & (i + STAGES - 1 < n_steps))
        # the next step's decode while the wgmma runs (the last iteration decodes its own step again, unused)
        j = gl.minimum(i + 1, n_steps - 1)
        js = j % STAGES
        mbarrier.wait(bars.index(js), (j // STAGES) & 1)
        w_next = dense._swap_a(q_smem.index(js), gl.load(s_base + j * N, mask=s_ok, other=0.0).to(gl.bfloat16), sel,
                               zb, L3, a_layout, BLOCK_N, False)
        acc, w = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w))
        if not EARLY_REFILL:
            gl.thread_barrier()  # every warpgroup done with slot i (x read by the wgmma, words by the decode)
            _issue(q_desc, s_desc, bars.index(slot), q_smem.index(slot), s_smem.index(slot), x_smem.index(slot),
                   x_ptrs, qrow0, srow0, off_n, i + STAGES, i + STAGES < n_steps)
        w = w_next
    async_copy.wait_group(0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    _store_t(acc, y_ptr, topk_w_ptr, sorted_ptr, pid_m * BLOCK_M, off_n, N, num_valid, out_div, stride_ym, BLOCK_M,
             BLOCK_N, MUL_ROUTED, REDUCE, num_warps)


@gluon.jit
def _block_of(pid, num_m_blocks, N, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """(expert block, N tile) of program pid: GROUP_M expert blocks walk the N tiles together (their weight tiles
    shared in the L2, tl.swizzle2d), or (GROUP_M 0) all blocks of one N tile first."""
    num_pid_n = gl.cdiv(N, BLOCK_N)
    if GROUP_M > 0:
        width = GROUP_M * num_pid_n
        first_m = (pid // width) * GROUP_M
        size_m = gl.minimum(num_m_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
    else:
        pid_m = pid % num_m_blocks
        pid_n = pid // num_m_blocks
    return pid_m, pid_n


@gluon.jit
def _gather_ptrs(x_ptr, sorted_ptr, row0, num_valid, a_div, stride_xm, BLOCK_M: gl.constexpr,
                 num_warps: gl.constexpr):
    """pointers to the first K step of the gathered x rows of slots row0 .. row0 + BLOCK_M (padding slots read row
    0): a warp covers 2 rows x 128 k in 16-byte pieces (one cp.async of 16 B per thread and row piece)."""
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, XL))
    tok = gl.load(sorted_ptr + rows)
    a_rows = gl.where(tok < num_valid, tok // a_div, 0).to(gl.int64)
    kx = gl.arange(0, BK, layout=gl.SliceLayout(0, XL))
    return x_ptr + gl.expand_dims(a_rows * stride_xm, 1) + gl.expand_dims(kx, 0)


@gluon.jit
def _issue_xq(q_desc, bar, q_buf, x_buf, x_ptrs, qrow0, off_n, step, pred):
    """step's loads into one ring slot: the words by TMA (on bar), the gathered x rows by cp.async (one commit
    group, committed even when pred is false so the group count stays one per step). The swapped kernels read
    the scales from global memory, so none come through the ring."""
    mbarrier.expect(bar, q_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(q_desc, [qrow0 + step * R, off_n], bar, q_buf, pred=pred)
    async_copy.async_copy_global_to_shared(x_buf, x_ptrs + step * BK, mask=gl.full(x_ptrs.shape, 1, gl.int1,
                                                                                  x_ptrs.type.layout) & pred)
    async_copy.commit_group()


@gluon.jit
def _store_t(acc, y_ptr, topk_w_ptr, sorted_ptr, row0, off_n, N, num_valid, out_div, stride_ym,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MUL_ROUTED: gl.constexpr, REDUCE: gl.constexpr,
             num_warps: gl.constexpr):
    """acc^T [BN, BM] of slots row0 .. row0 + BM -> their rows of y (bf16 store), or with REDUCE each slot into its
    token's row (zeroed by the host; relaxed fp32 atomics); threads along n (contiguous in y); MUL_ROUTED scales by
    the routing weight."""
    out_layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, num_warps], [0, 1])
    out = gl.convert_layout(acc, out_layout)
    otok = gl.load(sorted_ptr + row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout)))
    row_ok = otok < num_valid
    offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout))
    _put_slots(out, otok, row_ok, offs_n, gl.expand_dims(offs_n < N, 1), y_ptr, topk_w_ptr, out_div, stride_ym,
               MUL_ROUTED, REDUCE)


@gluon.jit
def _put_slots(out, otok, row_ok, offs_n, n_ok, y_ptr, topk_w_ptr, out_div, stride_ym, MUL_ROUTED: gl.constexpr,
               REDUCE: gl.constexpr):
    """out^T [BN, rows] of the slots otok -> y: routing weight applied if MUL_ROUTED; REDUCE adds each slot into its
    token's row (relaxed fp32 atomics), else a bf16 store to the slot's row."""
    if MUL_ROUTED:
        out = out * gl.expand_dims(gl.load(topk_w_ptr + otok, mask=row_ok, other=0.0), 0)
    mask = gl.expand_dims(row_ok, 0) & n_ok
    if REDUCE:
        y_rows = (otok // out_div).to(gl.int64)
        gl.atomic_add(y_ptr + gl.expand_dims(y_rows * stride_ym, 0) + gl.expand_dims(offs_n, 1), out, mask=mask,
                      sem="relaxed")
    else:
        ptrs = y_ptr + gl.expand_dims(otok.to(gl.int64) * stride_ym, 0) + gl.expand_dims(offs_n, 1)
        gl.store(ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _tcgp_kloop2(q_desc, x_smem, q_smem, bars, x_ptrs, qrow0, s_base, off_n, N, n_steps, a_layout: gl.constexpr,
                 mma_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 num_warps: gl.constexpr):
    """the tcgp K loop without the register-A race (TcgConfig.LOOP 2; the ring's prologue already issued): each K
    step as two wgmma, each on its own A registers, rewritten only after the wait that retired the wgmma reading
    them (see _ws_consume_halves) - on the tile's row halves where a warp holds two 16-row slices (BN >= 32 warps:
    64 x 256), else on the step's K halves (fields 0-3 / 4-7: 128 x 128 with 8 warps), as gemm_wna16_tcg's
    _swap_half_step / _swap_khalf_step. -> acc [BN, BM] (mma_layout, all wgmma retired)."""
    ROWS: gl.constexpr = BLOCK_N >= 32 * num_warps
    HN: gl.constexpr = BLOCK_N // 2 if ROWS else BLOCK_N
    L3s: gl.constexpr = dense._decode_layout(gl.to_linear_layout(a_layout, [HN, BK if ROWS else BK // 2]))
    if ROWS:
        sel0, zb, s_offs = dense._swap_consts(L3s, N, 0, HN, 8, False)  # columns 0 .. HN of the half [HN, 1, 1]
        sel1 = sel0
        acc1 = gl.zeros((HN, BLOCK_M), dtype=gl.float32, layout=mma_layout)
        a1 = gl.zeros((HN, BK), dtype=gl.bfloat16, layout=a_layout)  # "step -1's second wgmma": none in flight
        s_h1 = s_base + s_offs + off_n + HN
        s_ok1 = s_offs + off_n + HN < N
        s_next1 = gl.load(s_h1, mask=s_ok1, other=0.0)
    else:
        sel0, zb, s_offs = dense._swap_consts(L3s, N, 0, BLOCK_N, 8, False, 4, 0)
        sel1, zb, s_offs = dense._swap_consts(L3s, N, 0, BLOCK_N, 8, False, 4, 4)  # (int4: one scale per column)
        acc1 = gl.zeros((16, 16), dtype=gl.float32, layout=mma_layout)  # (unused)
        a1 = gl.zeros((BLOCK_N, BK // 2), dtype=gl.bfloat16, layout=a_layout)
    s_h0 = s_base + s_offs + off_n
    s_ok0 = s_offs + off_n < N
    s_next0 = gl.load(s_h0, mask=s_ok0, other=0.0)
    acc0 = gl.zeros((HN, BLOCK_M), dtype=gl.float32, layout=mma_layout)
    for i in range(n_steps):
        slot = i % STAGES
        nx = gl.minimum(i + 1, n_steps - 1) * N  # the next step's scales, loaded a step ahead
        sraw0 = s_next0.to(gl.bfloat16)
        s_next0 = gl.load(s_h0 + nx, mask=s_ok0, other=0.0)
        if ROWS:
            sraw1 = s_next1.to(gl.bfloat16)
            s_next1 = gl.load(s_h1 + nx, mask=s_ok1, other=0.0)
        else:
            sraw1 = sraw0
        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        xs = x_smem.index(slot)
        if ROWS:
            q = q_smem.index(slot)
            a0 = dense._swap_a(q.slice(0, HN, dim=1), sraw0, sel0, zb, L3s, a_layout, HN, False)
            x0 = xs.permute((1, 0))
            x1 = x0
        else:
            qk = gl.expand_dims(q_smem.index(slot).permute((1, 0)).load(gl.SliceLayout(1, L3s)), 1)  # [BN, 1, 16]
            a0 = dense._swap_dec(qk, sraw0, sel0, zb, L3s, a_layout, BLOCK_N, 4, False)
            x0 = xs.slice(0, BK // 2, dim=1).permute((1, 0))
            x1 = xs.slice(BK // 2, BK // 2, dim=1).permute((1, 0))
        async_copy.wait_group(STAGES - 2)  # this thread's cp.async of step i landed (one group per step)
        fence_async_shared()  # ... visible to the async-proxy wgmma (and the word loads before a TMA refill)
        gl.thread_barrier()  # ... from every thread
        acc0 = warpgroup_mma(a0, x0, acc0, is_async=True)
        if ROWS:  # step i - 1's second wgmma retired: its A (a1) may be rewritten, its ring slot is free
            acc1, a1, acc0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc1, a1, acc0))
            a1 = dense._swap_a(q.slice(HN, HN, dim=1), sraw1, sel1, zb, L3s, a_layout, HN, False)
            acc1 = warpgroup_mma(a1, x1, acc1, is_async=True)
            acc0, a0, acc1 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0, a0, acc1))
        else:
            acc0, a1 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0, a1))
            a1 = dense._swap_dec(qk, sraw1, sel1, zb, L3s, a_layout, BLOCK_N, 4, False)
            acc0 = warpgroup_mma(a1, x1, acc0, is_async=True)
            acc0, a0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0, a0))
        gl.thread_barrier()  # every warpgroup past step i - 1's wgmma, before one thread refills its slot
        nxt = i + STAGES - 1
        ns = nxt % STAGES
        _issue_xq(q_desc, bars.index(ns), q_smem.index(ns), x_smem.index(ns), x_ptrs, qrow0, off_n, nxt,
                  nxt < n_steps)
    if ROWS:
        acc1, a1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, a1))
        # rows h * HN + r of the tile: the full tile's wgmma layout up to the order of registers (as the dense loop)
        acc = gl.convert_layout(gl.reshape(gl.permute(gl.join(acc0, acc1), (2, 0, 1)), (BLOCK_N, BLOCK_M)),
                                mma_layout)
    else:
        acc, a1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, a1))
    return acc


@gluon.jit
def _moe_tcgp_kernel(x_ptr, q_desc, s_ptr, y_ptr, topk_w_ptr, sorted_ptr, expert_ptr, npost_ptr, num_valid, a_div,
                     out_div, N, K, stride_xm, stride_ym, num_m_blocks, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, MUL_ROUTED: gl.constexpr,
                     REDUCE: gl.constexpr, PROBE: gl.constexpr, num_warps: gl.constexpr, LOOP: gl.constexpr = 0):
    """acc^T [BN, BM] = W tile (decoded into registers by gemm_wna16_tcg's swap decode) @ x^T (shared), the loop of
    the dense swap kernel: step i's wgmma is issued behind step i - 1's (one in flight: no tensor-core gap while a
    slot is refilled), its scales loaded a step ahead (no L2 latency before the decode). LOOP 2: _tcgp_kloop2."""
    pid_m, pid_n = _block_of(gl.program_id(0), num_m_blocks, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= gl.load(npost_ptr):  # padding blocks past the last expert's run
        return
    expert = gl.load(expert_ptr + pid_m)
    off_n = pid_n * BLOCK_N
    n_steps = K // BK
    gl.assume(n_steps > 0)  # (dense tcg: without it the zero-trip path serialises every wgmma)
    qrow0 = expert * (K // 8)
    x_ptrs = _gather_ptrs(x_ptr, sorted_ptr, pid_m * BLOCK_M, num_valid, a_div, stride_xm, BLOCK_M, num_warps)

    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BK], gl.bfloat16)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BK], x_layout)
    q_smem = gl.allocate_shared_memory(gl.int32, [STAGES, R, BLOCK_N], q_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        _issue_xq(q_desc, bars.index(i), q_smem.index(i), x_smem.index(i), x_ptrs, qrow0, off_n, i, i < n_steps)

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    L3: gl.constexpr = dense._decode_layout(gl.to_linear_layout(a_layout, [BLOCK_N, BK]))
    if LOOP == 2:
        acc = _tcgp_kloop2(q_desc, x_smem, q_smem, bars, x_ptrs, qrow0, s_ptr + (expert * n_steps).to(gl.int64) * N,
                           off_n, N, n_steps, a_layout, mma_layout, BLOCK_M, BLOCK_N, STAGES, num_warps)
    else:
        sel, zb, s_offs = dense._swap_consts(L3, N, off_n, BLOCK_N, 8, False)  # s_offs: the tile's columns [BN, 1, 1]
        s_ok = s_offs < N
        s_base = s_ptr + (expert * n_steps).to(gl.int64) * N + s_offs  # fp32 scales [E * K / 128, N]
        s_next = gl.load(s_base, mask=s_ok, other=0.0)
        acc = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=mma_layout)
        if PROBE != 0:
            keep = gl.zeros((BLOCK_N, BK), dtype=gl.bfloat16, layout=a_layout)
        for i in range(n_steps):
            slot = i % STAGES
            sraw = s_next.to(gl.bfloat16)
            s_next = gl.load(s_base + gl.minimum(i + 1, n_steps - 1) * N, mask=s_ok, other=0.0)
            mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
            if PROBE == 1:
                a = keep
            else:
                a = dense._swap_a(q_smem.index(slot), sraw, sel, zb, L3, a_layout, BLOCK_N, False)
            async_copy.wait_group(STAGES - 2)  # this thread's cp.async of step i landed (one group per step)
            fence_async_shared()  # ... visible to the async-proxy wgmma (and the word loads before a TMA refill)
            gl.thread_barrier()  # ... from every thread
            if PROBE == 2:
                keep = keep + a
            else:
                acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # step i - 1 done: its ring slot is free
            gl.thread_barrier()  # ... in every warpgroup, before one thread refills it
            nxt = i + STAGES - 1
            ns = nxt % STAGES
            _issue_xq(q_desc, bars.index(ns), q_smem.index(ns), x_smem.index(ns), x_ptrs, qrow0, off_n, nxt,
                      nxt < n_steps)
        if PROBE == 2:
            acc = warpgroup_mma(keep, x_smem.index(0).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    async_copy.wait_group(0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    _store_t(acc, y_ptr, topk_w_ptr, sorted_ptr, pid_m * BLOCK_M, off_n, N, num_valid, out_div, stride_ym, BLOCK_M,
             BLOCK_N, MUL_ROUTED, REDUCE, num_warps)


@gluon.jit
def _store_t_staged(acc, epi, y_ptr, topk_w_ptr, sorted_ptr, pid_m, off_n, N, num_valid, out_div, stride_ym,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MUL_ROUTED: gl.constexpr, REDUCE: gl.constexpr,
                    num_warps: gl.constexpr):
    """_store_t through a shared staging tile epi [BN, BM] fp32, 16 slot rows at a time: the persistent loop keeps
    its ring / tile state live across the epilogue, and the whole tile's 64 values + 64 addresses a thread at once
    pushed it to 255 registers with spills (offline sm_90a compile)."""
    MC: gl.constexpr = 16
    epi.store(acc)
    gl.thread_barrier()
    out_layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, num_warps], [0, 1])
    offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout))
    n_ok = gl.expand_dims(offs_n < N, 1)
    for j in gl.static_range(BLOCK_M // MC):
        out = epi.slice(j * MC, MC, dim=1).load(out_layout)
        otok = gl.load(sorted_ptr + pid_m * BLOCK_M + j * MC + gl.arange(0, MC, layout=gl.SliceLayout(0, out_layout)))
        _put_slots(out, otok, otok < num_valid, offs_n, n_ok, y_ptr, topk_w_ptr, out_div, stride_ym, MUL_ROUTED,
                   REDUCE)


@gluon.jit
def _tile_coords(t, pid, G, n_real, N, expert_ptr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """(expert block, first column, expert) of this persistent program's tile t: its tiles are pid, pid + G,
    pid + 2 G, ... (so the G programs walk the swizzled tile order together, as one wave of the plain grid does)."""
    pid_m, pid_n = _block_of(pid + t * G, n_real, N, BLOCK_N, GROUP_M)
    return pid_m, pid_n * BLOCK_N, gl.load(expert_ptr + pid_m)


@gluon.jit
def _issue_step(q_desc, bar, q_slot, x_slot, i, total, p_t, p_s, p_n, p_e, p_x, pid, G, n_real, N, K, n_steps,
                expert_ptr, x_ptr, sorted_ptr, num_valid, a_div, stride_xm, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    """the persistent producer: issue flat step i (K step p_s of tile p_t, if i < total) into one ring slot, then
    advance to the next step, rolling over to the next tile's columns / expert / gathered rows."""
    _issue_xq(q_desc, bar, q_slot, x_slot, p_x, p_e * (K // 8), p_n, p_s, i < total)
    p_s += 1
    if p_s == n_steps:
        p_s = 0
        p_t += 1
        if i + 1 < total:
            p_m, p_n, p_e = _tile_coords(p_t, pid, G, n_real, N, expert_ptr, BLOCK_N, GROUP_M)
            p_x = _gather_ptrs(x_ptr, sorted_ptr, p_m * BLOCK_M, num_valid, a_div, stride_xm, BLOCK_M, num_warps)
    return p_t, p_s, p_n, p_e, p_x


@gluon.jit
def _moe_tcgq_kernel(x_ptr, q_desc, s_ptr, y_ptr, topk_w_ptr, sorted_ptr, expert_ptr, npost_ptr, num_valid, a_div,
                     out_div, N, K, stride_xm, stride_ym, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, GROUP_M: gl.constexpr, MUL_ROUTED: gl.constexpr, REDUCE: gl.constexpr,
                     num_warps: gl.constexpr, LOOP: gl.constexpr = 0):
    """The tcgp loop made persistent (PERSIST 1): one program per SM walks its tiles as one flat sequence of
    (tile, K step) steps through one load ring, so the loads of a tile's first steps are in flight while the tile
    before finishes its last wgmmas and its epilogue (session 8 probes: the tcgp loop spends ~145 of 198.6 us
    outside decode and MMA — loads, barriers, tile start / finish; Qwen3's down projection has 6 K steps a tile).
    Step / tile positions are counters carried through the loop (no runtime division per step)."""
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    n_real = gl.cdiv(gl.load(npost_ptr), BLOCK_M)  # expert blocks holding slots (the rest is padding)
    n_steps = K // BK
    gl.assume(n_steps > 0)
    n_tiles = n_real * gl.cdiv(N, BLOCK_N)
    total = gl.maximum(gl.cdiv(n_tiles - pid, G), 0) * n_steps  # this program's (tile, K step) steps
    if total == 0:
        return

    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BK], gl.bfloat16)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BK], x_layout)
    q_smem = gl.allocate_shared_memory(gl.int32, [STAGES, R, BLOCK_N], q_desc.layout)
    epi = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M],
                                    gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0, 1]))
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    # producer: the tile (p_t) and K step in it (p_s) of the next step it issues
    p_t = 0
    p_s = 0
    p_m, p_n, p_e = _tile_coords(0, pid, G, n_real, N, expert_ptr, BLOCK_N, GROUP_M)
    p_x = _gather_ptrs(x_ptr, sorted_ptr, p_m * BLOCK_M, num_valid, a_div, stride_xm, BLOCK_M, num_warps)
    for i in gl.static_range(STAGES - 1):
        p_t, p_s, p_n, p_e, p_x = _issue_step(q_desc, bars.index(i), q_smem.index(i), x_smem.index(i), i, total,
                                              p_t, p_s, p_n, p_e, p_x, pid, G, n_real, N, K, n_steps, expert_ptr,
                                              x_ptr, sorted_ptr, num_valid, a_div, stride_xm, BLOCK_M, BLOCK_N,
                                              GROUP_M, num_warps)

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    L3: gl.constexpr = dense._decode_layout(gl.to_linear_layout(a_layout, [BLOCK_N, BK]))
    sel, zb, cols = dense._swap_consts(L3, N, 0, BLOCK_N, 8, False)  # cols: the tile's columns from 0 [BN, 1, 1]
    # consumer: c_t / s the tile and K step it computes; c_m / c_n that tile's block and columns (the epilogue),
    # n_n / n_e the columns and expert of the next step's tile (its scales are loaded a step ahead)
    c_t = 0
    s = 0
    c_m, c_n, n_e = _tile_coords(0, pid, G, n_real, N, expert_ptr, BLOCK_N, GROUP_M)
    n_m = c_m
    n_n = c_n
    if LOOP == 2:  # the race-free step (as _tcgp_kloop2's row halves; BN >= 32 warps): two wgmma on two A sets
        HN: gl.constexpr = BLOCK_N // 2
        L3h: gl.constexpr = dense._decode_layout(gl.to_linear_layout(a_layout, [HN, BK]))
        selh, zbh, colh = dense._swap_consts(L3h, N, 0, HN, 8, False)  # half 0's columns from 0 [HN, 1, 1]
        s_row = s_ptr + (n_e * n_steps).to(gl.int64) * N + n_n
        s_next0 = gl.load(s_row + colh, mask=n_n + colh < N, other=0.0)
        s_next1 = gl.load(s_row + HN + colh, mask=n_n + HN + colh < N, other=0.0)
        acc0 = gl.zeros((HN, BLOCK_M), dtype=gl.float32, layout=mma_layout)
        acc1 = gl.zeros((HN, BLOCK_M), dtype=gl.float32, layout=mma_layout)
        a1 = gl.zeros((HN, BK), dtype=gl.bfloat16, layout=a_layout)  # "step -1's half 1": nothing in flight
    else:
        s_next = gl.load(s_ptr + (n_e * n_steps).to(gl.int64) * N + n_n + cols, mask=n_n + cols < N, other=0.0)
        acc = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=mma_layout)
    for c in range(total):
        slot = c % STAGES
        last = s == n_steps - 1  # the tile's last step: the next one starts the next tile
        if last & (c + 1 < total):
            n_m, n_n, n_e = _tile_coords(c_t + 1, pid, G, n_real, N, expert_ptr, BLOCK_N, GROUP_M)
        s1 = gl.where(last, 0, s + 1)
        if LOOP == 2:
            sraw0 = s_next0.to(gl.bfloat16)
            sraw1 = s_next1.to(gl.bfloat16)
            s_row = s_ptr + (n_e * n_steps + s1).to(gl.int64) * N + n_n
            s_next0 = gl.load(s_row + colh, mask=(n_n + colh < N) & (c + 1 < total), other=0.0)
            s_next1 = gl.load(s_row + HN + colh, mask=(n_n + HN + colh < N) & (c + 1 < total), other=0.0)
            mbarrier.wait(bars.index(slot), (c // STAGES) & 1)
            q = q_smem.index(slot)
            xs = x_smem.index(slot).permute((1, 0))
            a0 = dense._swap_a(q.slice(0, HN, dim=1), sraw0, selh, zbh, L3h, a_layout, HN, False)
            async_copy.wait_group(STAGES - 2)  # this thread's cp.async of step c landed (one group per step)
            fence_async_shared()  # ... visible to the async-proxy wgmma (and the word loads before a TMA refill)
            gl.thread_barrier()  # ... from every thread
            acc0 = warpgroup_mma(a0, xs, acc0, use_acc=s != 0, is_async=True)
            acc1, a1, acc0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc1, a1, acc0))  # step c - 1 done
            a1 = dense._swap_a(q.slice(HN, HN, dim=1), sraw1, selh, zbh, L3h, a_layout, HN, False)
            acc1 = warpgroup_mma(a1, xs, acc1, use_acc=s != 0, is_async=True)
            acc0, a0, acc1 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0, a0, acc1))  # half 0 done
        else:
            sraw = s_next.to(gl.bfloat16)
            s_next = gl.load(s_ptr + (n_e * n_steps + s1).to(gl.int64) * N + n_n + cols,
                             mask=(n_n + cols < N) & (c + 1 < total), other=0.0)
            mbarrier.wait(bars.index(slot), (c // STAGES) & 1)
            a = dense._swap_a(q_smem.index(slot), sraw, sel, zb, L3, a_layout, BLOCK_N, False)
            async_copy.wait_group(STAGES - 2)  # this thread's cp.async of step c landed (one group per step)
            fence_async_shared()  # ... visible to the async-proxy wgmma (and the word loads before a TMA refill)
            gl.thread_barrier()  # ... from every thread
            acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, use_acc=s != 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # step c - 1 done: its ring slot is free
        gl.thread_barrier()  # ... in every warpgroup, before one thread refills it
        nxt = c + STAGES - 1
        ns = nxt % STAGES
        p_t, p_s, p_n, p_e, p_x = _issue_step(q_desc, bars.index(ns), q_smem.index(ns), x_smem.index(ns), nxt,
                                              total, p_t, p_s, p_n, p_e, p_x, pid, G, n_real, N, K, n_steps,
                                              expert_ptr, x_ptr, sorted_ptr, num_valid, a_div, stride_xm, BLOCK_M,
                                              BLOCK_N, GROUP_M, num_warps)
        if last:  # its epilogue while the next tile's first loads are in flight
            if LOOP == 2:
                acc1, a1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, a1))
                # rows h * HN + r of the tile (as _tcgp_kloop2)
                tile = gl.convert_layout(gl.reshape(gl.permute(gl.join(acc0, acc1), (2, 0, 1)), (BLOCK_N, BLOCK_M)),
                                         mma_layout)
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                tile = acc
            _store_t_staged(tile, epi, y_ptr, topk_w_ptr, sorted_ptr, c_m, c_n, N, num_valid, out_div, stride_ym,
                            BLOCK_M, BLOCK_N, MUL_ROUTED, REDUCE, num_warps)
            c_m = n_m
            c_n = n_n
            c_t += 1
        s = s1
    async_copy.wait_group(0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _ws_consume(x_smem, xb_smem, q_smem, ready, empty, s_ptr, expert, off_n, N, n_steps, L3: gl.constexpr,
                mma_layout: gl.constexpr, mma_b: gl.constexpr, MA: gl.constexpr, MB: gl.constexpr,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, RELEASE: gl.constexpr):
    """WS consumer (the kernel's warps): the tcgp step without CTA barriers — wait for the slot's words (TMA) and
    x rows (the loader's arrival), decode, wgmma, and release step i - 1's slot once its wgmma is done.
    MB > 0 (80 / 96-row blocks): the decoded tile also feeds a second wgmma over the block's last MB rows (xb_smem).
    RELEASE (TcgConfig.WS): 1 fence + mbarrier arrive (one elected thread, so Triton puts a partition barrier
    before it, and one more before the fence: two 256-thread barriers a step, offline sm_90a PTX); 2 the same
    without the fence (a generic read before an async-proxy TMA refill needs none: the hand-over orders it, as
    CUTLASS's consumer_release): one barrier a step. (A named-barrier arrive by every thread instead, tried
    offline, still got a partition barrier before its asm: Triton's membar puts one before any side-effecting op.)"""
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    a_layout_b: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_b, k_width=2)
    sel, zb, s_offs = dense._swap_consts(L3, N, off_n, BLOCK_N, 8, False)
    s_ok = s_offs < N
    s_base = s_ptr + (expert * n_steps).to(gl.int64) * N + s_offs
    s_next = gl.load(s_base, mask=s_ok, other=0.0)
    acc = gl.zeros((BLOCK_N, MA), dtype=gl.float32, layout=mma_layout)
    if MB > 0:
        acc_b = gl.zeros((BLOCK_N, MB), dtype=gl.float32, layout=mma_b)
    for i in range(n_steps):
        slot = i % STAGES
        sraw = s_next.to(gl.bfloat16)
        s_next = gl.load(s_base + gl.minimum(i + 1, n_steps - 1) * N, mask=s_ok, other=0.0)
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        a = dense._swap_a(q_smem.index(slot), sraw, sel, zb, L3, a_layout, BLOCK_N, False)
        fence_async_shared()  # the loader's cp.async rows (generic proxy) -> the async-proxy wgmma
        acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
        if MB > 0:  # (the A operand's registers are the same for both instruction shapes)
            acc_b = warpgroup_mma(gl.convert_layout(a, a_layout_b), xb_smem.index(slot).permute((1, 0)), acc_b,
                                  is_async=True)
            acc, acc_b = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc_b))  # step i - 1's two are done
        else:
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        ps = (i + STAGES - 1) % STAGES  # step i - 1's slot: its decode and wgmma are done
        if RELEASE == 1:
            fence_async_shared()  # the word loads of the decode before the TMA refill of the slot
        mbarrier.arrive(empty.index(ps), pred=i > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    if MB > 0:
        acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc_b, ))
        res = (acc, acc_b)
    else:
        res = (acc, )
    return res


@gluon.jit
def _half_wgmma(a, xs, xbs, acc, acc_b, a_layout_b: gl.constexpr, MB: gl.constexpr):
    """the async wgmma(s) of one row half of a K step: over the block's first MA rows (xs), and with MB > 0 over
    its last MB rows too (xbs), on one decoded A (acc_b: anything when MB == 0, returned as is)."""
    acc = warpgroup_mma(a, xs, acc, is_async=True)
    if MB > 0:  # (the A operand's registers are the same for both instruction shapes)
        acc_b = warpgroup_mma(gl.convert_layout(a, a_layout_b), xbs, acc_b, is_async=True)
    return acc, acc_b


@gluon.jit
def _retire_half(acc, acc_b, a, fly, fly_b, MB: gl.constexpr):
    """wait until only the other half's wgmma(s) (fly, fly_b) are in flight: this half's (acc, acc_b) are retired,
    and its A registers (kept alive up to here by deps) may be rewritten. All four accumulators come back as
    tensors (a loop carries them so)."""
    if MB > 0:
        acc, acc_b, a, fly, fly_b = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc_b, a, fly, fly_b))
    else:
        acc, a, fly = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a, fly))
    return acc, acc_b, a, fly, fly_b


@gluon.jit
def _ws_consume_halves(x_smem, xb_smem, q_smem, ready, empty, s_ptr, expert, off_n, N, n_steps,
                       mma_layout: gl.constexpr, mma_b: gl.constexpr, MA: gl.constexpr, MB: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, RELEASE: gl.constexpr):
    """_ws_consume without the register-A race (TcgConfig.LOOP 2; BLOCK_N >= 32 warps: two 16-row slices a warp).
    The one-A loop decodes step i into the registers the PTX also names for step i - 1's A while that wgmma is still
    in flight (undefined: the async wgmma reads A until a wait retires it; offline sm_90a SASS of the WS kernel:
    ~230 such writes a loop). Here each K step is two wgmma (groups) on the tile's two row halves, as
    gemm_wna16_tcg._swap_half_step: half 0 is decoded while step i - 1's half 1 is in flight, half 1 while half 0
    is, each A rewritten only after the wait that retired the wgmma reading it. Same registers as one full A.
    -> (acc rows 0 .. HN, acc rows HN .. BN[, the same two over the last MB rows])."""
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    a_layout_b: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_b, k_width=2)
    HN: gl.constexpr = BLOCK_N // 2
    L3h: gl.constexpr = dense._decode_layout(gl.to_linear_layout(a_layout, [HN, BK]))
    sel, zb, s_offs = dense._swap_consts(L3h, N, off_n, HN, 8, False)  # s_offs: half 0's columns [HN, 1, 1]
    s_ok0 = s_offs < N
    s_ok1 = s_offs + HN < N
    s_base = s_ptr + (expert * n_steps).to(gl.int64) * N + s_offs
    s_next0 = gl.load(s_base, mask=s_ok0, other=0.0)
    s_next1 = gl.load(s_base + HN, mask=s_ok1, other=0.0)
    acc0 = gl.zeros((HN, MA), dtype=gl.float32, layout=mma_layout)
    acc1 = gl.zeros((HN, MA), dtype=gl.float32, layout=mma_layout)
    if MB > 0:
        accb0 = gl.zeros((HN, MB), dtype=gl.float32, layout=mma_b)
        accb1 = gl.zeros((HN, MB), dtype=gl.float32, layout=mma_b)
    else:  # (no second row part: carried through untouched)
        accb0 = gl.zeros((16, 16), dtype=gl.float32, layout=mma_layout)
        accb1 = accb0
    a1 = gl.zeros((HN, BK), dtype=gl.bfloat16, layout=a_layout)  # "step -1's half 1": nothing in flight
    for i in range(n_steps):
        slot = i % STAGES
        sraw0 = s_next0.to(gl.bfloat16)
        sraw1 = s_next1.to(gl.bfloat16)
        s_row = s_base + gl.minimum(i + 1, n_steps - 1) * N  # the next step's scales, both halves
        s_next0 = gl.load(s_row, mask=s_ok0, other=0.0)
        s_next1 = gl.load(s_row + HN, mask=s_ok1, other=0.0)
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        q = q_smem.index(slot)
        xs = x_smem.index(slot).permute((1, 0))
        xbs = xb_smem.index(slot).permute((1, 0))
        a0 = dense._swap_a(q.slice(0, HN, dim=1), sraw0, sel, zb, L3h, a_layout, HN, False)
        fence_async_shared()  # the loader's cp.async rows (generic proxy) -> the async-proxy wgmma
        acc0, accb0 = _half_wgmma(a0, xs, xbs, acc0, accb0, a_layout_b, MB)
        acc1, accb1, a1, acc0, accb0 = _retire_half(acc1, accb1, a1, acc0, accb0, MB)  # step i - 1 done
        a1 = dense._swap_a(q.slice(HN, HN, dim=1), sraw1, sel, zb, L3h, a_layout, HN, False)
        acc1, accb1 = _half_wgmma(a1, xs, xbs, acc1, accb1, a_layout_b, MB)
        acc0, accb0, a0, acc1, accb1 = _retire_half(acc0, accb0, a0, acc1, accb1, MB)  # half 0 done
        ps = (i + STAGES - 1) % STAGES  # step i - 1's slot: its decode and wgmma are done
        if RELEASE == 1:
            fence_async_shared()  # the word loads of the decode before the TMA refill of the slot
        mbarrier.arrive(empty.index(ps), pred=i > 0)
    if MB > 0:
        acc1, accb1, a1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, accb1, a1))
        res = (acc0, acc1, accb0, accb1)
    else:
        acc1, a1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, a1))
        res = (acc0, acc1)
    return res


@gluon.jit
def _ws_load(q_desc, x_smem, xb_smem, q_smem, ready, empty, x_ptr, sorted_ptr, row0, num_valid, a_div, stride_xm,
             qrow0, off_n, n_steps, MA: gl.constexpr, MB: gl.constexpr, STAGES: gl.constexpr, LAG: gl.constexpr,
             LOAD_WARPS: gl.constexpr):
    """WS loader (LOAD_WARPS warps): words by TMA, gathered x rows by cp.async (MA rows from row0, then MB more into
    xb_smem); a slot's x arrival (its ready barrier counts the TMA expect + this one) is made LAG steps later, once
    wait_group shows this partition's copies of that step landed, so LAG + 1 steps of x are in flight. A slot's
    refill waits for the consumers' release of its previous step (its empty mbarrier)."""
    x_ptrs = _gather_ptrs(x_ptr, sorted_ptr, row0, num_valid, a_div, stride_xm, MA, LOAD_WARPS)
    if MB > 0:
        xb_ptrs = _gather_ptrs(x_ptr, sorted_ptr, row0 + MA, num_valid, a_div, stride_xm, MB, LOAD_WARPS)
    for i in range(n_steps):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1 at once
        mbarrier.expect(ready.index(slot), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [qrow0 + i * R, off_n], ready.index(slot), q_smem.index(slot))
        async_copy.async_copy_global_to_shared(x_smem.index(slot), x_ptrs + i * BK)
        if MB > 0:
            async_copy.async_copy_global_to_shared(xb_smem.index(slot), xb_ptrs + i * BK)
        async_copy.commit_group()
        async_copy.wait_group(LAG)  # this thread's rows of step i - LAG landed ...
        gl.thread_barrier()  # ... and every loader thread's
        mbarrier.arrive(ready.index((i + STAGES - LAG) % STAGES), pred=i >= LAG)
    async_copy.wait_group(0)
    gl.thread_barrier()
    for j in gl.static_range(LAG):  # the last LAG steps' arrivals
        i = n_steps - LAG + j
        mbarrier.arrive(ready.index(i % STAGES), pred=i >= 0)


@gluon.jit
def _moe_tcgw_kernel(x_ptr, q_desc, s_ptr, y_ptr, topk_w_ptr, sorted_ptr, expert_ptr, npost_ptr, num_valid, a_div,
                     out_div, N, K, stride_xm, stride_ym, num_m_blocks, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, MUL_ROUTED: gl.constexpr,
                     REDUCE: gl.constexpr, RELEASE: gl.constexpr, num_warps: gl.constexpr, LOOP: gl.constexpr = 0):
    """The tcgp loop warp-specialised (WS 1 / 2 = RELEASE): a 4-warp loader partition issues the ring's TMA +
    cp.async loads, the kernel's warps decode + wgmma, handing slots over by mbarriers (session 9 R1: the
    persistent loop did not help, so the per-step barriers / load issue are the next suspect).
    BLOCK_M 80 / 96 (Humming's 80-token expert blocks): Qwen3-30B-A3B at M = 1024 has ~64 +- 8 slots per expert,
    so 64-row blocks give ~1.47 blocks an expert (~188 for 128 experts, the second mostly padding, each with a full
    weight-tile load + decode); 80 rows hold nearly every expert in one. Gluon tensors are powers of two, so the
    block is a 64-row part plus a 16 / 32-row part, two wgmmas on one decoded weight tile."""
    pid_m, pid_n = _block_of(gl.program_id(0), num_m_blocks, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= gl.load(npost_ptr):
        return
    expert = gl.load(expert_ptr + pid_m)
    off_n = pid_n * BLOCK_N
    n_steps = K // BK
    gl.assume(n_steps > 0)
    MA: gl.constexpr = 64 if (BLOCK_M == 80) | (BLOCK_M == 96) else BLOCK_M  # (power-of-two blocks: one wgmma)
    MB: gl.constexpr = BLOCK_M - MA
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, MA, BK],
                                       gl.NVMMASharedLayout.get_default_for([MA, BK], gl.bfloat16))
    if MB > 0:
        xb_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, MB, BK],
                                            gl.NVMMASharedLayout.get_default_for([MB, BK], gl.bfloat16))
    else:
        xb_smem = x_smem  # (unused)
    q_smem = gl.allocate_shared_memory(gl.int32, [STAGES, R, BLOCK_N], q_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=2)  # the TMA expect + the loader's x arrival
        mbarrier.init(empty.index(i), count=1)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, MA, 16])
    mma_b: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                    instr_shape=[16, MB if MB > 0 else MA, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    L3: gl.constexpr = dense._decode_layout(gl.to_linear_layout(a_layout, [BLOCK_N, BK]))
    LOAD_WARPS: gl.constexpr = 4
    row0 = pid_m * BLOCK_M
    qrow0 = expert * (K // 8)
    if LOOP == 2:  # the race-free consumer: results by row half (h) and row part (A: MA rows, B: MB rows)
        res = gl.warp_specialize([
            (_ws_consume_halves, (x_smem, xb_smem, q_smem, ready, empty, s_ptr, expert, off_n, N, n_steps,
                                  mma_layout, mma_b, MA, MB, BLOCK_N, STAGES, RELEASE)),
            (_ws_load, (q_desc, x_smem, xb_smem, q_smem, ready, empty, x_ptr, sorted_ptr, row0, num_valid, a_div,
                        stride_xm, qrow0, off_n, n_steps, MA, MB, STAGES, STAGES - 2, LOAD_WARPS)),
        ], [LOAD_WARPS], [80])
        HN: gl.constexpr = BLOCK_N // 2
        for h in gl.static_range(2):
            _store_t(res[h], y_ptr, topk_w_ptr, sorted_ptr, row0, off_n + h * HN, N, num_valid, out_div, stride_ym,
                     MA, HN, MUL_ROUTED, REDUCE, num_warps)
            if MB > 0:
                _store_t(res[2 + h], y_ptr, topk_w_ptr, sorted_ptr, row0 + MA, off_n + h * HN, N, num_valid,
                         out_div, stride_ym, MB, HN, MUL_ROUTED, REDUCE, num_warps)
    else:
        res = gl.warp_specialize([
            (_ws_consume, (x_smem, xb_smem, q_smem, ready, empty, s_ptr, expert, off_n, N, n_steps, L3, mma_layout,
                           mma_b, MA, MB, BLOCK_N, STAGES, RELEASE)),
            (_ws_load, (q_desc, x_smem, xb_smem, q_smem, ready, empty, x_ptr, sorted_ptr, row0, num_valid, a_div,
                        stride_xm, qrow0, off_n, n_steps, MA, MB, STAGES, STAGES - 2, LOAD_WARPS)),
        ], [LOAD_WARPS], [80])
        _store_t(res[0], y_ptr, topk_w_ptr, sorted_ptr, row0, off_n, N, num_valid, out_div, stride_ym, MA, BLOCK_N,
                 MUL_ROUTED, REDUCE, num_warps)
        if MB > 0:
            _store_t(res[1], y_ptr, topk_w_ptr, sorted_ptr, row0 + MA, off_n, N, num_valid, out_div, stride_ym, MB,
                     BLOCK_N, MUL_ROUTED, REDUCE, num_warps)


LAST_COMPILED = [None]  # the compiled kernel of the last launch (benches log its registers / spills / smem)


def compiled_stats() -> dict:
    """registers, spills and shared memory of the last launched kernel (what decides CTAs per SM)."""
    k = LAST_COMPILED[0]
    md = getattr(k, "metadata", None)
    return {"regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None),
            "smem": getattr(md, "shared", None)}


@functools.lru_cache(maxsize=None)
def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def loop_ok(cfg: TcgConfig) -> bool:
    """cfg.LOOP is one the kernel has: 0 anywhere; 2 on the SWAP 2 loops (tcgp: row or K halves; WS and
    persistent: row halves only, BN >= 32 warps)."""
    return cfg.LOOP == 0 or (cfg.LOOP == 2 and cfg.SWAP == 2
                             and (not (cfg.WS or cfg.PERSIST) or cfg.BN >= 32 * cfg.num_warps))


def supports(x: torch.Tensor, w: PlanarW4, cfg: TcgConfig) -> bool:
    """Hopper, bf16 row-major x with 16-byte aligned rows, int4 g128 planar weights, a tile the kernel handles."""
    E, N, K = w.shape
    return (x.is_cuda and x.dtype == torch.bfloat16 and x.stride(-1) == 1 and x.stride(0) % 8 == 0
            and x.data_ptr() % 16 == 0 and w.group == BLOCK_K and K % BLOCK_K == 0 and N % 4 == 0
            and w.qweight.is_contiguous() and w.scales.is_contiguous() and w.scales.dtype == torch.float32
            and (cfg.BM in ((32, 64, 128) if cfg.SWAP else (64, 128)) or (cfg.WS and cfg.BM in (80, 96)))
            and cfg.BN in (64, 128, 256)
            and cfg.num_warps in (4, 8)
            and (not cfg.SWAP or (cfg.BN >= 16 * cfg.num_warps and cfg.num_stages >= 2))
            and not cfg.PROBE  # timing probes compute wrong results
            and not cfg.REFILL  # R2 (H200): REFILL=1 gave wrong results (err 0.25) and was slower: disabled
            # session 5 R1 (H200): the tcgp loop measured wrong with a 3-deep ring (err 0.07 on three shapes; cause
            # not found: the ring indexing reads right), right (same err as SWAP 1, 2.8e-3) and faster with 4
            and (cfg.SWAP != 2 or cfg.num_stages >= 4)
            and (not cfg.PERSIST or cfg.SWAP == 2)
            and (not cfg.WS or (cfg.SWAP == 2 and not cfg.PERSIST and cfg.WS <= 2))
            and loop_ok(cfg)
            and torch.cuda.get_device_capability(x.device)[0] == 9)


def grouped_gemm_planar_tcg(x: torch.Tensor, w: PlanarW4, align, num_slots: int, a_div: int, out: torch.Tensor,
                            cfg: TcgConfig, topk_weights: torch.Tensor | None = None,
                            reduce_k: int = 0) -> torch.Tensor:
    """same contract as moe_tc.grouped_gemm_planar_tc (caller checks `supports`)."""
    sorted_ids, expert_ids, num_post = align
    E, N, K = w.shape
    blocks = expert_ids.numel()
    if sorted_ids.numel() != blocks * cfg.BM:
        raise ValueError(f"the sort/align was made for another block size than BM={cfg.BM}")
    if reduce_k:
        if out.dtype != torch.float32 or out.shape[0] * reduce_k != num_slots:
            raise ValueError(f"reduce_k={reduce_k}: out must be fp32 [{num_slots // reduce_k}, N]")
        out.zero_()
    r, bn = R.value, cfg.BN
    lay = gl.NVMMASharedLayout.get_default_for
    q_desc = TensorDescriptor.from_tensor(w.qweight.view(E * K // 8, N), [r, bn], lay([r, bn], gl.int32))
    s_desc = TensorDescriptor.from_tensor(w.scales.view(E * (K // BLOCK_K), N), [1, bn], lay([1, bn], gl.float32))
    tw = topk_weights if topk_weights is not None else out
    grid = (blocks * -(-N // bn),)
    # the kernels share one argument order: x, the weight operands (SWAP 0 / 1 also the scales' descriptor), then
    # the routing / output tail, then (all but the persistent one) the allocated expert-block count
    tail = (out, tw, sorted_ids, expert_ids, num_post, num_slots, a_div, max(reduce_k, 1), N, K, x.stride(0),
            out.stride(0))
    meta = dict(BLOCK_M=cfg.BM, BLOCK_N=bn, STAGES=cfg.num_stages, GROUP_M=cfg.GROUP_M,
                MUL_ROUTED=topk_weights is not None, REDUCE=reduce_k > 0, num_warps=cfg.num_warps)
    if cfg.MAXNREG:
        meta["maxnreg"] = cfg.MAXNREG
    if cfg.WS:
        kern, args = _moe_tcgw_kernel, (x, q_desc, w.scales, *tail, blocks)
        meta["RELEASE"] = cfg.WS
        meta["LOOP"] = cfg.LOOP
    elif cfg.PERSIST:  # the grid bound by the SMs; the kernel reads the real block count (num_post)
        kern, args = _moe_tcgq_kernel, (x, q_desc, w.scales, *tail)
        grid = (min(grid[0], _num_sms(x.device)),)
        meta["LOOP"] = cfg.LOOP
    elif cfg.SWAP == 2:
        kern, args = _moe_tcgp_kernel, (x, q_desc, w.scales, *tail, blocks)
        meta["PROBE"] = cfg.PROBE
        meta["LOOP"] = cfg.LOOP
    elif cfg.SWAP == 1:
        kern, args = _moe_tcgs_kernel, (x, q_desc, s_desc, w.scales, *tail, blocks)
        meta["EARLY_REFILL"] = bool(cfg.REFILL)
    else:
        kern, args = _moe_tcg_kernel, (x, q_desc, s_desc, *tail, blocks)
    LAST_COMPILED[0] = None  # (a launch that fails to compile leaves no stale stats)
    LAST_COMPILED[0] = kern[grid](*args, **meta)
    return out
