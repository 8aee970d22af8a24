"""compressed-tensors "pack-quantized" (llm-compressor): weight_packed [N, K*b/32] int32 along K, element i at bit
i*b, values stored offset by 2^(b-1); weight_scale [N, G]; optional weight_zero_point [ceil(N*b/32), G] packed
along N the same way. w = (q - zp) * scale with q, zp signed."""
from __future__ import annotations

import torch

from kestrel.quant.packing import pack_codes, unpack_bitstream
from kestrel.quant.spec import QuantSpec
from kestrel.quant.weight import QuantizedWeight


def from_compressed_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                            weight_zero_point: torch.Tensor | None = None, *, num_bits: int = 4,
                            group_size: int | None = None, act_dtype: str = "bf16") -> QuantizedWeight:
    """group_size None / -1 = channel strategy (weight_scale [N, 1])."""
    if 32 % num_bits:
        raise ValueError(f"pack-quantized supports 2, 4 or 8 bits, got {num_bits}")
    codes = unpack_bitstream(weight_packed.cpu(), num_bits, dim=1)  # [N, K] unsigned (signed + offset)
    n, k = codes.shape
    gs = -1 if group_size in (None, -1) else group_size
    scales = weight_scale.cpu()
    if scales.dim() == 1:
        scales = scales[:, None]
    zeros = None
    if weight_zero_point is not None:
        zp = unpack_bitstream(weight_zero_point.cpu(), num_bits, dim=0)[:n]  # [N, G] unsigned = signed + offset
        if bool((zp != (1 << (num_bits - 1))).any()):
            zeros = zp.t().to(scales.dtype).contiguous()
    scale_dtype = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[scales.dtype]
    spec = QuantSpec(weight_dtype=f"uint{num_bits}" if zeros is not None else f"int{num_bits}", act_dtype=act_dtype,
                     group_size=gs, has_zero_point=zeros is not None, scale_dtype=scale_dtype)
    return QuantizedWeight(spec=spec, shape=(n, k), qweight=pack_codes(codes, spec.container_bits),
                           scales=scales.t().contiguous(), zeros=zeros)
