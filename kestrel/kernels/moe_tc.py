"""Grouped MoE GEMM for planar int4 experts (moe_mv.PlanarW4) at large token counts: one wide tensor-core dot per
128-deep K step.

Why a third grouped kernel: from ~64 slots per expert the grouped GEMM is compute bound, and moe_mv's K loop (eight
K=16 MMAs per planar block, each with its own [BM, 16] activation load and operand shuffle) reached half of Humming's
MoE GEMM on Qwen3-30B-A3B at M = 1024 (bench/results/moe_h200_run4.md). This kernel takes the dense WNA16 "tc" K
step instead (gemm_wna16_tc._w_tile: the [R, BN] word tile decoded to one [128, BN] bf16 tile, k in order, group
scale folded in) against one [BM, 128] activation tile that the pipeliner stages in shared memory, so each step is
one tl.dot with K = 128 (wgmma on Hopper). Prologue / epilogue as moe_mv: program -> (expert block, n tile), token
rows from moe_align, routing weight, bf16 store or fp32 atomics into each token's row (reduce_k).

Numerics: the weight tile is rounded to bf16 after scaling (as Humming and the dense tc kernel do); moe_mv keeps
the unscaled codes exact and scales the fp32 partial. DEC 0 rounds (c - 8) * s once from fp32; DEC 1/2 (GPU only,
packed PTX) multiply by the bf16-rounded scale.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kestrel.kernels.gemm_wna16_tc import _w_tile
from kestrel.kernels.lowbit import round_bf16
from kestrel.kernels.moe_mv import DictConfig, PlanarW4, check_launch
from kestrel.quant.packing import PLANE_ROWS


@dataclass(frozen=True)
class TcConfig(DictConfig):
    """compute config of the grouped tc kernel (BM = rows per expert block, shared with moe_align)."""
    BM: int = 64
    BN: int = 128
    num_warps: int = 4
    num_stages: int = 3
    SWAP: int = 0  # 1: decoded W as the wgmma A operand (registers), x^T as B
    DEC: int = 1  # weight decode on the GPU: 0 fp32 (one rounding), 1 packed PTX, 2 packed PTX sharing a permute
    GROUP_M: int = 8  # expert blocks that walk the N tiles together (their weight tiles shared through the L2)
    SPLIT_K = 1  # no K split (a class constant, not a field: callers that read any config's SPLIT_K see 1)


@triton.jit
def _moe_tc_kernel(x_ptr, qw_ptr, s_ptr, y_ptr, topk_w_ptr, sorted_ptr, expert_ptr, npost_ptr,
                   num_valid, a_div, out_div, N, K, stride_xm, stride_ym, stride_qe, stride_se,
                   GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
                   SWAP: tl.constexpr, DEC: tl.constexpr, GROUP_M: tl.constexpr, EVEN_N: tl.constexpr,
                   DOT_F32: tl.constexpr, MUL_ROUTED: tl.constexpr, REDUCE: tl.constexpr, R: tl.constexpr):
    PB: tl.constexpr = R * 8
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_m = tl.num_programs(0) // num_pid_n
    pid_m, pid_n = tl.swizzle2d(pid // num_pid_n, pid % num_pid_n, num_pid_m, num_pid_n, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(npost_ptr):  # padding blocks past the last expert's run
        return
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    tok = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = tok < num_valid
    a_rows = tl.where(row_ok, tok // a_div, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if EVEN_N:
        offs_n_ld = offs_n
    else:
        offs_n_ld = tl.minimum(offs_n, N - 1)
    qw_e = qw_ptr + expert * stride_qe
    s_e = s_ptr + expert * stride_se
    n_blocks = K // PB
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kx = tl.arange(0, PB)
    for step in tl.range(0, n_blocks, num_stages=NUM_STAGES):
        x = tl.load(x_ptr + a_rows[:, None] * stride_xm + (step * PB + kx)[None, :])
        # format constexprs: 4-bit ints, 8 per word, symmetric (code offset 8), fp32 scales in groups along K
        if DOT_F32:  # interpreter: its bf16 dot is wrong and its cast truncates; fp32 operands, rounded as the GPU
            w = round_bf16(_w_tile(qw_e, s_e, s_e, step, n_blocks, offs_n_ld, n_mask, N, None, None, 4, 8, True, 1, 0,
                                   8, False, 0, GROUP_SIZE, False, 1, BLOCK_N, 0, True, 0, R, 0, tl.float32))
            x = x.to(tl.float32)
        else:
            w = _w_tile(qw_e, s_e, s_e, step, n_blocks, offs_n_ld, n_mask, N, None, None, 4, 8, True, 1, 0, 8, False,
                        0, GROUP_SIZE, False, 1, BLOCK_N, 0, True, 0, R, DEC, x_ptr.dtype.element_ty)
        if SWAP:
            acc = tl.dot(tl.trans(w), tl.trans(x), acc)
        else:
            acc = tl.dot(x, w, acc)
    if SWAP:
        acc = tl.trans(acc)
    if MUL_ROUTED:
        acc = acc * tl.load(topk_w_ptr + tok, mask=row_ok, other=0.0)[:, None]
    mask = row_ok[:, None] & n_mask[None, :]
    if REDUCE:  # each slot into its token's row (zeroed by the host): fp32 atomics, the k additions in no fixed order
        y_rows = (tok // out_div).to(tl.int64)
        tl.atomic_add(y_ptr + y_rows[:, None] * stride_ym + offs_n[None, :], acc, mask=mask, sem="relaxed")
    else:
        if DOT_F32 and y_ptr.dtype.element_ty == tl.bfloat16:
            acc = round_bf16(acc)  # interpreter: its bf16 cast truncates, the GPU's rounds to nearest
        tl.store(y_ptr + tok.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mask)


def grouped_gemm_planar_tc(x: torch.Tensor, w: PlanarW4, align, num_slots: int, a_div: int, out: torch.Tensor,
                           cfg: TcConfig, topk_weights: torch.Tensor | None = None, reduce_k: int = 0) -> torch.Tensor:
    """same contract as moe_mv.grouped_gemm_planar: out[slot] = x[slot // a_div] @ W[expert(slot)]^T (x routing
    weight); reduce_k > 0: out fp32 [num_slots // reduce_k, N] gets each token's sum over its slots."""
    sorted_ids, expert_ids, num_post = align
    E, N, K, blocks = check_launch(x, w, align, num_slots, out, cfg.BM, reduce_k)
    on_gpu = x.is_cuda
    # the packed-PTX decode runs on the GPU only; DEC 2 needs the layout the dense tc kernel checked (its rule)
    dec = cfg.DEC if on_gpu else 0
    if not on_gpu and x.dtype != torch.bfloat16:
        raise ValueError("the tc grouped kernel's interpreter path emulates bf16 activations only")
    if dec == 2 and not (cfg.BN == 128 and cfg.num_warps == 8 and N % 128 == 0):
        dec = 1
    tw = topk_weights if topk_weights is not None else out
    _moe_tc_kernel[(blocks * triton.cdiv(N, cfg.BN),)](
        x, w.qweight, w.scales, out, tw, sorted_ids, expert_ids, num_post,
        num_slots, a_div, max(reduce_k, 1), N, K, x.stride(0), out.stride(0), w.qweight.stride(0),
        w.scales.stride(0),
        GROUP_SIZE=w.group, BLOCK_M=cfg.BM, BLOCK_N=cfg.BN, NUM_STAGES=cfg.num_stages, SWAP=bool(cfg.SWAP),
        DEC=dec, GROUP_M=cfg.GROUP_M, EVEN_N=N % cfg.BN == 0, DOT_F32=not on_gpu,
        MUL_ROUTED=topk_weights is not None, REDUCE=reduce_k > 0, R=PLANE_ROWS,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
