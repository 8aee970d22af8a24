"""The persistent tcgp loop (TcgConfig.PERSIST 1, KESTREL_MOE_TCG=4; opt-in): one program per SM walks its
tiles as one flat (tile, K step) sequence through one load ring, so a tile's first loads overlap the last wgmmas
and the epilogue of the tile before. Producer / consumer positions are carried counters (no division per step)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kestrel.kernels import gemm_wna16_tcg as dense
from kestrel.kernels.gemm_wna16_tcg import BK, R
from kestrel.kernels.moe_tcg_io import _block_of, _gather_ptrs, _issue_xq, _put_slots


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
def _halves_start(s_ptr, e, n, n_steps, N, a_layout: gl.constexpr, mma_layout: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr):
    """LOOP 2's consumer state before the program's first step (flat and nested loop): the row-half decode
    constants, step 0's scales of both halves (tile at columns n of expert e), zero accumulators and "step -1's
    half 1" A (nothing in flight)."""
    HN: gl.constexpr = BLOCK_N // 2
    L3h: gl.constexpr = dense._decode_layout(gl.to_linear_layout(a_layout, [HN, BK]))
    selh, zbh, colh = dense._swap_consts(L3h, N, 0, HN, 8, False)  # half 0's columns from 0 [HN, 1, 1]
    s_row = s_ptr + (e * n_steps).to(gl.int64) * N + n
    s_next0 = gl.load(s_row + colh, mask=n + colh < N, other=0.0)
    s_next1 = gl.load(s_row + HN + colh, mask=n + HN + colh < N, other=0.0)
    acc0 = gl.zeros((HN, BLOCK_M), dtype=gl.float32, layout=mma_layout)
    acc1 = gl.zeros((HN, BLOCK_M), dtype=gl.float32, layout=mma_layout)
    a1 = gl.zeros((HN, BK), dtype=gl.bfloat16, layout=a_layout)
    return selh, zbh, colh, s_next0, s_next1, acc0, acc1, a1


@gluon.jit
def _step_one(q_smem, x_smem, slot, sraw, acc, s, sel, zb, L3: gl.constexpr, a_layout: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """LOOP 0's K step s (flat and nested loop; the slot's words landed): decode into one A, one wgmma, then wait
    for step c - 1's (its ring slot is free). The slots are indexed here, after the decode, as the loops did: taking
    them before (in the caller) changed the 128 x 128 flat kernel's SASS (offline sm_90a)."""
    a = dense._swap_a(q_smem.index(slot), sraw, sel, zb, L3, a_layout, BLOCK_N, False)
    async_copy.wait_group(STAGES - 2)  # this thread's cp.async of step c landed (one group per step)
    fence_async_shared()  # ... visible to the async-proxy wgmma (and the word loads before a TMA refill)
    gl.thread_barrier()  # ... from every thread
    acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, use_acc=s != 0, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # step c - 1 done: its ring slot is free
    return acc


@gluon.jit
def _step_halves(q, xs, sraw0, sraw1, acc0, acc1, a1, use_acc, selh, zbh, a_layout: gl.constexpr,
                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """LOOP 2's race-free K step (as _tcgp_kloop2's row halves; BN >= 32 warps): two wgmma on two A sets, each
    rewritten only after the wait that retired the wgmma reading it."""
    HN: gl.constexpr = BLOCK_N // 2
    L3h: gl.constexpr = dense._decode_layout(gl.to_linear_layout(a_layout, [HN, BK]))
    a0 = dense._swap_a(q.slice(0, HN, dim=1), sraw0, selh, zbh, L3h, a_layout, HN, False)
    async_copy.wait_group(STAGES - 2)  # this thread's cp.async of step c landed (one group per step)
    fence_async_shared()  # ... visible to the async-proxy wgmma (and the word loads before a TMA refill)
    gl.thread_barrier()  # ... from every thread
    acc0 = warpgroup_mma(a0, xs, acc0, use_acc=use_acc, is_async=True)
    acc1, a1, acc0 = warpgroup_mma_wait(num_outstanding=1, deps=(acc1, a1, acc0))  # step c - 1 done
    a1 = dense._swap_a(q.slice(HN, HN, dim=1), sraw1, selh, zbh, L3h, a_layout, HN, False)
    acc1 = warpgroup_mma(a1, xs, acc1, use_acc=use_acc, is_async=True)
    acc0, a0, acc1 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0, a0, acc1))  # half 0 done
    return acc0, acc1, a1


@gluon.jit
def _halves_tile(acc0, acc1, a1, mma_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """LOOP 2's finished tile: retire the last wgmma, rows h * HN + r (as _tcgp_kloop2) -> (tile, acc1, a1)."""
    acc1, a1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, a1))
    tile = gl.convert_layout(gl.reshape(gl.permute(gl.join(acc0, acc1), (2, 0, 1)), (BLOCK_N, BLOCK_M)), mma_layout)
    return tile, acc1, a1


