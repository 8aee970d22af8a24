"""Dynamic activation quantization: FP8 e4m3 (per token / per group), INT8 (per token), MXFP4 (e8m0 scale per 32), NVFP4
(e4m3 scale per 16 + fp32 global scale), and SiLU·mul fused with FP8 quantization (the MoE / MLP middle).

Every function has a CPU reference `ref_*` written with plain torch ops (a different algorithm where it can be: table
lookup for fp4, torch casts for fp8) so tests compare the Triton kernels against something independent. Divisions use
IEEE round-to-nearest (tl.math.div_rn; the references divide by tensors, `_div`, since torch's GPU division by a
Python scalar rounds twice), so codes match the references bit for bit on the GPU too. The 8-bit quant multiplies by
the scale's reciprocal (one IEEE division per row, the reference does the same): a division per element made it
compute-bound (~80 instructions per element; H100 s16: 256 x 14336 in 12-18 us where the bytes take ~5). Scales are
fp32 dequant multipliers (x ≈ q * scale); MX scales are raw e8m0 bytes (uint8), NV block scales are
torch.float8_e4m3fn. 4-bit outputs are packed two per byte as described in kestrel/kernels/lowbit.py.
"""
import os

import torch
import triton
import triton.language as tl

from kestrel.kernels.lowbit import (FP4_MAX, FP8_MAX, INT8_MAX, fp4_encode, pack_nibbles, ref_fp4_decode,
                                    ref_fp4_encode, rint, round_bf16, round_e4m3, unpack_nibbles)

_MIN_AMAX = 1e-10  # keeps an all-zero row from dividing by zero


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _check_2d(x: torch.Tensor, multiple: int, what: str) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"{what}: expected a 2-D activation [tokens, K], got shape {tuple(x.shape)}")
    if x.shape[1] % multiple:
        raise ValueError(f"{what}: K={x.shape[1]} must be a multiple of {multiple}")
    if not x.is_floating_point():
        raise ValueError(f"{what}: expected a float tensor, got {x.dtype}")
    return x.contiguous()


# ---------------------------------------------------------------- FP8 / INT8, per token or per group

@triton.jit
def _group_amax(x_ptr, row, stride_x, base, G, K, BLOCK: tl.constexpr):
    """max |x| over columns base .. base + G of a row, in BLOCK-wide trips."""
    amax = tl.zeros((BLOCK,), tl.float32)
    for off in range(0, G, BLOCK):
        cols = base + off + tl.arange(0, BLOCK)
        m = (off + tl.arange(0, BLOCK) < G) & (cols < K)
        amax = tl.maximum(amax, tl.abs(tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)))
    return tl.max(amax, 0)


def k_perm128(K: int, device=None) -> torch.Tensor:
    """The column order of quant_fp8(perm=True): q_perm = q[:, k_perm128(K)]. Within each 128 columns, position
    32 c + 16 h + 4 t + i holds column 16 (2 i + h) + 4 c + t, so that 4 consecutive positions come from one word
    row 4 c + t of the planar int4 weights (gemm_w4a8_tcg PK: one word per fp8 register, no byte gathering)."""
    if K % 128:
        raise ValueError(f"k_perm128: K={K} is not a multiple of 128")
    p = torch.arange(128)
    c, h, t, i = p // 32, p // 16 % 2, p // 4 % 4, p % 4
    within = 16 * (2 * i + h) + 4 * c + t
    return (torch.arange(0, K, 128)[:, None] + within[None, :]).reshape(K).to(device)


