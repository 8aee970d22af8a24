"""GPTQ (AutoGPTQ / GPTQModel) checkpoints: qweight [K*b/32, N] bit stream along K, qzeros [G, N*b/32] along N,
scales [G, N], optional g_idx [K] (act-order)."""
from __future__ import annotations

import torch

from kestrel.quant.packing import pack_codes, unpack_bitstream
from kestrel.quant.spec import QuantSpec
from kestrel.quant.weight import QuantizedWeight


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, bits: int, group_size: int,
              g_idx: torch.Tensor | None = None, sym: bool = True, checkpoint_format: str = "gptq",
              act_dtype: str = "bf16") -> QuantizedWeight:
    """checkpoint_format "gptq" (v1) stores zero-1, "gptq_v2" stores the zero itself."""
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"GPTQ bits must be 2, 3, 4 or 8, got {bits}")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"unknown GPTQ checkpoint_format {checkpoint_format!r}")
    codes = unpack_bitstream(qweight.cpu(), bits, dim=0)  # [K, N]
    k, n = codes.shape
    mask = (1 << bits) - 1
    zeros = unpack_bitstream(qzeros.cpu(), bits, dim=1)[:, :n]  # [G, N]
    if checkpoint_format == "gptq":
        zeros = (zeros + 1) & mask
    gs = k if group_size == -1 else group_size
    perm = None
    if g_idx is not None:
        g_idx = g_idx.cpu().to(torch.int64)
        if g_idx.shape != (k,):
            raise ValueError(f"g_idx must have shape [{k}], got {tuple(g_idx.shape)}")
        trivial = torch.arange(k) // gs
        if not torch.equal(g_idx, trivial):
            # act-order: sort input channels by group so each group is contiguous again; the kernel gathers x[:, perm]
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], trivial):
                raise ValueError("g_idx groups must each hold exactly group_size channels")
            codes = codes[perm]
    symmetric = sym and bool((zeros == (1 << (bits - 1))).all())
    scale_dtype = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[scales.dtype]
    spec = QuantSpec(weight_dtype=f"uint{bits}", act_dtype=act_dtype, group_size=group_size,
                     has_zero_point=not symmetric, scale_dtype=scale_dtype, act_order=perm is not None)
    return QuantizedWeight(spec=spec, shape=(n, k), qweight=pack_codes(codes.t(), spec.container_bits),
                           scales=scales.cpu().contiguous(),
                           zeros=None if symmetric else zeros.to(scales.dtype).contiguous(), perm=perm)