@gluon.jit
def _moe_tcgq_kernel(x_ptr, q_desc, s_ptr, y_ptr, topk_w_ptr, sorted_ptr, expert_ptr, npost_ptr, num_valid, a_div,
                     out_div, N, K, stride_xm, stride_ym, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, GROUP_M: gl.constexpr, MUL_ROUTED: gl.constexpr, REDUCE: gl.constexpr,
                     num_warps: gl.constexpr, LOOP: gl.constexpr = 0, NESTED: gl.constexpr = 0):
    """The tcgp loop made persistent (PERSIST 1): one program per SM walks its tiles as one flat sequence of
    (tile, K step) steps through one load ring, so the loads of a tile's first steps are in flight while the tile
    before finishes its last wgmmas and its epilogue (session 8 probes: the tcgp loop spends ~145 of 198.6 us
    outside decode and MMA — loads, barriers, tile start / finish; Qwen3's down projection has 6 K steps a tile).
    Step / tile positions are counters carried through the loop (no runtime division per step).
    NESTED (PERSIST 2): the consumer as a tile loop around a K-step loop (_consume_nested), the producer unchanged."""
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
    if NESTED:
        _consume_nested(q_desc, x_smem, q_smem, epi, bars, s_ptr, y_ptr, topk_w_ptr, sorted_ptr, expert_ptr, x_ptr,
                        p_t, p_s, p_n, p_e, p_x, pid, G, n_real, N, K, n_steps, total, num_valid, a_div, stride_xm,
                        out_div, stride_ym, sel, zb, cols, L3, a_layout, mma_layout, BLOCK_M, BLOCK_N, STAGES,
                        GROUP_M, MUL_ROUTED, REDUCE, LOOP, num_warps)
    else:
        # consumer: c_t / s the tile and K step it computes; c_m / c_n that tile's block and columns (the epilogue),
        # n_n / n_e the columns and expert of the next step's tile (its scales are loaded a step ahead)
        c_t = 0
        s = 0
        c_m, c_n, n_e = _tile_coords(0, pid, G, n_real, N, expert_ptr, BLOCK_N, GROUP_M)
        n_m = c_m
        n_n = c_n
        if LOOP == 2:  # the race-free step (as _tcgp_kloop2's row halves; BN >= 32 warps): two wgmma on two A sets
            HN: gl.constexpr = BLOCK_N // 2
            selh, zbh, colh, s_next0, s_next1, acc0, acc1, a1 = _halves_start(s_ptr, n_e, n_n, n_steps, N, a_layout,
                                                                              mma_layout, BLOCK_M, BLOCK_N)
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
                acc0, acc1, a1 = _step_halves(q_smem.index(slot), x_smem.index(slot).permute((1, 0)), sraw0, sraw1,
                                              acc0, acc1, a1, s != 0, selh, zbh, a_layout, BLOCK_N, STAGES)
            else:
                sraw = s_next.to(gl.bfloat16)
                s_next = gl.load(s_ptr + (n_e * n_steps + s1).to(gl.int64) * N + n_n + cols,
                                 mask=(n_n + cols < N) & (c + 1 < total), other=0.0)
                mbarrier.wait(bars.index(slot), (c // STAGES) & 1)
                acc = _step_one(q_smem, x_smem, slot, sraw, acc, s, sel, zb, L3, a_layout, BLOCK_N, STAGES)
            gl.thread_barrier()  # ... in every warpgroup, before one thread refills it
            nxt = c + STAGES - 1
            ns = nxt % STAGES
            p_t, p_s, p_n, p_e, p_x = _issue_step(q_desc, bars.index(ns), q_smem.index(ns), x_smem.index(ns), nxt,
                                                  total, p_t, p_s, p_n, p_e, p_x, pid, G, n_real, N, K, n_steps,
                                                  expert_ptr, x_ptr, sorted_ptr, num_valid, a_div, stride_xm, BLOCK_M,
                                                  BLOCK_N, GROUP_M, num_warps)
            if last:  # its epilogue while the next tile's first loads are in flight
                if LOOP == 2:
                    tile, acc1, a1 = _halves_tile(acc0, acc1, a1, mma_layout, BLOCK_M, BLOCK_N)
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
def _consume_nested(q_desc, x_smem, q_smem, epi, bars, s_ptr, y_ptr, topk_w_ptr, sorted_ptr, expert_ptr, x_ptr,
                    p_t, p_s, p_n, p_e, p_x, pid, G, n_real, N, K, n_steps, total, num_valid, a_div, stride_xm,
                    out_div, stride_ym, sel, zb, cols, L3: gl.constexpr, a_layout: gl.constexpr,
                    mma_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    GROUP_M: gl.constexpr, MUL_ROUTED: gl.constexpr, REDUCE: gl.constexpr, LOOP: gl.constexpr,
                    num_warps: gl.constexpr):
    """the persistent consumer as one outer iteration per tile around its K steps, the epilogue after the inner
    loop. Why: the flat loop's latch joins the path through the tile epilogue (its wait(0), nothing in flight) with
    the plain step (one wgmma in flight), and ptxas then drains the wgmma pipe at every latch (C7517; offline sm_90a).
    Here the inner latch always has one wgmma in flight and the outer one none, as in the tcgp loop. Once the wgmma
    overlaps the decode, the one-A step (LOOP 0) has tcgp's register-A race again: LOOP 2 is its row-halves step
    (as _tcgp_kloop2; BN >= 32 warps). The producer (_issue_step) keeps running across tiles, one ring for all."""
    HN: gl.constexpr = BLOCK_N // 2
    c_m, c_n, c_e = _tile_coords(0, pid, G, n_real, N, expert_ptr, BLOCK_N, GROUP_M)
    if LOOP == 2:
        selh, zbh, colh, s_next0, s_next1, acc0, acc1, a1 = _halves_start(s_ptr, c_e, c_n, n_steps, N, a_layout,
                                                                          mma_layout, BLOCK_M, BLOCK_N)
    else:
        s_next = gl.load(s_ptr + (c_e * n_steps).to(gl.int64) * N + c_n + cols, mask=c_n + cols < N, other=0.0)
        acc = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.float32, layout=mma_layout)
    c = 0  # the flat step (ring slot and phase)
    for t in range(total // n_steps):
        n_m = c_m  # the next tile's block / columns / expert (the last step's scale prefetch; none after the last)
        n_n = c_n
        n_e = c_e
        if c + n_steps < total:
            n_m, n_n, n_e = _tile_coords(t + 1, pid, G, n_real, N, expert_ptr, BLOCK_N, GROUP_M)
        for s in range(n_steps):
            slot = c % STAGES
            last = s == n_steps - 1
            r_e = gl.where(last, n_e, c_e)  # the next step's scales: this tile's step s + 1 or the next tile's 0
            r_n = gl.where(last, n_n, c_n)
            s_row = s_ptr + (r_e * n_steps + gl.where(last, 0, s + 1)).to(gl.int64) * N + r_n
            if LOOP == 2:
                sraw0 = s_next0.to(gl.bfloat16)
                sraw1 = s_next1.to(gl.bfloat16)
                s_next0 = gl.load(s_row + colh, mask=(r_n + colh < N) & (c + 1 < total), other=0.0)
                s_next1 = gl.load(s_row + HN + colh, mask=(r_n + HN + colh < N) & (c + 1 < total), other=0.0)
            else:
                sraw = s_next.to(gl.bfloat16)
                s_next = gl.load(s_row + cols, mask=(r_n + cols < N) & (c + 1 < total), other=0.0)
            mbarrier.wait(bars.index(slot), (c // STAGES) & 1)
            q = q_smem.index(slot)
            if LOOP == 2:
                acc0, acc1, a1 = _step_halves(q, x_smem.index(slot).permute((1, 0)), sraw0, sraw1, acc0, acc1, a1,
                                              s != 0, selh, zbh, a_layout, BLOCK_N, STAGES)
            else:
                acc = _step_one(q_smem, x_smem, slot, sraw, acc, s, sel, zb, L3, a_layout, BLOCK_N, STAGES)
            gl.thread_barrier()  # ... in every warpgroup, before one thread refills it
            nxt = c + STAGES - 1
            ns = nxt % STAGES
            p_t, p_s, p_n, p_e, p_x = _issue_step(q_desc, bars.index(ns), q_smem.index(ns), x_smem.index(ns), nxt,
                                                  total, p_t, p_s, p_n, p_e, p_x, pid, G, n_real, N, K, n_steps,
                                                  expert_ptr, x_ptr, sorted_ptr, num_valid, a_div, stride_xm,
                                                  BLOCK_M, BLOCK_N, GROUP_M, num_warps)
            c += 1
        if LOOP == 2:  # (the next tile's first loads are in flight meanwhile)
            tile, acc1, a1 = _halves_tile(acc0, acc1, a1, mma_layout, BLOCK_M, BLOCK_N)
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            tile = acc
        _store_t_staged(tile, epi, y_ptr, topk_w_ptr, sorted_ptr, c_m, c_n, N, num_valid, out_div, stride_ym,
                        BLOCK_M, BLOCK_N, MUL_ROUTED, REDUCE, num_warps)
        c_m = n_m
        c_n = n_n
        c_e = n_e
