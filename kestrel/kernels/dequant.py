"""In-register decode of the internal planar packed layout (kestrel/quant/packing.py) for the WNA16 kernels.

Two flavours:
- plane decoders (GEMV): take a whole word tile and return the values of bit field i as fp32 with 2-3 integer
  ops per element, by moving the field straight into fp32 bits (no int->float conversion instruction):
  integers become 1 + c / 2^BITS (the kernel corrects with the x sum), minifloats become their own value
  times 2^(BIAS-127) (fp32 keeps subnormals; the kernel multiplies back by a power of two).
- element decoders (tensor-core path, dequant kernel): exact unscaled values per element.
"""
import triton
import triton.language as tl


@triton.jit
def shift_bits(q, SH: tl.constexpr):
    """q << SH for SH >= 0, q >> -SH otherwise (callers mask away sign-extended bits)."""
    if SH >= 0:
        return q << SH
    else:
        return q >> (-SH)


@triton.jit
def int_plane(q, FIELD: tl.constexpr, BITS: tl.constexpr):
    """Field FIELD (BITS wide) of every word -> fp32 1 + c / 2^BITS, exactly (mantissa insertion)."""
    mant = shift_bits(q, (23 - BITS) - FIELD * BITS) & (((1 << BITS) - 1) << (23 - BITS))
    return (mant | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def fp_plane(q, FIELD: tl.constexpr, BITS: tl.constexpr, EXP_BITS: tl.constexpr, MAN_BITS: tl.constexpr):
    """Field FIELD of every word, a minifloat (sign at bit EXP_BITS+MAN_BITS) -> its fp32 value."""
    BIAS: tl.constexpr = (1 << (EXP_BITS - 1)) - 1
    lo: tl.constexpr = FIELD * BITS
    mag = shift_bits(q, (23 - MAN_BITS) - lo) & (((1 << (EXP_BITS + MAN_BITS)) - 1) << (23 - MAN_BITS))
    sign = shift_bits(q, 31 - (lo + EXP_BITS + MAN_BITS)) & (-2147483648)
    # same exponent/mantissa bits read as fp32 = value * 2^(BIAS-127), subnormals included
    return (mag | sign).to(tl.float32, bitcast=True) * (2.0 ** (127 - BIAS))


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
