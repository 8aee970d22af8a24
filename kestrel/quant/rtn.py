"""Round-to-nearest quantize(): float W[N, K] -> QuantizedWeight in any QuantSpec (for tests and for making weights)."""
from __future__ import annotations

import torch

from kestrel.quant.formats import (TORCH_SCALE_DTYPES, decode_scales, encode_e8m0_ceil, encode_minifloat,
                                   minifloat_max)
from kestrel.quant.packing import pack_codes, padded_k
from kestrel.quant.spec import QuantSpec
from kestrel.quant.weight import QuantizedWeight


def _store_scale(s: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    """Round scales to their storage type (codes for e8m0 / e4m3)."""
    if scale_dtype == "e8m0":
        return encode_e8m0_ceil(s)
    if scale_dtype == "fp8_e4m3":
        return encode_minifloat(s, 4, 3).to(torch.uint8)
    return s.to(TORCH_SCALE_DTYPES[scale_dtype])


def quantize(w: torch.Tensor, spec: QuantSpec) -> QuantizedWeight:
    if w.dim() != 2:
        raise ValueError(f"quantize expects a 2-D weight [N, K], got shape {tuple(w.shape)}")
    if spec.act_order:
        raise ValueError("RTN quantize() does not produce act-order weights; use from_gptq for those")
    n, k0 = w.shape
    # zero-pad K to whole packed blocks and whole groups (a last partial group is quantized over its real part)
    kp = padded_k(k0, spec.container_bits)
    gs = kp if spec.group_size == -1 else spec.group_size
    k = -(-kp // gs) * gs
    wf = w.detach().float()  # runs on w's device (GPU quantizes big weights fast)
    if k != k0:
        wf = torch.nn.functional.pad(wf, (0, k - k0))
    wf = wf.reshape(n, k // gs, gs)
    bits = spec.weight_bits
    zeros = gscale = None
    if spec.is_int and spec.has_zero_point:
        lo, hi = wf.amin(-1).clamp(max=0), wf.amax(-1).clamp(min=0)
        s = ((hi - lo) / (2**bits - 1)).clamp(min=1e-8)
        s_st = _store_scale(s, spec.scale_dtype)
        s = decode_scales(s_st, spec.scale_dtype)
        s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero (padding) group underflows fp16: avoid 0/0 zeros
        z = torch.round(-lo / s).clamp(0, 2**bits - 1)
        codes = (torch.round(wf / s[..., None]) + z[..., None]).clamp(0, 2**bits - 1)
        zeros = z.to(s_st.dtype if s_st.is_floating_point() else torch.float32)
    elif spec.is_int:
        qmax = 2 ** (bits - 1) - 1 if bits > 1 else 1
        s = (wf.abs().amax(-1) / qmax).clamp(min=1e-8)
        s_st = _store_scale(s, spec.scale_dtype)
        s = decode_scales(s_st, spec.scale_dtype)
        off = spec.code_offset
        codes = (torch.round(wf / s[..., None]) + off).clamp(0, 2**bits - 1)
    else:
        e, m = spec.minifloat
        fmax = minifloat_max(e, m)
        amax = wf.abs().amax(-1)
        if spec.global_scale:
            # NVFP4: per-tensor fp32 scale so that block scales fit e4m3 (max 448)
            g = (amax.max() / (fmax * 448.0)).clamp(min=1e-12).float()
            gscale = g.reshape(())
            amax = amax / g
        s = (amax / fmax).clamp(min=1e-12)
        s_st = _store_scale(s, spec.scale_dtype)
        s = decode_scales(s_st, spec.scale_dtype).clamp(min=1e-30) * (gscale if gscale is not None else 1.0)
        codes = encode_minifloat(wf / s[..., None], e, m)
    codes = codes.reshape(n, k)[:, :kp].to(torch.int32)
    return QuantizedWeight(spec=spec, shape=(n, k0), qweight=pack_codes(codes, spec.container_bits),
                           scales=s_st.t().contiguous(), zeros=None if zeros is None else zeros.t().contiguous(),
                           global_scale=None if gscale is None else gscale.float())
