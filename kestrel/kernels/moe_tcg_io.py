"""Device helpers every grouped Gluon MoE kernel (moe_tcg*.py) shares: which (expert block, N tile) a program
computes, the pointers of an expert block's gathered x rows, one ring slot's loads (words by TMA, x rows by
cp.async), and the epilogue that puts acc^T into the slots' rows (bf16) or the tokens' rows (fp32 atomics).
Kept apart from the kernels so the five K loops cannot drift apart on addressing or routing."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from kestrel.kernels.gemm_wna16_tcg import BK, R


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
def _tile_start(expert_ptr, pid_m, pid_n, K, BLOCK_N: gl.constexpr):
    """(expert, first column, K steps) of a real expert block's tile (the kernel has returned for padding blocks)."""
    expert = gl.load(expert_ptr + pid_m)
    off_n = pid_n * BLOCK_N
    n_steps = K // BK
    gl.assume(n_steps > 0)  # (dense tcg: without it the zero-trip path serialises every wgmma)
    return expert, off_n, n_steps


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