@triton.jit
def _perm128(v):
    """v [n] (n a multiple of 128, whole 128s) in k_perm128's order: v[128 b + 32 i + 16 h + 4 c + t] to position
    128 b + 32 c + 16 h + 4 t + i, as a register permute (the stores stay contiguous: scattered byte stores took
    3.5x the quant's time, H100 session 22)."""
    v5 = tl.reshape(v, (v.shape[0] // 128, 4, 2, 4, 4))  # [b, i, h, c, t]
    return tl.reshape(tl.permute(v5, (0, 3, 2, 4, 1)), (v.shape[0], ))  # [b, c, h, t, i]


# fp8 codes through the GPU's own conversion (cvt.rn.satfinite: round to nearest even, as round_e4m3, on values
# already clamped to +-448) instead of round_e4m3's ~10 integer / fp ops per element: the per-token quant of
# 4096 x 28672 took 174 us on the H100 (session 22) where its bytes take ~110, so its ALU work shows. H100 s23 R1
# (bench/results/act_quant_h100_s23r1.json): 131.5 vs 181 us there, 38.3 vs 53.6 at 1024 x 28672. Off until
# bench/act_quant_sweep.py's native_bit_exact (its codes vs the plain kernel's) holds on a GPU: R1 compared both with
# a GPU reference that was itself an ulp off. Never under the CPU interpreter (its cast does not round the same way)
NATIVE_CVT = os.environ.get("KESTREL_QUANT_NATIVE_CVT", "0") == "1"


@triton.jit
def _quant_store(q_ptr, row, stride_q, cols, m, x, scale, qmax, IS_INT8: tl.constexpr, DEQ: tl.constexpr,
                 PERM: tl.constexpr = False, NATIVE: tl.constexpr = False):
    """x / scale (times the reciprocal, as the reference) rounded to int8 / e4m3 codes, or with DEQ back to bf16.
    PERM: e4m3 codes in k_perm128's column order. NATIVE: the e4m3 codes by the hardware conversion (NATIVE_CVT)."""
    if PERM:  # (columns in whole 128s: perm needs K % 128 == 0 and 128-aligned blocks)
        x = _perm128(x)
    y = tl.minimum(tl.maximum(x * tl.math.div_rn(1.0, scale), -qmax), qmax)
    if IS_INT8:
        tl.store(q_ptr + row * stride_q + cols, rint(y).to(tl.int8), mask=m)
    elif DEQ:
        tl.store(q_ptr + row * stride_q + cols, round_bf16(round_e4m3(y) * scale).to(tl.bfloat16), mask=m)
    elif NATIVE:
        tl.store(q_ptr + row * stride_q + cols, y.to(tl.float8e4nv), mask=m)
    else:
        tl.store(q_ptr + row * stride_q + cols, round_e4m3(y).to(tl.float8e4nv), mask=m)


@triton.jit
def _quant_8bit_kernel(x_ptr, q_ptr, s_ptr, K, G, n_groups, stride_x, stride_q,
                       IS_INT8: tl.constexpr, BLOCK: tl.constexpr, ONE_TRIP: tl.constexpr, PDL: tl.constexpr,
                       DEQ: tl.constexpr = False, CB: tl.constexpr = 0, PERM: tl.constexpr = False,
                       NATIVE: tl.constexpr = False):
    """DEQ (fp8 only): store the rounded value times its scale as bf16 (fake_quant_fp8) instead of the code.
    CB > 0 (few rows, _chunks): program (row, group, c) takes the amax of the whole group (BLOCK-wide trips, from the
    L2 after the first of the group's programs) and quantizes only columns c * CB .. + CB of it."""
    if PDL:  # let the GEMM that consumes q (a programmatic dependent launch) start its weight prefetch now
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    g = tl.program_id(1)
    base = g * G
    if IS_INT8:
        qmax = 127.0
    else:
        qmax = 448.0
    if CB > 0:
        scale = tl.math.div_rn(tl.maximum(_group_amax(x_ptr, row, stride_x, base, G, K, BLOCK), 1e-10), qmax)
        c = tl.program_id(2)
        if c == 0:
            tl.store(s_ptr + row * n_groups + g, scale)
        off = c * CB + tl.arange(0, CB)
        cols = base + off
        m = (off < G) & (cols < K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        _quant_store(q_ptr, row, stride_q, cols, m, x, scale, qmax, IS_INT8, DEQ, PERM, NATIVE)
    elif ONE_TRIP:  # the group fits one block: load it once and keep it in registers for both passes
        cols = base + tl.arange(0, BLOCK)
        m = (tl.arange(0, BLOCK) < G) & (cols < K)
        x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 0), 1e-10), qmax)
        tl.store(s_ptr + row * n_groups + g, scale)
        _quant_store(q_ptr, row, stride_q, cols, m, x, scale, qmax, IS_INT8, DEQ, PERM, NATIVE)
    else:  # pass 1: amax over the group (re-read in pass 2 hits L2)
        scale = tl.math.div_rn(tl.maximum(_group_amax(x_ptr, row, stride_x, base, G, K, BLOCK), 1e-10), qmax)
        tl.store(s_ptr + row * n_groups + g, scale)
        for off in range(0, G, BLOCK):
            cols = base + off + tl.arange(0, BLOCK)
            m = (off + tl.arange(0, BLOCK) < G) & (cols < K)
            x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
            _quant_store(q_ptr, row, stride_q, cols, m, x, scale, qmax, IS_INT8, DEQ, PERM, NATIVE)


