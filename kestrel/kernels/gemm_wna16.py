"""Triton WNA16 GEMM: y[M, N] = x[M, K] (bf16/fp16) @ dequant(W)[N, K]^T for every weight format in QuantSpec.

Two kernels, JIT-specialised by constexprs per (format, ComputeConfig):
- `_gemv_kernel` (M == 1): streams the packed weight tile by tile with wide loads, decodes in registers and
  accumulates on CUDA cores into a [BN, BKW, EPW] register tile reduced once at the end.
- `_dot_kernel` (M > 1): tensor cores with the *weights as the A operand* (acc[BN, BM] = W_tile @ x_tile^T), so a
  small M only fills the MMA's narrow N side (Marlin-style swap) and the dequantized tile can stay in registers.
Both split K across programs (SPLIT_K) for shapes whose N alone cannot fill the GPU; partial sums then meet in a
zeroed fp32 buffer through atomic adds.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from kestrel.kernels.configs import ComputeConfig, LayerConfig, TuningConfig
from kestrel.kernels.dequant import decode_codes, decode_scale, unpack_tile
from kestrel.quant.weight import QuantizedWeight

_SCALE_KIND = {"fp16": 0, "bf16": 0, "fp32": 0, "e8m0": 1, "fp8_e4m3": 2}


@triton.jit
def _load_dequant(qw_ptr, s_ptr, z_ptr, kt, offs_n, n_mask, N,
                  BITS: tl.constexpr, EPW: tl.constexpr, IS_INT: tl.constexpr, EXP_BITS: tl.constexpr,
                  MAN_BITS: tl.constexpr, CODE_OFFSET: tl.constexpr, HAS_ZERO: tl.constexpr,
                  SCALE_KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, PER_CHANNEL: tl.constexpr,
                  SCALE_INSIDE: tl.constexpr, BLOCK_K: tl.constexpr):
    """K tile `kt` of W -> fp32 values [BN, BKW, EPW]; scaled here only when SCALE_INSIDE (groups < tile)."""
    BKW: tl.constexpr = BLOCK_K // EPW
    offs_w = kt * BKW + tl.arange(0, BKW)
    q = tl.load(qw_ptr + offs_w[None, :] * N + offs_n[:, None], mask=n_mask[:, None], other=0)
    codes = unpack_tile(q, BITS, EPW)
    if SCALE_INSIDE:
        kk = kt * BLOCK_K + tl.arange(0, BKW)[None, :, None] * EPW + tl.arange(0, EPW)[None, None, :]
        g_off = (kk // GROUP_SIZE) * N + offs_n[:, None, None]
        if HAS_ZERO:
            zero = tl.load(z_ptr + g_off, mask=n_mask[:, None, None], other=0).to(tl.float32)
        else:
            zero = CODE_OFFSET * 1.0
        s = decode_scale(tl.load(s_ptr + g_off, mask=n_mask[:, None, None], other=0), SCALE_KIND)
        return decode_codes(codes, zero, IS_INT, EXP_BITS, MAN_BITS) * s
    else:
        if HAS_ZERO:
            g = 0 if PER_CHANNEL else (kt * BLOCK_K) // GROUP_SIZE
            zero = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)[:, None, None]
        else:
            zero = CODE_OFFSET * 1.0
        return decode_codes(codes, zero, IS_INT, EXP_BITS, MAN_BITS)


@triton.jit
def _tile_scale(s_ptr, kt, offs_n, n_mask, N, SCALE_KIND: tl.constexpr, GROUP_SIZE: tl.constexpr,
                PER_CHANNEL: tl.constexpr, BLOCK_K: tl.constexpr):
    g = 0 if PER_CHANNEL else (kt * BLOCK_K) // GROUP_SIZE
    return decode_scale(tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0), SCALE_KIND)


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, gs_ptr, y_ptr, N, K, stride_xm, stride_ym,
                 BITS: tl.constexpr, EPW: tl.constexpr, IS_INT: tl.constexpr, EXP_BITS: tl.constexpr,
                 MAN_BITS: tl.constexpr, CODE_OFFSET: tl.constexpr, HAS_ZERO: tl.constexpr,
                 SCALE_KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, PER_CHANNEL: tl.constexpr,
                 HAS_GSCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    BKW: tl.constexpr = BLOCK_K // EPW
    SCALE_INSIDE: tl.constexpr = (not PER_CHANNEL) and GROUP_SIZE < BLOCK_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_tiles = K // BLOCK_K
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt0 = pid_k * per_split
    kt1 = tl.minimum(kt0 + per_split, k_tiles)
    acc3 = tl.zeros((BLOCK_N, BKW, EPW), dtype=tl.float32)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    x_row = x_ptr + pid_m * stride_xm
    kin = tl.arange(0, BKW)[:, None] * EPW + tl.arange(0, EPW)[None, :]
    for kt in tl.range(kt0, kt1, num_stages=NUM_STAGES):
        w = _load_dequant(qw_ptr, s_ptr, z_ptr, kt, offs_n, n_mask, N, BITS, EPW, IS_INT, EXP_BITS, MAN_BITS,
                          CODE_OFFSET, HAS_ZERO, SCALE_KIND, GROUP_SIZE, PER_CHANNEL, SCALE_INSIDE, BLOCK_K)
        x = tl.load(x_row + kt * BLOCK_K + kin).to(tl.float32)
        if SCALE_INSIDE or PER_CHANNEL:
            acc3 += w * x[None, :, :]
        else:
            # one group per tile: reduce the tile, then scale (saves a multiply per weight)
            s = _tile_scale(s_ptr, kt, offs_n, n_mask, N, SCALE_KIND, GROUP_SIZE, PER_CHANNEL, BLOCK_K)
            acc += tl.sum(tl.sum(w * x[None, :, :], axis=2), axis=1) * s
    if SCALE_INSIDE or PER_CHANNEL:
        acc = tl.sum(tl.sum(acc3, axis=2), axis=1)
    if PER_CHANNEL:
        acc = acc * _tile_scale(s_ptr, 0, offs_n, n_mask, N, SCALE_KIND, GROUP_SIZE, PER_CHANNEL, BLOCK_K)
    if HAS_GSCALE:
        acc = acc * tl.load(gs_ptr)
    y_ptrs = y_ptr + pid_m * stride_ym + offs_n
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=n_mask)


@triton.jit
def _dot_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, gs_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                BITS: tl.constexpr, EPW: tl.constexpr, IS_INT: tl.constexpr, EXP_BITS: tl.constexpr,
                MAN_BITS: tl.constexpr, CODE_OFFSET: tl.constexpr, HAS_ZERO: tl.constexpr,
                SCALE_KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, PER_CHANNEL: tl.constexpr,
                HAS_GSCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_F32: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    SCALE_INSIDE: tl.constexpr = (not PER_CHANNEL) and GROUP_SIZE < BLOCK_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_tiles = K // BLOCK_K
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    kt0 = pid_k * per_split
    kt1 = tl.minimum(kt0 + per_split, k_tiles)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for kt in tl.range(kt0, kt1, num_stages=NUM_STAGES):
        xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (kt * BLOCK_K + offs_k)[:, None], mask=m_mask[None, :],
                     other=0.0)  # [BK, BM]
        w = _load_dequant(qw_ptr, s_ptr, z_ptr, kt, offs_n, n_mask, N, BITS, EPW, IS_INT, EXP_BITS, MAN_BITS,
                          CODE_OFFSET, HAS_ZERO, SCALE_KIND, GROUP_SIZE, PER_CHANNEL, SCALE_INSIDE, BLOCK_K)
        w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(x_ptr.dtype.element_ty)
        if DOT_F32:  # the CPU interpreter's bf16 dot is wrong; fp32 operands hold the same (bf16-rounded) values
            w = w.to(tl.float32)
            xt = xt.to(tl.float32)
        if SCALE_INSIDE or PER_CHANNEL:
            acc = tl.dot(w, xt, acc)
        else:
            s = _tile_scale(s_ptr, kt, offs_n, n_mask, N, SCALE_KIND, GROUP_SIZE, PER_CHANNEL, BLOCK_K)
            acc += tl.dot(w, xt) * s[:, None]
    if PER_CHANNEL:
        acc = acc * _tile_scale(s_ptr, 0, offs_n, n_mask, N, SCALE_KIND, GROUP_SIZE, PER_CHANNEL, BLOCK_K)[:, None]
    if HAS_GSCALE:
        acc = acc * tl.load(gs_ptr)
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask)


def _gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def gemm_wna16(x: torch.Tensor, qw: QuantizedWeight, config: ComputeConfig | None = None) -> torch.Tensor:
    """x [..., K] bf16/fp16 -> [..., N] in x's dtype. `config` overrides the tuned/heuristic choice."""
    n, k = qw.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight expects {k}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"WNA16 activations must be bf16 or fp16, got {x.dtype}")
    spec = qw.spec
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if qw.perm is not None:
        x2 = x2.index_select(1, qw.perm)
    x2 = x2.contiguous()
    m = x2.shape[0]
    layer = LayerConfig(spec, n, k)
    cfg = config or TuningConfig(_gpu_name(x.device)).lookup(layer, m)
    if m > 1 and cfg.kernel == "gemv":  # the GEMV kernel re-reads W per row: use tensor cores instead
        cfg = replace(cfg, kernel="dot", block_m=16, block_k=max(16, cfg.block_k))
    if not cfg.valid_for(layer):
        raise ValueError(f"compute config {cfg} does not fit layer {layer.key}")
    split = cfg.split_k
    y = (torch.zeros if split > 1 else torch.empty)((m, n), device=x.device,
                                                       dtype=torch.float32 if split > 1 else x.dtype)
    if m == 0:
        return y.to(x.dtype).reshape(*lead, n)
    e, mbits = spec.minifloat or (0, 0)
    per_channel = spec.group_size == -1
    z = qw.zeros if qw.zeros is not None else qw.scales
    gsc = qw.global_scale if qw.global_scale is not None else qw.scales
    common = dict(BITS=spec.container_bits, EPW=spec.elems_per_word, IS_INT=spec.is_int, EXP_BITS=e, MAN_BITS=mbits,
                  CODE_OFFSET=spec.code_offset, HAS_ZERO=qw.zeros is not None, SCALE_KIND=_SCALE_KIND[spec.scale_dtype],
                  GROUP_SIZE=k if per_channel else qw.group_size, PER_CHANNEL=per_channel,
                  HAS_GSCALE=qw.global_scale is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
                  NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps)
    if cfg.kernel == "gemv":
        grid = (triton.cdiv(n, cfg.block_n), m, split)
        _gemv_kernel[grid](x2, qw.qweight, qw.scales, z, gsc, y, n, k, x2.stride(0), y.stride(0), **common)
    else:
        grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
        _dot_kernel[grid](x2, qw.qweight, qw.scales, z, gsc, y, m, n, k, x2.stride(0), y.stride(0),
                          BLOCK_M=cfg.block_m, DOT_F32=x.device.type != "cuda", **common)
    if split > 1:
        y = y.to(x.dtype)
    return y.reshape(*lead, n)
