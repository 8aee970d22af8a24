"""FP8 checkpoints (e4m3fn / e5m2 weight with a per-tensor or per-output-channel fp32 scale): w = w8 * scale."""
from __future__ import annotations

import torch

from kestrel.quant.packing import pack_codes
from kestrel.quant.spec import QuantSpec
from kestrel.quant.weight import QuantizedWeight

_FP8 = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def from_fp8(weight: torch.Tensor, weight_scale: torch.Tensor, *, act_dtype: str = "bf16") -> QuantizedWeight:
    if weight.dtype not in _FP8:
        raise ValueError(f"from_fp8 expects a float8_e4m3fn or float8_e5m2 weight, got {weight.dtype}")
    n, k = weight.shape
    s = weight_scale.detach().cpu().float().reshape(-1)
    if s.numel() == 1:
        s = s.expand(n)
    elif s.numel() != n:
        raise ValueError(f"weight_scale must be per-tensor or per-channel ([{n}]), got {tuple(weight_scale.shape)}")
    codes = weight.detach().cpu().view(torch.uint8).to(torch.int32)
    spec = QuantSpec(weight_dtype=_FP8[weight.dtype], act_dtype=act_dtype, group_size=-1, scale_dtype="fp32")
    return QuantizedWeight(spec=spec, shape=(n, k), qweight=pack_codes(codes, 8), scales=s.reshape(1, n).contiguous())
