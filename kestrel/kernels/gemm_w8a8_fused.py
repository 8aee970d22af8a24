"""FP8 W8A8 / W4A8 decode GEMM with the activation quantization inside: bf16 x in, bf16 y out, one launch.

Why: at decode sizes (M <= 64) the FP8 GEMM is a weight stream of ~20 us, and the separate per-token quant launch
(+ the split-K zero-fill and cast launches) cost ~6 us more (bench/results/gemm_w8a8_h200_run3.md: 0.82x Humming at
M = 1, whose W8A8 kernel quantizes in place). Here each program quantizes the [BM, 128] activation tile it is about
to multiply, per (token, 128-wide K group) — DeepSeek-style 1x128 dynamic scales, finer than per token, so no pass
over the whole row is needed before the K loop — runs the fp8 MMA and scales the partial product by the group scale.
Split-K finishes in the same launch (the last split of a tile sums the fp32 partials in a fixed order,
gemm_wna16_small._finish), so nothing is zero-filled or cast afterwards.

W4A8 (gemm_w4a8_fused): the same loop over an int4 weight in the "halves" packing, each byte tile decoded in
registers to two fp8 tiles (the W4A8 kernel's exact PTX decode), two dots per 128-wide K tile, the partial scaled by
the activation group scale x the weight group scale (groups of 128: one per K tile). Separate per-token quant + the
W4A8 GEMM cost 29.4 us at 8192x8192 M = 1 against Humming's 19.1 (bench/results/gemm_w8a8_h200_run3.md).

Numerics (what tests/test_gemm_w8a8_fused.py checks against float64): x ~= q * s with s = amax / 448 per group,
q = e4m3(x * (448 / amax)), weight fp8 x per-channel scale (or int4 x group scale), fp32 accumulation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kestrel.kernels.gemm_wna16_small import _finish, _workspace
from kestrel.kernels.lowbit import round_e4m3
from kestrel.kernels.lowbit_gemm import DECODE_ASM, int4_halves_to_e4m3

GROUP = 128  # activation scale group along K (= the K tile)


@triton.jit
def _quant_group(x, EMULATE: tl.constexpr):
    """fp32 [BM, G] -> (e4m3 values, dequant multiplier per row): one 128-wide (token, group) scale."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10)
    y = tl.minimum(tl.maximum(x * tl.math.div_rn(448.0, amax)[:, None], -448.0), 448.0)
    if EMULATE:  # interpreter: its fp32 -> e4m3 cast truncates; the GPU's rounds to nearest even
        y = round_e4m3(y)
    return y.to(tl.float8e4nv), tl.math.div_rn(amax, 448.0)