def _quant_8bit(x: torch.Tensor, group_size: int, is_int8: bool, pdl: bool = False, deq: bool = False,
                perm: bool = False):
    name = "quant_int8" if is_int8 else "fake_quant_fp8" if deq else "quant_fp8"
    x = _check_2d(x, 128 if perm else 1 if group_size in (-1, None) else group_size, name)
    M, K = x.shape
    G = K if group_size in (-1, None) else group_size
    if G <= 0:
        raise ValueError(f"{name}: group_size must be -1 (per token) or positive, got {group_size}")
    n_groups = triton.cdiv(K, G)
    q = torch.empty((M, K), dtype=torch.int8 if is_int8 else torch.bfloat16 if deq else torch.float8_e4m3fn,
                    device=x.device)
    s = torch.empty((M, n_groups), dtype=torch.float32, device=x.device)
    if M == 0:
        return q, s
    # one trip through each pass up to 8192 wide (H200: the 4-trip loops of a 2048 block took 4.8 us per token row
    # of 8192 at M = 1, 1.6 us for the same row as 64 one-trip groups; bench/results/gemm_w8a8_h200_run5.md)
    # ... and up to 32768 (16 warps, 64 values per thread) since session 5: with the 2 x 2-4 trips of an 8192 block
    # the per-token quant of M = 64 rows of K = 14336 / 28672 took 8.7 / 15.4 us of the FP8 e2e (H200 R1: the
    # GEMM alone 26.4 / 62.9 us, e2e 35.1 / 78.2, Humming 26.0 / 68.3; bench/results/gemm_w8a8_h200_s5.md)
    # ... but one program per row is bound by its one SM (~80 instructions per element, mostly the IEEE divide):
    # H100 s16, M = 1: 2.7 / 5.2 / 9.0 us for K = 4096 / 14336 / 28672 (bench/results/gemm_w8a8_h100_s16.md). With
    # few rows each group is now split over CB-wide column chunks (_chunks), each program re-reading the group's amax
    # (H100 s16: with 4096-wide amax trips the chunks took 4.0 / 7.4 us at K = 14336 / 28672, M = 1: the trips'
    # loads wait on each other; now one trip up to 32768). Lead, not measured: the 32768 one-trip block spills (656
    # bytes of stack per thread at 16 warps x 128 registers, 56 in the chunked form; 16384 none: offline sm_90a
    # compile, session 16), where the quant of 256 x 28672 took 25-36 us on the H100 (s16 R2 / R3)
    native = NATIVE_CVT and x.is_cuda and not is_int8
    cb = _chunk_block(M * n_groups, G)
    BLOCK = min(triton.next_power_of_2(G), BLOCK_MAX)
    if cb:
        _quant_8bit_kernel[(M, n_groups, triton.cdiv(G, cb))](
            x, q, s, K, G, n_groups, x.stride(0), q.stride(0), IS_INT8=is_int8, BLOCK=BLOCK, ONE_TRIP=False, PDL=pdl,
            DEQ=deq, CB=cb, PERM=perm, NATIVE=native, num_warps=16 if BLOCK >= 16384 else 8 if BLOCK >= 4096 else 4)
        return q, s
    _quant_8bit_kernel[(M, n_groups)](x, q, s, K, G, n_groups, x.stride(0), q.stride(0), IS_INT8=is_int8,
                                      BLOCK=BLOCK, ONE_TRIP=G <= BLOCK, PDL=pdl, DEQ=deq, PERM=perm, NATIVE=native,
                                      num_warps=16 if BLOCK >= 16384 else 8 if BLOCK >= 4096 else
                                      4 if BLOCK >= 1024 else 2)
    return q, s


# widest trip. H100 2026-12-07 (bench/act_quant_sweep.py, bench/results/gemm_w8a8_h100_s19.md): 16384 vs 32768 us at
# K = 28672: M = 16 4.52 / 5.87, 64 5.65 / 7.31, 256 10.97 / 11.66, 1024 53.4 / 50.2; at K = 14336 level (+-3 %)
BLOCK_MAX = int(os.environ.get("KESTREL_QUANT_BLOCK_MAX", "16384"))
CHUNK_PROGRAMS = 264  # _chunk_block: split groups into column chunks while the grid has fewer programs than this
MIN_CHUNK = 1024


