"""The warp-specialised tcgp loop (TcgConfig.WS 1 / 2; the serving default for 64 / 80 / 96-row expert blocks):
a 4-warp loader partition fills the ring (words by TMA, gathered x rows by cp.async), the kernel's warps decode +
wgmma, slots handed over by ready / empty mbarriers instead of CTA barriers. The consumer comes as the one-A loop
(_ws_consume) and the race-free two-wgmma loop (LOOP 2, _ws_consume_halves)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kestrel.kernels import gemm_wna16_tcg as dense
from kestrel.kernels.gemm_wna16_tcg import BK, R
from kestrel.kernels.moe_tcg_io import _block_of, _gather_ptrs, _store_t, _tile_start


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
    expert, off_n, n_steps = _tile_start(expert_ptr, pid_m, pid_n, K, BLOCK_N)
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
