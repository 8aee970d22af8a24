"""GGUF / llama.cpp block formats Q4_0, Q4_1, Q8_0 (32 elements a block, fp16 block scale first).

Q4_0: d, 16 bytes; element j<16 is the low nibble of byte j, element j+16 its high nibble; w = (q - 8) * d.
Q4_1: d, m, 16 bytes (same nibble order); w = q * d + m.     Q8_0: d, 32 int8; w = q * d.
"""
from __future__ import annotations

import numpy as np
import torch

from kestrel.quant.packing import pack_codes
from kestrel.quant.spec import QuantSpec
from kestrel.quant.weight import QuantizedWeight

_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def from_gguf(data, qtype: str, shape: tuple[int, int], *, act_dtype: str = "bf16") -> QuantizedWeight:
    """data: raw block bytes (uint8 array/tensor, any shape) of a [N, K] tensor; qtype "Q4_0" | "Q4_1" | "Q8_0"
    (a gguf.GGMLQuantizationType is accepted too)."""
    qtype = getattr(qtype, "name", qtype)
    if qtype not in _BLOCK_BYTES:
        raise ValueError(f"unsupported GGUF type {qtype!r}; supported: {sorted(_BLOCK_BYTES)}")
    n, k = shape
    if k % 32:
        raise ValueError(f"GGUF block formats need K % 32 == 0, got K={k}")
    raw = np.asarray(data.cpu().numpy() if isinstance(data, torch.Tensor) else data, dtype=np.uint8)
    nb = n * k // 32
    if raw.size != nb * _BLOCK_BYTES[qtype]:
        raise ValueError(f"{qtype} data for shape {shape} must be {nb * _BLOCK_BYTES[qtype]} bytes, got {raw.size}")
    blk = raw.reshape(nb, _BLOCK_BYTES[qtype])
    d = torch.from_numpy(blk[:, 0:2].copy().view(np.float16).reshape(n, k // 32))
    zeros = None
    if qtype == "Q8_0":
        q = torch.from_numpy(blk[:, 2:].copy().view(np.int8).astype(np.int32)) + 128
        spec = QuantSpec(weight_dtype="int8", act_dtype=act_dtype, group_size=32, scale_dtype="fp16")
    else:
        qs = blk[:, 4:] if qtype == "Q4_1" else blk[:, 2:]
        q = torch.from_numpy(np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.int32))
        if qtype == "Q4_0":
            spec = QuantSpec(weight_dtype="int4", act_dtype=act_dtype, group_size=32, scale_dtype="fp16")
        else:
            m = torch.from_numpy(blk[:, 2:4].copy().view(np.float16).reshape(n, k // 32)).float()
            df = d.float()
            # q*d + m == (q - z) * d with z = -m/d; a zero-scale block (all q = 0) becomes d := m, z := -1
            zeros = torch.where(df == 0, torch.full_like(m, -1.0), -m / torch.where(df == 0, 1.0, df))
            d = torch.where(df == 0, m, df).to(torch.float16)
            spec = QuantSpec(weight_dtype="uint4", act_dtype=act_dtype, group_size=32, has_zero_point=True,
                             scale_dtype="fp16")
    codes = q.reshape(n, k)
    return QuantizedWeight(spec=spec, shape=(n, k), qweight=pack_codes(codes, spec.container_bits),
                           scales=d.t().contiguous(), zeros=None if zeros is None else zeros.t().contiguous())