def _chunk_block(n_rows: int, G: int) -> int:
    """The column chunk (a power of two) each program of a group quantizes, or 0 for one program per group: groups
    wider than 2 MIN_CHUNK, while n_rows (token rows x groups) leave the grid short of CHUNK_PROGRAMS programs."""
    want = min(CHUNK_PROGRAMS // max(n_rows, 1), G // MIN_CHUNK)
    return triton.next_power_of_2(triton.cdiv(G, want)) if want >= 2 else 0


def quant_fp8(x: torch.Tensor, group_size: int = -1, pdl: bool = False, perm: bool = False):
    """x [M, K] -> (q float8_e4m3fn [M, K], scale fp32 [M, K // group]); group_size -1 = one scale per token.
    pdl: the next kernel is a programmatic dependent launch (gemm_w8a8 pdl=True) that may start right away.
    perm (per token, K a multiple of 128): q's columns in k_perm128's order (what gemm_w4a8_tcg a_perm reads)."""
    if perm and group_size not in (-1, None):
        raise ValueError("quant_fp8: perm=True takes per-token scales (group_size -1)")
    if not use_triton(x):
        q, s = ref_quant_fp8(x, group_size)
        return (q[:, k_perm128(q.shape[1], q.device)] if perm else q), s
    return _quant_8bit(x, group_size, is_int8=False, pdl=pdl, perm=perm)


def fake_quant_fp8(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> bf16 [M, K]: x on its per-token e4m3 grid, q * scale rounded once to bf16 (one launch, the cost of
    quant_fp8). What W4A8 at small M feeds the bf16-MMA WNA16 kernels (gemm_w4a8.w4a8_linear)."""
    if not use_triton(x):
        return ref_fake_quant_fp8(x)
    return _quant_8bit(x, -1, is_int8=False, deq=True)[0]


def ref_fake_quant_fp8(x: torch.Tensor) -> torch.Tensor:
    q, s = ref_quant_fp8(x)
    return dequant_8bit(q, s).to(torch.bfloat16)


def quant_int8(x: torch.Tensor, pdl: bool = False):
    """x [M, K] -> (q int8 [M, K], scale fp32 [M, 1]); symmetric, per token. pdl: as quant_fp8."""
    if not use_triton(x):
        return ref_quant_int8(x)
    return _quant_8bit(x, -1, is_int8=True, pdl=pdl)


def _div(t: torch.Tensor, c: float) -> torch.Tensor:
    """t / c rounded once, as the kernels' div_rn: for a Python scalar c torch on a GPU multiplies by 1 / c instead
    (two roundings: 1-ulp scales, and 0.02 % of the codes off, H100 session 23), so divide by a tensor of c."""
    return t / torch.full_like(t, c)


def ref_quant_fp8(x: torch.Tensor, group_size: int = -1):
    x = _check_2d(x, 1 if group_size in (-1, None) else group_size, "quant_fp8")
    M, K = x.shape
    G = K if group_size in (-1, None) else group_size
    xg = x.float().view(M, K // G, G)
    scale = _div(xg.abs().amax(-1).clamp_min(_MIN_AMAX), FP8_MAX)
    q = (xg * (1.0 / scale)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # as the kernel
    return q.view(M, K), scale


def ref_quant_int8(x: torch.Tensor):
    x = _check_2d(x, 1, "quant_int8")
    scale = _div(x.float().abs().amax(-1, keepdim=True).clamp_min(_MIN_AMAX), INT8_MAX)
    q = torch.round(x.float() * (1.0 / scale)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)  # as the kernel
    return q, scale


def dequant_8bit(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [M, K] with scale [M, G] -> fp32 [M, K] (G groups of K // G)."""
    M, K = q.shape
    G = scale.shape[1]
    return (q.float().view(M, G, K // G) * scale.float()[..., None]).view(M, K)


# ---------------------------------------------------------------- MXFP4 (OCP MX: e2m1 elements, e8m0 scale per 32)

@triton.jit
def _store_fp4_block(q_row, s_row, y, scale, K, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """one program's BLOCK columns: y [BLOCK // GROUP, GROUP] (already scaled and clamped to e2m1's range) as packed
    e2m1 nibbles (low nibble = even column) and its per-GROUP scales, both masked to the row's K columns."""
    codes = tl.reshape(fp4_encode(y), (BLOCK // 2, 2))
    lo, hi = tl.split(codes)
    pcols = tl.program_id(1) * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
    tl.store(q_row + pcols, (lo | (hi << 4)).to(tl.uint8), mask=pcols < K // 2)
    scols = tl.program_id(1) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
    tl.store(s_row + scols, scale, mask=scols < K // GROUP)


@triton.jit
def _quant_mxfp4_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    xb = tl.reshape(x, (BLOCK // 32, 32))
    amax = tl.max(tl.abs(xb), 1)
    # shared exponent = floor(log2(amax)) - emax(e2m1)=2, read straight from the fp32 exponent field
    e = ((amax.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 2
    e = tl.minimum(tl.maximum(e, 1), 253)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 2^(127 - e): exact power of two
    y = tl.minimum(tl.maximum(xb * inv[:, None], -6.0), 6.0)
    _store_fp4_block(q_ptr + row * stride_q, s_ptr + row * stride_s, y, e.to(tl.uint8), K, BLOCK, 32)


def quant_mxfp4(x: torch.Tensor):
    """x [M, K] -> (packed e2m1 uint8 [M, K // 2], e8m0 scale bytes uint8 [M, K // 32])."""
    if not use_triton(x):
        return ref_quant_mxfp4(x)
    x = _check_2d(x, 32, "quant_mxfp4")
    M, K = x.shape
    q = torch.empty((M, K // 2), dtype=torch.uint8, device=x.device)
    s = torch.empty((M, K // 32), dtype=torch.uint8, device=x.device)
    if M:
        BLOCK = min(triton.next_power_of_2(K), 512)
        _quant_mxfp4_kernel[(M, triton.cdiv(K, BLOCK))](x, q, s, K, x.stride(0), q.stride(0), s.stride(0), BLOCK=BLOCK)
    return q, s


def ref_quant_mxfp4(x: torch.Tensor):
    x = _check_2d(x, 32, "quant_mxfp4")
    M, K = x.shape
    xb = x.float().view(M, K // 32, 32)
    amax = xb.abs().amax(-1)
    _, exp = torch.frexp(amax)  # amax = mant * 2^exp, mant in [0.5, 1) -> floor(log2 amax) = exp - 1
    e = torch.where(amax > 0, exp - 1 + 127 - 2, torch.zeros_like(exp)).clamp(1, 253)
    scale = torch.pow(2.0, (e - 127).float())
    codes = ref_fp4_encode((xb / scale[..., None]).clamp(-FP4_MAX, FP4_MAX))
    return pack_nibbles(codes.view(M, K)), e.to(torch.uint8)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    M = packed.shape[0]
    v = ref_fp4_decode(unpack_nibbles(packed)).view(M, -1, 32)
    return (v * torch.pow(2.0, scale.float() - 127)[..., None]).view(M, -1)


# ---------------------------------------------------------------- NVFP4 (e2m1 elements, e4m3 scale per 16, fp32 global)

@triton.jit
def _quant_nvfp4_kernel(x_ptr, q_ptr, s_ptr, gs_ptr, K, stride_x, stride_q, stride_s, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    gs = tl.load(gs_ptr)
    xb = tl.reshape(x, (BLOCK // 16, 16))
    amax = tl.max(tl.abs(xb), 1)
    sb = round_e4m3(tl.minimum(tl.math.div_rn(tl.math.div_rn(amax, 6.0), gs), 448.0))  # block scale -> e4m3
    denom = sb * gs
    y = tl.where(denom[:, None] > 0, tl.math.div_rn(xb, tl.where(denom > 0, denom, 1.0)[:, None]), 0.0)
    y = tl.minimum(tl.maximum(y, -6.0), 6.0)
    _store_fp4_block(q_ptr + row * stride_q, s_ptr + row * stride_s, y, sb.to(tl.float8e4nv), K, BLOCK, 16)


def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """per-tensor dequant scale so that the largest block scale lands at e4m3's max: amax / (6 * 448)."""
    return (x.float().abs().amax().clamp_min(_MIN_AMAX) / (FP4_MAX * FP8_MAX)).reshape(1)


def quant_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None = None):
    """x [M, K] -> (packed e2m1 uint8 [M, K // 2], float8_e4m3fn block scales [M, K // 16], fp32 global scale [1]).

    global_scale None = dynamic (one extra amax reduction); pass a calibrated one (checkpoint input_scale) to skip it.
    """
    if not use_triton(x):
        return ref_quant_nvfp4(x, global_scale)
    x = _check_2d(x, 16, "quant_nvfp4")
    M, K = x.shape
    gs = nvfp4_global_scale(x) if global_scale is None else global_scale.float().reshape(1).to(x.device)
    q = torch.empty((M, K // 2), dtype=torch.uint8, device=x.device)
    s = torch.empty((M, K // 16), dtype=torch.float8_e4m3fn, device=x.device)
    if M:
        BLOCK = min(triton.next_power_of_2(K), 512)
        _quant_nvfp4_kernel[(M, triton.cdiv(K, BLOCK))](x, q, s, gs, K, x.stride(0), q.stride(0), s.stride(0),
                                                          BLOCK=BLOCK)
    return q, s, gs


def ref_quant_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None = None):
    x = _check_2d(x, 16, "quant_nvfp4")
    M, K = x.shape
    gs = nvfp4_global_scale(x) if global_scale is None else global_scale.float().reshape(1).to(x.device)
    xb = x.float().view(M, K // 16, 16)
    sb = ((xb.abs().amax(-1) / FP4_MAX) / gs).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    denom = sb.float() * gs
    y = torch.where(denom[..., None] > 0, xb / denom[..., None], torch.zeros_like(xb)).clamp(-FP4_MAX, FP4_MAX)
    return pack_nibbles(ref_fp4_encode(y).view(M, K)), sb, gs


def dequant_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    M = packed.shape[0]
    v = ref_fp4_decode(unpack_nibbles(packed)).view(M, -1, 16)
    return (v * scale.float()[..., None] * global_scale.float()).view(M, -1)


# ---------------------------------------------------------------- SiLU(gate) * up, optionally fused with FP8 quant

@triton.jit
def _silu_mul_kernel(x_ptr, o_ptr, s_ptr, I, stride_x, stride_o, QUANT: tl.constexpr, OUT_BF16: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0)
    amax = tl.zeros((BLOCK,), tl.float32)
    if QUANT:
        for off in range(0, I, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            m = cols < I
            g = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + row * stride_x + I + cols, mask=m, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(g / (1.0 + tl.exp(-g)) * u))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), 1e-10), 448.0)
        tl.store(s_ptr + row, scale)
    for off in range(0, I, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        m = cols < I
        g = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + I + cols, mask=m, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        if QUANT:
            y = tl.minimum(tl.maximum(tl.math.div_rn(y, scale), -448.0), 448.0)
            tl.store(o_ptr + row * stride_o + cols, round_e4m3(y).to(tl.float8e4nv), mask=m)
        elif OUT_BF16:
            tl.store(o_ptr + row * stride_o + cols, round_bf16(y).to(tl.bfloat16), mask=m)
        else:
            tl.store(o_ptr + row * stride_o + cols, y.to(o_ptr.dtype.element_ty), mask=m)


def _silu_mul(x: torch.Tensor, quant: bool):
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_mul: expected [tokens, 2 * I] (gate | up), got {tuple(x.shape)}")
    x = x.contiguous()
    M, I = x.shape[0], x.shape[1] // 2
    o = torch.empty((M, I), dtype=torch.float8_e4m3fn if quant else x.dtype, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        BLOCK = min(triton.next_power_of_2(I), 2048)
        _silu_mul_kernel[(M,)](x, o, s, I, x.stride(0), o.stride(0), QUANT=quant,
                               OUT_BF16=o.dtype == torch.bfloat16, BLOCK=BLOCK, num_warps=4)
    return (o, s) if quant else o


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I] in x's dtype."""
    if not use_triton(x):
        return ref_silu_mul(x).to(x.dtype)
    return _silu_mul(x, quant=False)


def silu_mul_fp8(x: torch.Tensor):
    """[T, 2I] -> (fp8 [T, I], per-token scale [T, 1]): the activation and its quantization in one pass over HBM."""
    if not use_triton(x):
        return ref_quant_fp8(ref_silu_mul(x))
    return _silu_mul(x, quant=True)


def ref_silu_mul(x: torch.Tensor) -> torch.Tensor:
    g, u = x.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u
