"""Triton WNA16 GEMM: y[M, N] = x[M, K] (bf16/fp16) @ dequant(W)[N, K]^T for every weight format in QuantSpec.

Kernels (JIT-specialised by constexprs per format and ComputeConfig; ComputeConfig.kernel picks one):
- "stream" (decode, CUDA cores, <= 4 rows of x per program): gemm_wna16_stream.py.
- "mv" / "mvs" / "gemv" (decode, M <= 16): gemm_wna16_small.py (tensor cores with a ~1-op/element decode, or
  CUDA-core FMAs; split-K reduced inside the same launch).
- "tc" (M > 16): gemm_wna16_tc.py.
- "dot"   (older tensor-core path): tensor cores on the same planar tiles: each bit field is an exact unscaled bf16/fp16
  [16, BN] operand for a K=16 MMA against x; group scales multiply the partial products.
- "dequant_mm" (large M, compute-bound): one bandwidth-bound Triton pass writes W as bf16, then cuBLAS; with
  chunks > 1 the pass for column block i+1 runs on a side stream under cuBLAS's matmul of block i.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.configs import ComputeConfig, LayerConfig, TuningConfig
from kestrel.kernels.dequant import decode_scale, fp_plane, int_to_f32
from kestrel.kernels.gemm_wna16_small import gemm_small
from kestrel.kernels.gemm_wna16_stream import gemm_stream
from kestrel.kernels.gemm_wna16_tc import dequant_matmul_streamed, dequantize_tc, gemm_wna16_tc
from kestrel.quant.packing import PLANE_ROWS
from kestrel.quant.weight import QuantizedWeight

_SCALE_KIND = {"fp16": 0, "bf16": 0, "fp32": 0, "e8m0": 1, "fp8_e4m3": 2}

@triton.jit
def _dot_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, gs_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                BITS: tl.constexpr, EPW: tl.constexpr, IS_INT: tl.constexpr, EXP_BITS: tl.constexpr,
                MAN_BITS: tl.constexpr, CODE_OFFSET: tl.constexpr, HAS_ZERO: tl.constexpr,
                SCALE_KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, PER_CHANNEL: tl.constexpr,
                HAS_GSCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_F32: tl.constexpr, R: tl.constexpr):
    """Tensor cores over the planar layout: each loaded [R, BN] word tile gives EPW exact bf16/fp16 planes of
    contiguous k, each multiplied by the matching [BM, R] slice of x (K=16 MMAs); the group scale multiplies the
    partial product of the planes that share a group."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    PB: tl.constexpr = R * EPW
    PPG: tl.constexpr = EPW if PER_CHANNEL else (EPW if GROUP_SIZE // R >= EPW else GROUP_SIZE // R)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    offs_r = tl.arange(0, R)
    n_blocks = tl.cdiv(K, PB)  # the packed K is padded to whole blocks; x is masked to K
    per_split = tl.cdiv(n_blocks, SPLIT_K)
    b0 = pid_k * per_split
    b1 = tl.minimum(b0 + per_split, n_blocks)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in tl.range(b0, b1, num_stages=NUM_STAGES):
        q = tl.load(qw_ptr + (b * R + offs_r)[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
        for i in tl.static_range(EPW):
            g = (b * PB + (i - i % PPG) * R) // GROUP_SIZE
            kx = b * PB + i * R + offs_r
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kx[None, :],
                        mask=m_mask[:, None] & (kx < K)[None, :], other=0.0)
            if IS_INT:
                if i % PPG == 0:
                    if HAS_ZERO:
                        zero = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)[None, :]
                    else:
                        zero = CODE_OFFSET * 1.0
                v = int_to_f32((q >> (i * BITS)) & ((1 << BITS) - 1)) - zero
            else:
                v = fp_plane(q, i, BITS, EXP_BITS, MAN_BITS)
            w = v.to(x_ptr.dtype.element_ty)
            if DOT_F32:  # the CPU interpreter's bf16 dot is wrong; fp32 operands hold the same rounded values
                w = w.to(tl.float32)
                x = x.to(tl.float32)
            if i % PPG == 0:
                part = tl.dot(x, w)
            else:
                part = tl.dot(x, w, part)
            if (i + 1) % PPG == 0:
                if PER_CHANNEL:
                    acc += part
                else:
                    acc += part * decode_scale(tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0),
                                               SCALE_KIND)[None, :]
    if PER_CHANNEL:
        acc = acc * decode_scale(tl.load(s_ptr + offs_n, mask=n_mask, other=0), SCALE_KIND)[None, :]
    if HAS_GSCALE:
        acc = acc * tl.load(gs_ptr)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask)


