"""AWQ (AutoAWQ GEMM) checkpoints: qweight [K, N/8] int32 packed along N in the order 0,2,4,6,1,3,5,7;
qzeros [G, N/8] the same way; scales [G, N]; w = (q - z) * s."""
from __future__ import annotations

import torch

from kestrel.quant.packing import pack_codes
from kestrel.quant.spec import QuantSpec
from kestrel.quant.weight import QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a word holds column AWQ_ORDER[j] of its 8


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, 8C] in natural column order."""
    w = words.cpu().to(torch.int32)
    # column c of a word's 8 sits in nibble AWQ_ORDER.index(c); int32 >> then & 0xF is exact (one pass, no int64)
    shifts = torch.tensor([4 * AWQ_ORDER.index(c) for c in range(8)], dtype=torch.int32)
    return ((w.unsqueeze(-1) >> shifts) & 0xF).reshape(w.shape[0], -1)


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, group_size: int,
             bits: int = 4, act_dtype: str = "bf16") -> QuantizedWeight:
    if bits != 4:
        raise ValueError(f"AWQ checkpoints are 4-bit, got bits={bits}")
    codes = unpack_awq(qweight)  # [K, N]
    k, n = codes.shape
    zeros = unpack_awq(qzeros)[:, :n]
    scale_dtype = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[scales.dtype]
    spec = QuantSpec(weight_dtype="uint4", act_dtype=act_dtype, group_size=group_size, has_zero_point=True,
                     scale_dtype=scale_dtype)
    return QuantizedWeight(spec=spec, shape=(n, k), qweight=pack_codes(codes.t(), 4),
                           scales=scales.cpu().contiguous(), zeros=zeros.to(scales.dtype).contiguous())
