"""Grouped MoE GEMM: all experts in one launch over expert-sorted token blocks (see moe_align), any weight format.

Weight formats (stacked over experts [E, N, K]): bf16; fp8 / int8 per channel (W8A8, with fp8 / int8 activations);
int4 symmetric with group scales (WNA16 with bf16 activations, W4A8 with fp8 activations); mxfp4 / nvfp4 (W4A16,
W4A8, or W4A4 with mxfp4 / nvfp4 activations). The math is lowbit_gemm's kernel with IS_MOE: each program reads its
block's expert id and token rows, and the down projection multiplies by the routing weight in the epilogue.
"""
from dataclasses import dataclass

import torch

from kestrel.kernels import act_quant
from kestrel.kernels.gemm_w4a8 import W4Weight, quantize_weight_w4
from kestrel.kernels.lowbit_gemm import (A_BF16, A_FP8, A_INT8, A_MXFP4, A_NVFP4, W_BF16, W_FP8, W_INT8, GemmConfig,
                                         Operand, launch)

WEIGHT_FORMATS = ("bf16", "fp8", "int8", "int4", "mxfp4", "nvfp4")
ACT_FORMATS = ("bf16", "fp8", "int8", "mxfp4", "nvfp4")


@dataclass
class ExpertWeights:
    """[E, N, K] expert weights in one of WEIGHT_FORMATS (w4 holds the 4-bit layouts)."""
    fmt: str
    data: torch.Tensor | None = None  # bf16 / fp8 / int8 [E, N, K]
    scale: torch.Tensor | None = None  # fp32 [E, N] for fp8 / int8
    w4: W4Weight | None = None

    @property
    def shape(self):
        if self.w4 is not None:
            return (self.w4.packed.shape[0],) + tuple(self.w4.shape)
        return tuple(self.data.shape)

    def operand(self) -> Operand:
        if self.w4 is not None:
            return self.w4.operand()
        if self.fmt == "bf16":
            return Operand(W_BF16, self.data)
        return Operand(W_FP8 if self.fmt == "fp8" else W_INT8, self.data, self.scale)

    def dequantize(self) -> torch.Tensor:
        """CPU reference, fp32 [E, N, K]."""
        if self.w4 is not None:
            return self.w4.dequantize()
        if self.fmt == "bf16":
            return self.data.float()
        return self.data.float() * self.scale.float()[..., None]

    def to(self, device):
        return ExpertWeights(self.fmt, None if self.data is None else self.data.to(device),
                             None if self.scale is None else self.scale.to(device),
                             None if self.w4 is None else self.w4.to(device))


def quantize_experts(w: torch.Tensor, fmt: str, group: int = 128, kernel_layout: bool = True) -> ExpertWeights:
    """RTN-quantize stacked expert weights [E, N, K] into `fmt`. kernel_layout: int4 in the "halves" packing where it
    applies (W4Weight.kernel_layout: no nibble interleave in the kernel)."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"MoE weight format must be one of {WEIGHT_FORMATS}, got {fmt!r}")
    if w.dim() != 3:
        raise ValueError(f"expert weights must be [E, N, K], got {tuple(w.shape)}")
    if fmt == "bf16":
        return ExpertWeights("bf16", w.to(torch.bfloat16).contiguous())
    if fmt in ("fp8", "int8"):
        quant = act_quant.ref_quant_fp8 if fmt == "fp8" else act_quant.ref_quant_int8
        parts = [quant(we.float()) for we in w]  # one expert at a time: bounded fp32 temporaries
        return ExpertWeights(fmt, torch.stack([q for q, _ in parts]), torch.stack([s.view(-1) for _, s in parts]))
    w4 = quantize_weight_w4(w, fmt, group)
    return ExpertWeights(fmt, w4=w4.kernel_layout() if kernel_layout else w4)


def check_pair(act: str, w: ExpertWeights):
    ok = {
        "bf16": ("bf16", "int4", "mxfp4", "nvfp4"),
        "fp8": ("fp8", "int4", "mxfp4", "nvfp4"),
        "int8": ("int8", "int4"),
        "mxfp4": ("mxfp4",),
        "nvfp4": ("nvfp4",),
    }
    if act not in ok:
        raise ValueError(f"MoE activation format must be one of {ACT_FORMATS}, got {act!r}")
    if w.fmt not in ok[act]:
        raise ValueError(f"activation {act!r} cannot be paired with {w.fmt!r} weights (allowed: {ok[act]})")


def quant_act(x: torch.Tensor, act: str) -> Operand:
    """quantize activations [T, K] for the grouped GEMM."""
    if act == "bf16":
        return Operand(A_BF16, x.contiguous())
    if act == "fp8":
        q, s = act_quant.quant_fp8(x)
        return Operand(A_FP8, q, s)
    if act == "int8":
        q, s = act_quant.quant_int8(x)
        return Operand(A_INT8, q, s)
    if act == "mxfp4":
        q, s = act_quant.quant_mxfp4(x)
        return Operand(A_MXFP4, q, s)
    q, s, gs = act_quant.quant_nvfp4(x)
    return Operand(A_NVFP4, q, s, gs)


def moe_config(num_slots: int, num_experts: int, act: str) -> GemmConfig:
    """block_m follows the average rows per expert (decode: 16, so padding waste stays small). Not yet in the tune
    cache: up and down projections must share block_m (one sort/align serves both)."""
    per_expert = num_slots / max(num_experts, 1)
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64 if per_expert <= 96 else 128
    dq16 = act in ("bf16", "mxfp4", "nvfp4")
    bk = 64 if dq16 else 128
    warps = 8 if bm >= 128 else 4
    return GemmConfig(BM=bm, BN=128 if bm >= 64 else 64, BK=bk, num_warps=warps, num_stages=3 if bm >= 128 else 4)


def grouped_gemm(a: Operand, w: ExpertWeights, align, num_slots: int, a_div: int, out: torch.Tensor,
                 cfg: GemmConfig, topk_weights: torch.Tensor | None = None) -> torch.Tensor:
    """out[slot] = A[slot // a_div] @ W[expert(slot)]^T (x routing weight) for every valid slot, one launch."""
    sorted_ids, expert_ids, num_post = align
    E, N, K = w.shape
    moe = dict(sorted_ids=sorted_ids, expert_ids=expert_ids, num_post=num_post, num_valid=num_slots, a_div=a_div,
               topk_weights=topk_weights)
    if cfg.SPLIT_K > 1:  # the K splits add their partials atomically into a zeroed fp32 buffer
        acc = out.zero_() if out.dtype == torch.float32 else torch.zeros(out.shape, dtype=torch.float32,
                                                                          device=out.device)
        launch(a, w.operand(), acc, num_slots, N, K, cfg, moe=moe)
        if acc is not out:
            out.copy_(acc)
        return out
    return launch(a, w.operand(), out, num_slots, N, K, cfg, moe=moe)
