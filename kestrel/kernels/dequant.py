"""In-register decode of the internal packed layout (kestrel/quant/packing.py) for the WNA16 kernels.

Tiles are unpacked as [BLOCK_N, BLOCK_K // EPW, EPW]: one int32 word per (n, k // EPW), one shift per code.
Every decoded value (integer code minus zero, or minifloat) is exact in bf16/fp16, so kernels may apply the
group scale after the dot product when a K tile lies inside one group.
"""
import triton
import triton.language as tl


@triton.jit
def unpack_tile(q, BITS: tl.constexpr, EPW: tl.constexpr):
    """int32 words [BN, BKW] -> unsigned codes [BN, BKW, EPW] (int32)."""
    shifts = tl.arange(0, EPW) * BITS
    return (q[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)


@triton.jit
def int_to_f32(c):
    """Small non-negative int32 -> fp32 without I2F: 2^23 + c, bit-built, minus 2^23 (exact for c < 2^23)."""
    return (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def minifloat_to_f32(c, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr):
    """Code with the sign in bit EXP_BITS + MAN_BITS -> fp32 (bias 2^(E-1)-1, subnormals, no inf/NaN)."""
    BIAS: tl.constexpr = (1 << (EXP_BITS - 1)) - 1
    mag = c & ((1 << (EXP_BITS + MAN_BITS)) - 1)
    sign = (c >> (EXP_BITS + MAN_BITS)) << 31
    e = mag >> MAN_BITS
    normal = ((mag << (23 - MAN_BITS)) + ((127 - BIAS) << 23)) | sign
    sub = int_to_f32(mag) * (2.0 ** (1 - BIAS - MAN_BITS))
    sub = tl.where(sign != 0, -sub, sub)
    return tl.where(e == 0, sub, normal.to(tl.float32, bitcast=True))


@triton.jit
def decode_scale(s, SCALE_KIND: tl.constexpr):
    """SCALE_KIND 0: float tensor; 1: e8m0 code (2^(e-127)); 2: fp8 e4m3 code."""
    if SCALE_KIND == 1:
        return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    elif SCALE_KIND == 2:
        return minifloat_to_f32(s.to(tl.int32), 4, 3)
    else:
        return s.to(tl.float32)


@triton.jit
def decode_codes(c, zero, IS_INT: tl.constexpr, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr):
    """codes -> unscaled fp32 values: integer code - zero, or the minifloat value."""
    if IS_INT:
        return int_to_f32(c) - zero
    else:
        return minifloat_to_f32(c, EXP_BITS, MAN_BITS)