@triton.jit
def _w8a8_fused_kernel(x_ptr, w_ptr, ws_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       stride_wsn, split_k, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       SPLIT: tl.constexpr, SWAP: tl.constexpr, NUM_STAGES: tl.constexpr, EMULATE: tl.constexpr,
                       W4: tl.constexpr, WG: tl.constexpr, ASM: tl.constexpr):
    """W4: int4 weight in the "halves" packing (gemm_w4a8.to_halves: byte j of a 128-wide K block holds k = j and
    j + 64), group scales [N, K // WG] (WG a multiple of BK); else fp8 [N, K] with a per-channel scale [N]."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    m_mask = offs_m < M
    rows = tl.where(m_mask, offs_m, 0).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    offs_nc = tl.where(n_mask, offs_n, 0).to(tl.int64)
    kk = tl.arange(0, BK)
    kh = tl.arange(0, BK // 2)
    n_k = K // BK
    per_split = tl.cdiv(n_k, split_k)
    k_lo = pid_k * per_split * BK
    k_hi = tl.minimum(k_lo + per_split * BK, K)
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=NUM_STAGES):
        if W4:
            # the two K halves of the tile quantized under one (token, 128) scale, each fed to its own dot
            x_lo = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + kh)[None, :], mask=m_mask[:, None],
                           other=0.0).to(tl.float32)
            x_hi = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + BK // 2 + kh)[None, :], mask=m_mask[:, None],
                           other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + offs_nc[:, None] * stride_wn + (k0 // 2 + kh)[None, :])  # [BN, BK / 2] bytes
            w_lo, w_hi = int4_halves_to_e4m3(wp, ASM)
            amax = tl.maximum(tl.maximum(tl.max(tl.abs(x_lo), axis=1), tl.max(tl.abs(x_hi), axis=1)), 1e-10)
            inv = tl.math.div_rn(448.0, amax)[:, None]
            y_lo = tl.minimum(tl.maximum(x_lo * inv, -448.0), 448.0)
            y_hi = tl.minimum(tl.maximum(x_hi * inv, -448.0), 448.0)
            if EMULATE:
                y_lo = round_e4m3(y_lo)
                y_hi = round_e4m3(y_hi)
            q_lo = y_lo.to(tl.float8e4nv)
            q_hi = y_hi.to(tl.float8e4nv)
            s = tl.math.div_rn(amax, 448.0)
            sw = tl.load(ws_ptr + offs_nc * stride_wsn + k0 // WG)  # the weight group scale of this K tile
            if SWAP:
                part = tl.dot(w_lo, tl.trans(q_lo))
                part = tl.dot(w_hi, tl.trans(q_hi), part)
                acc += part * s[None, :] * sw[:, None]
            else:
                part = tl.dot(q_lo, tl.trans(w_lo))
                part = tl.dot(q_hi, tl.trans(w_hi), part)
                acc += part * s[:, None] * sw[None, :]
        else:
            x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + kk)[None, :], mask=m_mask[:, None],
                        other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs_nc[:, None] * stride_wn + (k0 + kk)[None, :])  # [BN, BK] fp8, K contiguous
            q, s = _quant_group(x, EMULATE)
            if SWAP:  # weight rows on the MMA's 64-row side, the few tokens its N side
                acc += tl.dot(w, tl.trans(q)) * s[None, :]
            else:
                acc += tl.dot(q, tl.trans(w)) * s[:, None]
    if SWAP:
        acc = tl.trans(acc)
    if not W4:
        acc = acc * tl.load(ws_ptr + offs_nc)[None, :]
    _finish(acc, y_ptr, part_ptr, cnt_ptr, offs_m.to(tl.int64), offs_n, m_mask, n_mask, M, N, stride_ym,
            pid_m * tl.num_programs(0) + pid_n, pid_k, split_k, SPLIT)


@dataclass(frozen=True)
class FusedConfig:
    BM: int = 16
    BN: int = 64
    SPLIT_K: int = 2
    SWAP: int = 0
    num_warps: int = 4
    num_stages: int = 4


def fused_config(M: int, N: int, K: int, num_sms: int = 132) -> FusedConfig:
    """BN 128 tiles; K split while the programs stay under ~2 per SM (a weight stream needs bytes in flight).
    H200, 8192x8192 (bench/results/moe_h200_run5_r2.log, `bench/w8a8_fused_sweep.py`): BN 128 split 4 21.7 / 23.6 us
    at M = 1 / 16 against 25.4 / 26.4 for BN 64 split 2 (the previous rule's pick)."""
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    tiles = triton.cdiv(N, 128) * triton.cdiv(M, bm)
    split = 1
    while split < 8 and tiles * split * 2 <= 2 * num_sms and K // (GROUP * split * 2) >= 4:
        split *= 2
    return FusedConfig(BM=bm, BN=128, SPLIT_K=split, SWAP=int(bm <= 16))


def gemm_w8a8_fused(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out_dtype=torch.bfloat16,
                    config: FusedConfig | None = None) -> torch.Tensor:
    """bf16 x [M, K] (K % 128 == 0) x fp8 weight [N, K] with per-channel scale [N] -> [M, N] out_dtype;
    activations quantized per (token, 128-K group) inside the kernel."""
    M, K = x.shape
    N = w_q.shape[0]
    if w_q.dtype != torch.float8_e4m3fn or w_q.shape[1] != K or w_scale.numel() != N or K % GROUP:
        raise ValueError(f"gemm_w8a8_fused: fp8 weight [N, {K}] with per-channel scale [N] and K % {GROUP} == 0 "
                         f"needed, got {tuple(w_q.shape)} {w_q.dtype}, scale {tuple(w_scale.shape)}")
    ws = w_scale.float().reshape(-1).contiguous()
    return _launch(x, w_q.contiguous(), ws, 1, 0, out_dtype, config)


def gemm_w4a8_fused(x: torch.Tensor, w, out_dtype=torch.bfloat16, config: FusedConfig | None = None) -> torch.Tensor:
    """bf16 x [M, K] x int4 W4Weight [N, K] in the "halves" packing with group scales (groups of 128 or a multiple;
    per channel = one group of K) -> [M, N]; activations quantized per (token, 128) inside, fp8 MMA."""
    M, K = x.shape
    N = w.shape[0]
    group = K if w.group in (-1, K) else w.group
    if w.fmt != "int4" or w.layout != "halves" or w.shape[1] != K or group % GROUP or K % GROUP:
        raise ValueError(f"gemm_w4a8_fused: int4 weight [N, {K}] in the halves packing with groups of a multiple of "
                         f"{GROUP} needed, got {w.fmt} {w.layout} {tuple(w.shape)} group {w.group}")
    ws = w.scale.float().reshape(N, K // group).contiguous()
    return _launch(x, w.packed.contiguous(), ws, ws.stride(0), group, out_dtype, config)


def _launch(x, wd, ws, stride_wsn: int, w4_group: int, out_dtype, config):
    M, K = x.shape
    N = wd.shape[0]
    cfg = config or fused_config(M, N, K)
    x = x.contiguous()
    y = torch.empty((M, N), dtype=out_dtype, device=x.device)
    if M == 0:
        return y
    grid = (triton.cdiv(N, cfg.BN), triton.cdiv(M, cfg.BM), max(1, min(cfg.SPLIT_K, K // GROUP)))
    if grid[2] > 1:
        part, cnt = _workspace(x.device, grid[2] * M * N, grid[0] * grid[1])
    else:
        part, cnt = y, y
    _w8a8_fused_kernel[grid](x, wd, ws, y, part, cnt, M, N, K, x.stride(0), wd.stride(0), y.stride(0), stride_wsn,
                             grid[2], BM=cfg.BM, BN=cfg.BN, BK=GROUP, SPLIT=grid[2] > 1, SWAP=bool(cfg.SWAP),
                             NUM_STAGES=cfg.num_stages, EMULATE=not x.is_cuda, W4=w4_group > 0, WG=max(w4_group, 1),
                             ASM=0 if not x.is_cuda else DECODE_ASM, num_warps=cfg.num_warps,
                             num_stages=cfg.num_stages)
    return y


def ref_act_groups(x: torch.Tensor) -> torch.Tensor:
    """the kernels' activation quantization, per (token, 128) group in fp32 with torch casts, dequantized (float64)."""
    M, K = x.shape
    xg = x.float().view(M, K // GROUP, GROUP)
    amax = xg.abs().amax(-1, keepdim=True).clamp_min(1e-10)
    inv = torch.full_like(amax, 448.0) / amax  # IEEE division, as div_rn (a scalar / tensor can round differently)
    q = (xg * inv).clamp(-448, 448).to(torch.float8_e4m3fn).double()
    return (q * (amax / 448.0).double()).view(M, K)


def ref_w8a8_fused(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """reference: per (token, 128) group quantization (ref_act_groups), then a float64 matmul of the dequantized
    operands."""
    return ref_act_groups(x) @ (w_q.double() * w_scale.double().reshape(-1, 1)).t()
