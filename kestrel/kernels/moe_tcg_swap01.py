"""The first two grouped Gluon MoE K loops (TcgConfig.SWAP 0 / 1; no longer a serving default, kept for the
benches and as the simplest references of the loop): SWAP 0 stores the decoded W tile to shared memory (acc
[BM, BN] = x @ W); SWAP 1 decodes W straight into the wgmma's register A operand (acc^T = W @ x^T) and waits for
each wgmma before the next decode lands in its registers. Both ring the fp32 scales through shared memory by TMA."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from kestrel.kernels import gemm_wna16_tcg as dense
# the dense kernel's planar block (16 word rows = 128 k), pair decode and wgmma layout: one copy for both
from kestrel.kernels.gemm_wna16_tcg import BK, R, _ASM_PAIR, _mma_layout
from kestrel.kernels.moe_tcg_io import _block_of, _gather_ptrs, _store_t, _tile_start


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
def _swap01_start(x_ptr, q_desc, s_desc, sorted_ptr, expert_ptr, pid_m, pid_n, num_valid, a_div, K, stride_xm,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """both loops' tile start: columns, K steps, the expert's first word / scale rows, the gathered x rows and the
    ring's x / word / scale buffers (the caller has returned for padding blocks)."""
    expert, off_n, n_steps = _tile_start(expert_ptr, pid_m, pid_n, K, BLOCK_N)
    qrow0 = expert * (K // 8)
    srow0 = expert * n_steps
    x_ptrs = _gather_ptrs(x_ptr, sorted_ptr, pid_m * BLOCK_M, num_valid, a_div, stride_xm, BLOCK_M, num_warps)
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BK], gl.bfloat16)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BK], x_layout)
    q_smem = gl.allocate_shared_memory(gl.int32, [STAGES, R, BLOCK_N], q_desc.layout)
    s_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_N], s_desc.layout)
    return off_n, n_steps, qrow0, srow0, x_ptrs, x_smem, q_smem, s_smem


@gluon.jit
def _moe_tcg_kernel(x_ptr, q_desc, s_desc, y_ptr, topk_w_ptr, sorted_ptr, expert_ptr, npost_ptr, num_valid, a_div,
                    out_div, N, K, stride_xm, stride_ym, num_m_blocks, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    STAGES: gl.constexpr, GROUP_M: gl.constexpr, MUL_ROUTED: gl.constexpr, REDUCE: gl.constexpr,
                    num_warps: gl.constexpr):
    pid_m, pid_n = _block_of(gl.program_id(0), num_m_blocks, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= gl.load(npost_ptr):  # padding blocks past the last expert's run
        return
    off_n, n_steps, qrow0, srow0, x_ptrs, x_smem, q_smem, s_smem = _swap01_start(
        x_ptr, q_desc, s_desc, sorted_ptr, expert_ptr, pid_m, pid_n, num_valid, a_div, K, stride_xm, BLOCK_M, BLOCK_N,
        STAGES, num_warps)
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
    off_n, n_steps, qrow0, srow0, x_ptrs, x_smem, q_smem, s_smem = _swap01_start(
        x_ptr, q_desc, s_desc, sorted_ptr, expert_ptr, pid_m, pid_n, num_valid, a_div, K, stride_xm, BLOCK_M, BLOCK_N,
        STAGES, num_warps)
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
