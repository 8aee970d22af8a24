"""Element formats on the CPU: minifloat decode/encode, MX (e8m0) and NV (e4m3) scale codes.

The Triton kernels decode the same bit patterns in registers (kestrel/kernels/dequant.py); these torch
versions are the independent reference.
"""
from __future__ import annotations

import functools

import torch


def decode_minifloat(codes: torch.Tensor, exp_bits: int, man_bits: int) -> torch.Tensor:
    """Unsigned code tensor (sign in the top bit) -> float32, bias 2^(E-1)-1, no inf/NaN (e4m3fn/OCP style)."""
    c = codes.to(torch.int32)
    bias = (1 << (exp_bits - 1)) - 1
    sign = torch.where((c >> (exp_bits + man_bits)) & 1 == 1, -1.0, 1.0)
    e = (c >> man_bits) & ((1 << exp_bits) - 1)
    m = (c & ((1 << man_bits) - 1)).to(torch.float32) / (1 << man_bits)
    normal = (1.0 + m) * torch.exp2((e - bias).to(torch.float32))
    sub = m * 2.0 ** (1 - bias)
    return sign * torch.where(e == 0, sub, normal)


@functools.lru_cache(maxsize=None)
def _positive_grid(exp_bits: int, man_bits: int, max_code: int) -> torch.Tensor:
    codes = torch.arange(max_code + 1)
    return decode_minifloat(codes, exp_bits, man_bits)  # increasing in code for non-negative codes


def max_code(exp_bits: int, man_bits: int) -> int:
    """Largest finite positive code: e4m3fn reserves 0x7F (NaN), e5m2 reserves the top exponent (inf/NaN)."""
    top = (1 << (exp_bits + man_bits)) - 1
    if (exp_bits, man_bits) == (4, 3):
        return top - 1
    if (exp_bits, man_bits) == (5, 2):
        return top - (1 << man_bits)
    return top


def minifloat_max(exp_bits: int, man_bits: int) -> float:
    return float(_positive_grid(exp_bits, man_bits, max_code(exp_bits, man_bits))[-1])


def encode_minifloat(x: torch.Tensor, exp_bits: int, man_bits: int) -> torch.Tensor:
    """float -> nearest representable code (saturating), as int32 with the sign in the top bit."""
    grid = _positive_grid(exp_bits, man_bits, max_code(exp_bits, man_bits)).to(x.device)
    mid = (grid[1:] + grid[:-1]) / 2
    a = x.abs().to(torch.float32).clamp(max=float(grid[-1]))
    code = torch.bucketize(a, mid)  # index of the nearest grid point
    sign = ((x < 0) & (code > 0)).to(torch.int32) << (exp_bits + man_bits)
    return code.to(torch.int32) | sign


def decode_e8m0(e: torch.Tensor) -> torch.Tensor:
    """MX shared exponent: 2^(e-127); 255 is NaN."""
    e = e.to(torch.int32)
    v = torch.exp2((e - 127).to(torch.float32))
    return torch.where(e == 255, torch.full_like(v, torch.nan), v)


def encode_e8m0_ceil(s: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= s (so scaled values never overflow the element format), as uint8 code."""
    e = torch.ceil(torch.log2(s.clamp(min=2.0 ** -127))).clamp(-127, 127)
    return (e + 127).to(torch.uint8)


def decode_scales(scales: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    if scale_dtype == "e8m0":
        return decode_e8m0(scales)
    if scale_dtype == "fp8_e4m3":
        return decode_minifloat(scales, 4, 3)
    return scales.to(torch.float32)


TORCH_SCALE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
