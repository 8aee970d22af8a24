"""The tcgp K loop (TcgConfig.SWAP 2, one program per tile; 128-row expert blocks in serving): the dense swap
kernel's loop adapted to experts, step i's wgmma issued behind step i - 1's, the scales loaded a step ahead. Also
its race-free form (LOOP 2, _tcgp_kloop2), which the persistent and WS loops' LOOP 2 mirror."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kestrel.kernels import gemm_wna16_tcg as dense
from kestrel.kernels.gemm_wna16_tcg import BK, R
from kestrel.kernels.moe_tcg_io import _block_of, _gather_ptrs, _issue_xq, _store_t, _tile_start


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
    expert, off_n, n_steps = _tile_start(expert_ptr, pid_m, pid_n, K, BLOCK_N)
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
