"""Block-scaled FP4: OCP MXFP4 (e2m1, 32-element blocks, e8m0 scales; gpt-oss / compressed-tensors) and NVFP4
(e2m1, 16-element blocks, e4m3 scales, fp32 global scale; compressed-tensors / ModelOpt). Both store two
elements per byte, the even element in the low nibble."""
from __future__ import annotations

import torch

from kestrel.quant.packing import pack_codes
from kestrel.quant.spec import QuantSpec
from kestrel.quant.weight import QuantizedWeight


def _nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    b = packed.detach().cpu().reshape(n, -1).to(torch.int32) & 0xFF
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(n, -1)  # [N, K], even k in the low nibble


def from_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, *, act_dtype: str = "bf16") -> QuantizedWeight:
    """blocks uint8 [N, K/2] (or gpt-oss [N, K/32, 16]); scales uint8 e8m0 [N, K/32]."""
    n = blocks.shape[0]
    codes = _nibbles(blocks, n)
    k = codes.shape[1]
    s = scales.detach().cpu().reshape(n, -1)
    if s.shape[1] * 32 != k:
        raise ValueError(f"MXFP4 needs one scale per 32 elements: K={k}, scales {tuple(scales.shape)}")
    spec = QuantSpec(weight_dtype="fp4_e2m1", act_dtype=act_dtype, group_size=32, scale_dtype="e8m0")
    return QuantizedWeight(spec=spec, shape=(n, k), qweight=pack_codes(codes, 4),
                           scales=s.view(torch.uint8).t().contiguous())


def from_nvfp4(weight_packed: torch.Tensor, weight_scale: torch.Tensor, global_scale: torch.Tensor, *,
               global_scale_is_divisor: bool = True, act_dtype: str = "bf16") -> QuantizedWeight:
    """weight_packed uint8 [N, K/2]; weight_scale float8_e4m3fn [N, K/16]; compressed-tensors stores
    weight_global_scale as a divisor (w = fp4 * scale / gs), ModelOpt's weight_scale_2 is a multiplier."""
    n = weight_packed.shape[0]
    codes = _nibbles(weight_packed, n)
    k = codes.shape[1]
    s = weight_scale.detach().cpu()
    if s.shape != (n, k // 16):
        raise ValueError(f"NVFP4 needs weight_scale [{n}, {k // 16}], got {tuple(s.shape)}")
    if s.dtype == torch.float8_e4m3fn:
        s = s.view(torch.uint8)
    g = global_scale.detach().cpu().float().reshape(())
    g = 1.0 / g if global_scale_is_divisor else g
    spec = QuantSpec(weight_dtype="fp4_e2m1", act_dtype=act_dtype, group_size=16, scale_dtype="fp8_e4m3",
                     global_scale=True)
    return QuantizedWeight(spec=spec, shape=(n, k), qweight=pack_codes(codes, 4), scales=s.t().contiguous(),
                           global_scale=g)
