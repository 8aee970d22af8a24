"""W8A8 GEMM: FP8 e4m3 or INT8 weights x FP8 / INT8 activations, scales applied in the epilogue.

Layouts: activation q [M, K] with per-token scale [M, 1] (or DeepSeek-style per-group [M, K // 128]); weight q [N, K]
(K contiguous — what wgmma wants for 8-bit operands) with per-channel scale [N] (or 128x128 block scales
[N // 128, K // 128]). out = (A_q * a_scale) @ (W_q * w_scale)^T in bf16 / fp16.
"""
import os

import torch

from kestrel.kernels import act_quant
from kestrel.kernels.lowbit_gemm import (A_BF16, A_FP8, A_INT8, W_FP8, W_INT8, GemmConfig, Operand,
                                         heuristic_config, run_dense)

FP8_BLOCK = 128  # DeepSeek-V3 block-scale granularity
FUSED_MAX_M = 16  # w8a8_linear: fused activation quant up to this many tokens (above: separate quant + TMA GEMM)
# w8a8_linear above FUSED_MAX_M: quant + GEMM as a programmatic-dependent-launch pair (KESTREL_W8A8_PDL=0 turns it
# off). H200 fp8 8192x8192 M = 64: e2e 26.37 -> 25.62 us, same output (bench/results/gemm_w8a8_h200_run6_r2.md, s4)
USE_PDL = os.environ.get("KESTREL_W8A8_PDL", "1") == "1"
# ... up to this many tokens only. Above, the GEMM's early CTAs hold SMs the quant's later waves need: H100 s16 (same
# process, bench/results/gemm_w8a8_h100_s16.md R2 / R3) e2e minus GEMM at M = 256 was 30-57 us as a PDL pair where the
# same quant before cuBLASLt (no PDL) took 8-25; at M = 1024 on 28672x4096 33 vs 10
PDL_MAX_M = int(os.environ.get("KESTREL_W8A8_PDL_MAX_M", "64"))


