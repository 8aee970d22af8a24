"""Bridge from kestrel.quant's QuantizedWeight (planar int32 layout of the WNA16 kernels, any converter's output)
to the layouts of the W8A8 / W4A8 / W4A4 / MoE kernels:
  fp8_e4m3 / int8 per channel -> (q [N, K] float8_e4m3fn | int8, scale fp32 [N])         for gemm_w8a8
  int4 symmetric, fp4_e2m1 (MX: e8m0 g32, NV: e4m3 g16 + global) -> W4Weight            for gemm_w4a8 / gemm_w4a4
So checkpoints loaded through the part-1 converters (FP8, MXFP4, NVFP4, GPTQ/AWQ symmetric int4 without act-order)
run on the low-bit kernels as well. Zero points, act-order and other widths raise ValueError.
"""
import torch

from kestrel.kernels.gemm_w4a8 import W4Weight
from kestrel.kernels.lowbit import pack_nibbles


def from_quantized_weight(qw):
    from kestrel.quant.formats import decode_scales
    from kestrel.quant.packing import unpack_codes
    spec = qw.spec
    N, K = qw.shape
    if qw.perm is not None or qw.zeros is not None:
        raise ValueError(f"{spec.name}: act-order / zero-point weights run on the WNA16 kernel, not the low-bit ones")
    codes = unpack_codes(qw.qweight, spec.container_bits, K)  # int32 [N, K], unsigned codes
    scales = qw.scales  # [G, N]
    if spec.weight_dtype in ("fp8_e4m3", "int8") and spec.group_size in (-1, K):
        s = decode_scales(scales, spec.scale_dtype).float().reshape(N)
        if qw.global_scale is not None:
            s = s * qw.global_scale.float()
        if spec.weight_dtype == "fp8_e4m3":
            q = codes.to(torch.uint8).view(torch.float8_e4m3fn)
        else:
            q = (codes - spec.code_offset).to(torch.int8)
        return q.contiguous(), s.contiguous()
    if spec.weight_dtype == "int4":
        s = decode_scales(scales, spec.scale_dtype).float().t().contiguous()
        if qw.global_scale is not None:
            s = s * qw.global_scale.float()
        vals = codes - spec.code_offset  # -8..7
        return W4Weight("int4", pack_nibbles(vals & 0xF), s, K // scales.shape[0])
    if spec.weight_dtype == "fp4_e2m1":
        g = K // scales.shape[0]
        packed = pack_nibbles(codes)
        if spec.scale_dtype == "e8m0" and g == 32:
            return W4Weight("mxfp4", packed, scales.t().contiguous().to(torch.uint8), 32)
        if spec.scale_dtype == "fp8_e4m3" and g == 16:
            gs = qw.global_scale.float().reshape(1) if qw.global_scale is not None else torch.ones(1)
            return W4Weight("nvfp4", packed, scales.t().contiguous().to(torch.uint8).view(torch.float8_e4m3fn), 16,
                            gs.to(packed.device))
    raise ValueError(f"{spec.name}: no low-bit kernel layout for this weight format (use the WNA16 kernel)")