def _gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

def _format_args(qw: QuantizedWeight) -> dict:
    spec = qw.spec
    e, mbits = spec.minifloat or (1, 0)
    per_channel = spec.group_size == -1
    return dict(BITS=spec.container_bits, EPW=spec.elems_per_word, IS_INT=spec.is_int, EXP_BITS=e,
                MAN_BITS=mbits, CODE_OFFSET=spec.code_offset, HAS_ZERO=qw.zeros is not None,
                SCALE_KIND=_SCALE_KIND[spec.scale_dtype], GROUP_SIZE=qw.group_size,
                PER_CHANNEL=per_channel, HAS_GSCALE=qw.global_scale is not None, R=PLANE_ROWS)

def dequantize_gpu(qw: QuantizedWeight, dtype=torch.bfloat16, block_n: int = 128, num_warps: int = 8) -> torch.Tensor:
    """W[N, K] in `dtype`, decoded on the device with the tc GEMM's own tile decode (gemm_wna16_tc.dequantize_tc)."""
    return dequantize_tc(qw, _format_args(qw), dtype, block_n, num_warps)

def gemm_wna16(x: torch.Tensor, qw: QuantizedWeight, config: ComputeConfig | None = None) -> torch.Tensor:
    """x [..., K] bf16/fp16 -> [..., N] in x's dtype. `config` overrides the tuned/heuristic choice."""
    n, k = qw.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight expects {k}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"WNA16 activations must be bf16 or fp16, got {x.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if qw.perm is not None:
        x2 = x2.index_select(1, qw.perm)
    x2 = x2.contiguous()
    m = x2.shape[0]
    layer = LayerConfig(qw.spec, n, k)
    cfg = config or TuningConfig(_gpu_name(x.device)).lookup(layer, m)
    if not cfg.valid_for(layer):
        raise ValueError(f"compute config {cfg} does not fit layer {layer.key}")
    if m == 0:
        return x2.new_empty((*lead, n))
    if getattr(qw, "pair_words", False) and cfg.kernel not in ("mv", "mvs"):  # the opt-in pair word order: mv / mvs read it
        raise ValueError(f"pair-order words are read by the mv / mvs kernels only, not {cfg.kernel}")
    if cfg.kernel == "dequant_mm":  # bf16 W is rebuilt every call (no caching of dequantized weights)
        if cfg.chunks > 1:
            y = dequant_matmul_streamed(x2, qw, _format_args(qw), cfg.chunks, cfg.block_n, cfg.num_warps)
        else:
            y = x2 @ dequantize_tc(qw, _format_args(qw), x.dtype, cfg.block_n, cfg.num_warps).t()
        return y.reshape(*lead, n)
    if cfg.kernel == "tcg":
        from kestrel.kernels import gemm_wna16_tcg as tcg  # Gluon: imported only when such a config is chosen
        if tcg.supports(qw, x2, cfg):
            return tcg.gemm_wna16_tcg(x2, qw, cfg).reshape(*lead, n)
        # CPU (no Gluon interpreter), fp16 activations, act-order: the tc kernel with the same tile
        cfg = ComputeConfig(**{**cfg.to_dict(), "kernel": "tc"})
    if cfg.kernel == "tc":
        return gemm_wna16_tc(x2, qw, cfg, _format_args(qw)).reshape(*lead, n)
    if cfg.kernel == "stream":
        return gemm_stream(x2, qw, cfg, _format_args(qw)).reshape(*lead, n)
    if cfg.kernel in ("gemv", "mv", "mvs"):
        return gemm_small(x2, qw, cfg, _format_args(qw)).reshape(*lead, n)
    split = cfg.split_k
    y = (torch.zeros if split > 1 else torch.empty)((m, n), device=x.device,
                                                       dtype=torch.float32 if split > 1 else x.dtype)
    z = qw.zeros if qw.zeros is not None else qw.scales
    gsc = qw.global_scale if qw.global_scale is not None else qw.scales
    common = dict(BLOCK_N=cfg.block_n, SPLIT_K=split, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
                  **_format_args(qw))
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
    _dot_kernel[grid](x2, qw.qweight, qw.scales, z, gsc, y, m, n, k, x2.stride(0), y.stride(0),
                      BLOCK_M=cfg.block_m, DOT_F32=x.device.type != "cuda", **common)
    if split > 1:
        y = y.to(x.dtype)
    return y.reshape(*lead, n)
