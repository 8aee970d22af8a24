"""In-register helpers shared by the low-bit kernels (activation quant, W8A8/W4A8/W4A4 GEMM, MoE GEMM).

Packing convention for 4-bit tensors (weights and activations alike): uint8 [rows, K // 2], the low nibble holds
the even k, the high nibble the odd k. int4 nibbles are two's complement; fp4 nibbles are OCP e2m1 codes
(sign bit 3, magnitude index 0..7 over {0, .5, 1, 1.5, 2, 3, 4, 6}).

Rounding to fp8 / bf16 is done explicitly (`round_e4m3`, `round_bf16`) before the cast: the cast is then exact, which makes results
bit-identical between the GPU and the Triton interpreter (whose fp32->fp8 cast mishandles mantissa carries).
"""
import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
INT8_MAX = 127.0
FP4_MAX = 6.0
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@triton.jit
def round_e4m3(x):
    """Round fp32 to the nearest e4m3 value (ties to even); |x| must already be <= 448."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000  # keep 3 mantissa bits, RNE
    normal = bits.to(tl.float32, bitcast=True)
    sub = (tl.abs(x) + 16384.0) - 16384.0  # e4m3 subnormal step is 2^-9 = ulp(2^14) in fp32
    sub = tl.where(x < 0, -sub, sub)
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


@triton.jit
def round_bf16(x):
    """Round fp32 to the nearest bf16 value (ties to even), still as fp32: the cast after it is exact. The GPU cast
    rounds the same way; the Triton CPU interpreter truncates, so stores go through this for identical results."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def rint(x):
    """Round to nearest integer, ties to even (|x| < 2^22)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def fp4_encode(x):
    """fp32 (already scaled into [-6, 6]) -> e2m1 code in int32, round to nearest, ties to even code."""
    a = tl.abs(x)
    idx = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return idx | tl.where(x < 0, 8, 0)


@triton.jit
def fp4_to_e4m3(code):
    """e2m1 code -> the same value as float8e4nv, by bit manipulation (every e2m1 value is exact in e4m3)."""
    c = code.to(tl.int32)
    mag = c & 7
    bits = tl.where(mag == 0, 0, tl.where(mag == 1, 0x30, (((mag >> 1) + 6) << 3) | ((mag & 1) << 2)))
    bits = bits | ((c & 8) << 4)
    return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def fp4_decode(code):
    """e2m1 code -> fp32 value (through the exact e4m3 bit pattern)."""
    return fp4_to_e4m3(code).to(tl.float32)


@triton.jit
def int4_value(nibble):
    """two's complement nibble -> int32 in [-8, 7]."""
    n = nibble.to(tl.int32)
    return (n ^ 8) - 8


@triton.jit
def unpack_k(p, ROWS_K: tl.constexpr, COLS: tl.constexpr):
    """packed uint8 tile [ROWS_K // 2, COLS] (K down the rows) -> nibble tile [ROWS_K, COLS] (low nibble first)."""
    lo = p & 0xF
    hi = p >> 4
    w = tl.join(lo, hi)  # [ROWS_K/2, COLS, 2]
    w = tl.permute(w, (0, 2, 1))
    return tl.reshape(w, (ROWS_K, COLS))


@triton.jit
def unpack_k_rows(p, ROWS: tl.constexpr, K: tl.constexpr):
    """packed uint8 tile [ROWS, K // 2] (K along the columns) -> nibble tile [ROWS, K]."""
    lo = p & 0xF
    hi = p >> 4
    return tl.reshape(tl.join(lo, hi), (ROWS, K))


@triton.jit
def e8m0_to_f32(s):
    """e8m0 biased exponent byte -> 2^(s-127) as fp32 (s == 255 is NaN in the spec; callers never produce it)."""
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)


# ---- CPU references (independent of the Triton helpers above; used by tests and CPU fallbacks) ----

def ref_fp4_encode(x: torch.Tensor) -> torch.Tensor:
    """nearest e2m1 code by distance to the value table, ties to the even code; x already in [-6, 6]."""
    vals = torch.tensor(FP4_VALUES, dtype=torch.float32, device=x.device)
    d = (x.abs().float().unsqueeze(-1) - vals).abs()
    # tie-break: prefer even index by adding a tiny penalty to odd indices
    d = d + (torch.arange(8, device=x.device) % 2) * 1e-7
    idx = d.argmin(-1).to(torch.uint8)
    return idx | ((x < 0).to(torch.uint8) << 3)


def ref_fp4_decode(code: torch.Tensor) -> torch.Tensor:
    vals = torch.tensor(FP4_VALUES, dtype=torch.float32, device=code.device)
    v = vals[(code & 7).long()]
    return torch.where((code & 8) != 0, -v, v)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] ints in 0..15 -> uint8 [..., K // 2], low nibble = even k."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K // 2] -> uint8 codes [..., K]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
