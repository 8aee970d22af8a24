"""W4A4 GEMM: MXFP4 x MXFP4 and NVFP4 x NVFP4, emulated on Hopper.

Hopper (sm_90) has no FP4 tensor-core instructions (those arrive with Blackwell's block-scaled MMA). We keep both
operands packed in HBM (4 bits + block scales: the bandwidth win is kept) and, per K tile, decode e2m1 codes in
registers, multiply by the block scale and run the bf16 MMA with fp32 accumulation. Choice of bf16 over fp8 MMA:
  * exactness: e2m1 (2 significant bits) x e8m0 (power of two) or x e4m3 (4 bits) needs <= 6 significant bits, so
    bf16 (8) holds every scaled element exactly; the only rounding is the fp32 accumulation, as on real FP4 hardware;
  * fp8 MMA would need the block scale applied to a partial product every 32 (MX) / 16 (NV) K — shorter than one
    efficient fp8 MMA pipeline step — or scaled operands that overflow e4m3's range.
NVFP4's two fp32 global scales (activation and weight) are applied once in the epilogue.
Activation layout as produced by act_quant.quant_mxfp4 / quant_nvfp4; weights as gemm_w4a8.W4Weight.
"""
import torch

from kestrel.kernels import act_quant
from kestrel.kernels.gemm_w4a8 import W4Weight
from kestrel.kernels.lowbit_gemm import A_MXFP4, A_NVFP4, W_FP4, GemmConfig, Operand, heuristic_config, run_dense


def gemm_w4a4(a_packed: torch.Tensor, a_scale: torch.Tensor, w: W4Weight, a_global: torch.Tensor | None = None,
              out_dtype=torch.bfloat16, config: GemmConfig | None = None) -> torch.Tensor:
    """a_packed uint8 [M, K // 2] + block scales (MX: e8m0 bytes [M, K // 32]; NV: e4m3 [M, K // 16] and a_global)."""
    if w.fmt not in ("mxfp4", "nvfp4"):
        raise ValueError(f"gemm_w4a4: weight must be mxfp4 or nvfp4, got {w.fmt!r}")
    N, K = w.shape
    if a_packed.dim() != 2 or a_packed.shape[1] * 2 != K or a_packed.dtype != torch.uint8:
        raise ValueError(f"gemm_w4a4: expected packed uint8 activations [M, {K // 2}], got {tuple(a_packed.shape)}")
    if w.fmt == "nvfp4" and a_global is None:
        raise ValueError("gemm_w4a4: NVFP4 activations need their global scale (a_global)")
    M = a_packed.shape[0]
    if not act_quant.use_triton(a_packed):
        return (ref_dequant_act(a_packed, a_scale, a_global, w.fmt) @ w.dequantize().t()).to(out_dtype)
    fmt = A_MXFP4 if w.fmt == "mxfp4" else A_NVFP4
    a_op = Operand(fmt, a_packed.contiguous(), a_scale.contiguous(),
                   None if a_global is None else a_global.float().reshape(1).contiguous())
    from kestrel.kernels.lowbit_tune import lookup
    cfg = config or lookup("w4a4-" + w.fmt, M, N, K) or heuristic_config(M, N, K, fmt, W_FP4)
    return run_dense(a_op, w.operand(), M, N, K, out_dtype, cfg)


def ref_dequant_act(a_packed, a_scale, a_global, fmt: str) -> torch.Tensor:
    if fmt == "mxfp4":
        return act_quant.dequant_mxfp4(a_packed, a_scale)
    return act_quant.dequant_nvfp4(a_packed, a_scale, a_global)


def w4a4_linear(x: torch.Tensor, w: W4Weight, a_global: torch.Tensor | None = None, out_dtype=None) -> torch.Tensor:
    """bf16 x [..., K] -> MXFP4 / NVFP4 activation quant -> W4A4 GEMM. a_global: calibrated NVFP4 input scale
    (None = dynamic, one extra amax pass)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if w.fmt == "mxfp4":
        q, s = act_quant.quant_mxfp4(x2)
        gs = None
    else:
        q, s, gs = act_quant.quant_nvfp4(x2, a_global)
    return gemm_w4a4(q, s, w, gs, out_dtype or x.dtype).reshape(*lead, -1)