def quantize_weight_w8a8(w: torch.Tensor, dtype: str = "fp8", block: int = 0):
    """RTN weight quantization -> (q [N, K], scale fp32). block=0: per output channel, scale [N];
    block=128 (fp8 only): one scale per 128x128 tile, scale [N // 128, K // 128]."""
    if dtype not in ("fp8", "int8"):
        raise ValueError(f"quantize_weight_w8a8: dtype must be 'fp8' or 'int8', got {dtype!r}")
    w = w.float()
    if block:
        if dtype != "fp8":
            raise ValueError("block scales are only defined for fp8 weights")
        N, K = w.shape
        if N % block or K % block:
            raise ValueError(f"weight {N}x{K} is not a multiple of the {block}x{block} scale block")
        wb = w.view(N // block, block, K // block, block)
        scale = wb.abs().amax(dim=(1, 3)).clamp_min(1e-10) / 448.0
        q = (wb / scale[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(N, K)
        return q, scale
    if dtype == "fp8":
        q, s = act_quant.ref_quant_fp8(w)
    else:
        q, s = act_quant.ref_quant_int8(w)
    return q, s.view(-1)


def _operands(a_q, a_scale, w_q, w_scale):
    if a_q.dim() != 2 or w_q.dim() != 2 or a_q.shape[1] != w_q.shape[1]:
        raise ValueError(f"gemm_w8a8: expected a [M, K] and w [N, K], got {tuple(a_q.shape)} and {tuple(w_q.shape)}")
    fmts = {torch.float8_e4m3fn: (A_FP8, W_FP8), torch.int8: (A_INT8, W_INT8)}
    if a_q.dtype not in fmts or w_q.dtype != a_q.dtype:
        raise ValueError(f"gemm_w8a8: a and w must both be float8_e4m3fn or both int8, got {a_q.dtype} / {w_q.dtype}")
    af, wf = fmts[a_q.dtype]
    M, K = a_q.shape
    N = w_q.shape[0]
    a_group = 0 if a_scale.numel() == M else K // a_scale.shape[1]
    if w_scale.dim() == 2 and w_scale.shape[0] != N:  # block scales
        w_op = Operand(W_FP8 if wf == W_FP8 else wf, w_q, w_scale.float().contiguous(), group=K // w_scale.shape[1],
                       group_n=N // w_scale.shape[0])
    else:
        w_op = Operand(wf, w_q, w_scale.float().reshape(-1).contiguous())
    a_op = Operand(af, a_q.contiguous(), a_scale.float().reshape(M, -1).contiguous(), group=a_group)
    return a_op, w_op, M, N, K


def gemm_w8a8(a_q, a_scale, w_q, w_scale, out_dtype=torch.bfloat16, config: GemmConfig | None = None,
              pdl: bool = False):
    """(a_q [M, K], a_scale [M, 1 | K/g]) x (w_q [N, K], w_scale [N] | [N/128, K/128]) -> [M, N] out_dtype.
    pdl: launch the TMA kernel as a programmatic dependent of the kernel before it (which produced a_q / a_scale
    and triggered early: act_quant pdl=True); it prefetches weights into the L2 while waiting."""
    a_op, w_op, M, N, K = _operands(a_q, a_scale, w_q, w_scale)
    if not act_quant.use_triton(a_q):
        return ref_gemm_w8a8(a_q, a_scale, w_q, w_scale).to(out_dtype)
    return run_dense(a_op, w_op, M, N, K, out_dtype, config or tuned_config(M, N, K, a_op.fmt), pdl=pdl)


def gemm_w8a16(x: torch.Tensor, w_q, w_scale, out_dtype=torch.bfloat16, config: GemmConfig | None = None):
    """bf16 x [M, K] straight into the fp8 / int8 per-channel weight [N, K] (weight converted in registers, bf16 MMA):
    no activation-quant pass — at decode sizes the GEMM is weight-bandwidth bound, so the 16-bit MMA costs nothing
    and the extra launch of act quant is saved (and the activations are not rounded to 8 bits)."""
    M, K = x.shape
    N = w_q.shape[0]
    if w_scale.numel() != N:
        raise ValueError("gemm_w8a16 takes per-channel weight scales [N]")
    if not act_quant.use_triton(x):
        return (x.float() @ (w_q.float() * w_scale.float().reshape(-1, 1)).t()).to(out_dtype)
    w_op = Operand(W_FP8 if w_q.dtype == torch.float8_e4m3fn else W_INT8, w_q, w_scale.float().reshape(-1).contiguous())
    cfg = config or heuristic_config(M, N, K, A_BF16, w_op.fmt)
    return run_dense(Operand(A_BF16, x.to(torch.bfloat16).contiguous()), w_op, M, N, K, out_dtype, cfg)


def w8a8_linear(x: torch.Tensor, w_q, w_scale, act_group: int = -1, out_dtype=None, pdl: bool | None = None):
    """bf16 x [..., K] -> quantize per token (or per group) -> W8A8 GEMM -> [..., N]. fp8 per-channel weights at
    <= FUSED_MAX_M tokens: one fused launch with per-(token, 128) activation scales instead."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if (x2.shape[0] <= FUSED_MAX_M and act_group in (-1, 128) and w_q.dtype == torch.float8_e4m3fn
            and w_scale.numel() == w_q.shape[0] and K % 128 == 0 and act_quant.use_triton(x2)):
        # decode: the activation quant (per token, 128-wide groups) runs inside the GEMM, one launch
        # (gemm_w8a8_fused.py; H200: e2e 29.4 -> see bench/results/gemm_w8a8_h200_run5.md at M = 1)
        from kestrel.kernels.gemm_w8a8_fused import gemm_w8a8_fused
        return gemm_w8a8_fused(x2, w_q, w_scale, out_dtype or x.dtype).reshape(*lead, -1)
    # quant -> GEMM as a programmatic dependent launch pair (Hopper+): the GEMM's CTAs start while the quant runs
    if pdl is None:
        pdl = USE_PDL and x2.shape[0] <= PDL_MAX_M
    pdl = pdl and x2.is_cuda and torch.cuda.get_device_capability(x2.device)[0] >= 9
    if w_q.dtype == torch.int8:
        a_q, a_s = act_quant.quant_int8(x2, pdl=pdl)
    else:
        a_q, a_s = act_quant.quant_fp8(x2, act_group, pdl=pdl)
    y = gemm_w8a8(a_q, a_s, w_q, w_scale, out_dtype or x.dtype, pdl=pdl)
    return y.reshape(*lead, -1)


def ref_gemm_w8a8(a_q, a_scale, w_q, w_scale) -> torch.Tensor:
    """CPU reference: dequantize both operands to fp32, then matmul."""
    a = act_quant.dequant_8bit(a_q, a_scale.float().reshape(a_q.shape[0], -1))
    N, K = w_q.shape
    if w_scale.dim() == 2 and w_scale.shape[0] != N:
        bn, bk = N // w_scale.shape[0], K // w_scale.shape[1]
        s = w_scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        w = w_q.float() * s
    else:
        w = w_q.float() * w_scale.float().reshape(-1, 1)
    return a @ w.t()


def tuned_config(M: int, N: int, K: int, a_fmt: int) -> GemmConfig:
    from kestrel.kernels.lowbit_tune import lookup
    return lookup("w8a8-" + ("fp8" if a_fmt == A_FP8 else "int8"), M, N, K) or heuristic_config(M, N, K, a_fmt, a_fmt)
