"""One Triton GEMM body for every activation x weight format pair, dense or grouped-by-expert (MoE).

Formats are constexpr, so each (A format, W format, scale layout) pair is its own JIT specialisation and the
branches below compile away. The public entry points are thin: gemm_w8a8.py, gemm_w4a8.py, gemm_w4a4.py, moe_gemm.py.

Where the scales go (why): a scale that is constant over the whole K reduction (per-token activation scale,
per-channel weight scale, NVFP4 global scales, the MoE routing weight) is applied once, in the epilogue. A scale that
changes along K (weight groups, DeepSeek-style activation groups, MX/NV block scales) must be applied inside the loop:
  * 8-bit activations: scale the partial product of each K tile (needs BLOCK_K <= group), so the MMA stays fp8/int8;
  * 16-bit or fp4 activations: dequantize the operand tile in registers, then a bf16 MMA.
Hopper has no fp4 tensor cores: MXFP4/NVFP4 x MXFP4/NVFP4 is converted in registers to bf16 — exact, because an e2m1
value (2 significant bits) times an e8m0 / e4m3 scale (1 / 4 significant bits) fits bf16's 8-bit significand — and run
on the bf16 MMA. FP8 MMA would be 2x the peak rate but the 32/16-wide scale blocks would force a scaled partial every
16-32 K (an fp8 wgmma step is 32 deep), and scale x value products overflow e4m3's range; bf16 keeps one MMA per tile.
"""
import os
from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from kestrel.kernels.lowbit import round_bf16, e8m0_to_f32, fp4_decode, fp4_to_e4m3, int4_value, unpack_k, unpack_k_rows

# activation formats
A_BF16, A_FP8, A_INT8, A_MXFP4, A_NVFP4 = 0, 1, 2, 3, 4
# weight formats
W_BF16, W_FP8, W_INT8, W_INT4, W_FP4 = 0, 1, 2, 3, 4
# weight scale storage
S_FLOAT, S_E8M0, S_E4M3 = 0, 1, 2
# MXFP4 scale fold (fp8 activations, per-token scales): `scale` holds base - e8m0 (0..FOLD_SPAN) per 32, the channel
# scales 2^(base - 127) ride in `global_scale`; the kernel makes exact e4m3 weights and chains one accumulator
S_FOLD = 3


@triton.jit
def _w_scale(ws_ptr, offs_n, kk, WGN: tl.constexpr, stride_wsn, W_SCALE: tl.constexpr, WG: tl.constexpr):
    """weight scales for K indices kk (any shape broadcastable against offs_n) -> fp32."""
    s = tl.load(ws_ptr + (offs_n // WGN) * stride_wsn + kk // WG)
    if W_SCALE == 1:
        s = e8m0_to_f32(s)
    return s.to(tl.float32)


@triton.jit
def fp4_fold_e4m3(code, down):
    """e2m1 code x 2^-down (down 0..8) -> float8e4nv, exact (see lowbit_tma.mxfp4_fold_to_fp8). The e2m1 bits placed
    in an fp16 (sign at 15, magnitude at 9..11) are the value x 2^-14 exactly (0.5 lands on the fp16 subnormal
    2^-15); times the fp16 power of two 2^(14 - down) (its bits (29 - down) << 10) it is the folded value, exact in
    fp16 and in e4m3. Integer-field and fp32 / exp2 forms took 1.3-1.9x the K-loop SASS (offline sm_90a compile)."""
    c = code.to(tl.int32)
    v = (((c & 8) << 12) | ((c & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
    f = ((29 - down.to(tl.int32)) << 10).to(tl.int16).to(tl.float16, bitcast=True)
    return (v * f).to(tl.float8e4nv)


@triton.jit
def int4_to_e4m3(nibble):
    """two's complement int4 nibble -> the same value as float8e4nv. Through fp16, whose 0x6400 | m is exactly
    1024 + m: integer ops and one subtract, no int->float convert (I2F is quarter rate; it bounded W4A8)."""
    h = ((nibble.to(tl.int16) ^ 8) | 0x6400).to(tl.float16, bitcast=True)
    return (h - 1032.0).to(tl.float16).to(tl.float8e4nv)


# int4 -> e4m3 for a whole 32-bit register (4 packed bytes, "halves" packing) in 15 integer / f16x2 instructions
# instead of ~6 scalar ops per nibble: a LOP3 puts two nibbles (xor 8) into the mantissas of an f16x2 whose exponent is
# 2^10, one f16x2 sub / fma removes the bias (the high nibble sits 4 bits up: x 1/16 in the same fma), one cvt packs
# two e4m3, one PRMT restores the byte order (0x3120: cvt puts the upper f16's byte in the upper byte, PTX ISA; the
# other order once kept as a variant is wrong, tests/test_gemm_w4a.py emulates both). Exact (the integers -8..7 are
# f16 and e4m3 values). GPU only: the interpreter has no PTX, it runs int4_to_e4m3 (same values).
# 1 = the asm decode: on the H200 (bench/results/gemm_w8a8_h200_run3.md, bench/w4a8_decode_sweep.py) as exact as
# the Triton-ops decode (0; rel. err 1.66e-3 both, vs float64) and faster: 8192x8192 W4A8 GEMM 33.1 -> 24.0 us at
# M = 1, 33.8 -> 26.1 at 16, 286 -> 205 at 1024
DECODE_ASM = 1


def _int4x4_asm(sel: str) -> str:
    return ("{\n.reg .b32 s, t02, t13, u02, u13, k0, k1, k2, p, q;\n.reg .b16 c0, c1, c2, c3;\n"
            "mov.b32 k0, 0x64086408;\nmov.b32 k1, 0x2C002C00;\nmov.b32 k2, 0xD480D480;\n"
            "shr.b32 s, $2, 8;\n"
            "lop3.b32 t02, $2, 0x000F000F, 0x64086408, 0x6a;\nlop3.b32 t13, s, 0x000F000F, 0x64086408, 0x6a;\n"
            "lop3.b32 u02, $2, 0x00F000F0, 0x64806480, 0x6a;\nlop3.b32 u13, s, 0x00F000F0, 0x64806480, 0x6a;\n"
            "sub.f16x2 t02, t02, k0;\nsub.f16x2 t13, t13, k0;\n"
            "fma.rn.f16x2 u02, u02, k1, k2;\nfma.rn.f16x2 u13, u13, k1, k2;\n"
            "cvt.rn.satfinite.e4m3x2.f16x2 c0, t02;\ncvt.rn.satfinite.e4m3x2.f16x2 c1, t13;\n"
            "cvt.rn.satfinite.e4m3x2.f16x2 c2, u02;\ncvt.rn.satfinite.e4m3x2.f16x2 c3, u13;\n"
            "mov.b32 p, {c0, c1};\nmov.b32 q, {c2, c3};\n"
            f"prmt.b32 $0, p, 0, {sel};\nprmt.b32 $1, q, 0, {sel};\n}}")


# a module-level constexpr: a jit function may reference a global of this kind, not call a Python function (Triton
# 3.6 rejects that when it hashes the kernel's dependencies)
_ASM_INT4X4 = tl.constexpr(_int4x4_asm("0x3120"))


@triton.jit
def int4_halves_to_e4m3(wp, ASM: tl.constexpr):
    """packed int4 bytes (uint8 tile) -> (low nibbles, high nibbles) as float8e4nv tiles of the same shape."""
    if ASM == 0:
        return int4_to_e4m3(wp & 0xF), int4_to_e4m3(wp >> 4)
    else:
        lo, hi = tl.inline_asm_elementwise(_ASM_INT4X4, "=r,=r,r", [wp], dtype=(tl.uint8, tl.uint8), is_pure=True,
                                           pack=4)
        return lo.to(tl.float8e4nv, bitcast=True), hi.to(tl.float8e4nv, bitcast=True)


@triton.jit
def int4_to_f32(nibble):
    """two's complement int4 nibble -> fp32 without I2F (quarter rate): 0x4B000000 | m is 2^23 + m exactly."""
    return ((nibble.to(tl.int32) ^ 0x4B000008).to(tl.float32, bitcast=True) - 8388616.0)


@triton.jit
def _qgemm_step(acc, a_ptr, as_ptr, w_base, ws_base, a_rows, offs_nc, k0, kk, kh, stride_am, stride_asm, stride_wn,
                stride_wsn, A_FMT: tl.constexpr, A_G: tl.constexpr, W_FMT: tl.constexpr, W_SCALE: tl.constexpr,
                WG: tl.constexpr, WGN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                DOT_F32: tl.constexpr, MMA8: tl.constexpr):
    """one K tile of the [BM, BN] orientation (activation rows = MMA rows) -> updated acc."""
    # ---- activation tile [BM, BK]
    if A_FMT == 3 or A_FMT == 4:
        ap = tl.load(a_ptr + a_rows[:, None] * stride_am + (k0 // 2 + kh[None, :]))
        av = fp4_decode(unpack_k_rows(ap, BM, BK))
        if A_FMT == 3:
            asc = e8m0_to_f32(tl.load(as_ptr + a_rows[:, None] * stride_asm + (k0 + kk[None, :]) // 32))
        else:
            asc = tl.load(as_ptr + a_rows[:, None] * stride_asm + (k0 + kk[None, :]) // 16).to(tl.float32)
        a = (av * asc).to(tl.bfloat16)
    else:
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + (k0 + kk[None, :]))

    # ---- weight tile [BK, BN] (K-major in memory: w[n, k])
    if W_FMT == 3 or W_FMT == 4:
        wp = tl.load(w_base + offs_nc[None, :] * stride_wn + (k0 // 2 + kh[:, None]))
        wn = unpack_k(wp, BK, BN)
    else:
        wr = tl.load(w_base + offs_nc[None, :] * stride_wn + (k0 + kk[:, None]))

    if MMA8 and W_SCALE == 3:  # the scale fold: exact e4m3 weights, no K-varying scale, one accumulator chain
        down = tl.load(ws_base + offs_nc[None, :] * stride_wsn + (k0 + kk[:, None]) // 32)
        acc = tl.dot(a, fp4_fold_e4m3(wn, down), acc)
    elif MMA8:
        # 8-bit MMA; K-varying scales applied to the partial product
        if A_FMT == 1:
            if W_FMT == 3:
                wq = int4_to_e4m3(wn)
            elif W_FMT == 4:
                wq = fp4_to_e4m3(wn)
            else:
                wq = wr
            part = tl.dot(a, wq)
        else:
            if W_FMT == 3:
                wq = int4_value(wn).to(tl.int8)
            else:
                wq = wr
            part = tl.dot(a, wq, out_dtype=tl.int32).to(tl.float32)
        if A_G > 0:
            part = part * tl.load(as_ptr + a_rows * stride_asm + k0 // A_G)[:, None]
        if WG > 0:
            part = part * _w_scale(ws_base, offs_nc, k0, WGN, stride_wsn, W_SCALE, WG)[None, :]
        acc += part
    else:
        # 16-bit MMA: dequantize the weight tile in registers (group scales folded in)
        if A_FMT == 1 or A_FMT == 2:
            a = a.to(tl.float32).to(tl.bfloat16)  # 8-bit values are exact in bf16; scale stays in the epilogue
        if W_FMT == 0:
            wb = wr
        else:
            if W_FMT == 3:
                wv = int4_to_f32(wn)
            elif W_FMT == 4:
                wv = fp4_decode(wn)
            else:
                wv = wr.to(tl.float32)
            if WG > 0:
                if WG >= BK:
                    wv = wv * _w_scale(ws_base, offs_nc, k0, WGN, stride_wsn, W_SCALE, WG)[None, :]
                else:
                    wv = wv * _w_scale(ws_base, offs_nc[None, :], k0 + kk[:, None], WGN, stride_wsn, W_SCALE, WG)
            if DOT_F32:  # interpreter: emulate the GPU's round-to-nearest bf16 cast (its own truncates)
                wv = round_bf16(wv)
            wb = wv.to(a.dtype)
        if DOT_F32:  # the Triton CPU interpreter's bf16 dot is wrong; values are bf16-exact either way
            acc = tl.dot(a.to(tl.float32), wb.to(tl.float32), acc)
        else:
            acc = tl.dot(a, wb, acc)
    return acc


@triton.jit
def _qgemm_step_halves(acc, a_ptr, w_base, ws_base, a_rows, offs_nc, k0, kh, stride_am, stride_wn, stride_wsn,
                       A_FMT: tl.constexpr, W_SCALE: tl.constexpr, WG: tl.constexpr, WGN: tl.constexpr,
                       BK: tl.constexpr, DOT_F32: tl.constexpr):
    """16-bit-MMA K tile of an int4 weight in the "halves" packing (gemm_w4a8.to_halves): the low nibbles are K
    rows k0 .. k0+BK/2, the high nibbles the next BK/2, so two dots replace the nibble interleave. WG >= BK here."""
    wp = tl.load(w_base + offs_nc[None, :] * stride_wn + (k0 // 2 + kh[:, None]))  # [BK/2, BN]
    a_lo = tl.load(a_ptr + a_rows[:, None] * stride_am + (k0 + kh[None, :]))
    a_hi = tl.load(a_ptr + a_rows[:, None] * stride_am + (k0 + BK // 2 + kh[None, :]))
    if A_FMT == 1 or A_FMT == 2:
        a_lo = a_lo.to(tl.float32).to(tl.bfloat16)
        a_hi = a_hi.to(tl.float32).to(tl.bfloat16)
    w_lo = int4_to_f32(wp & 0xF)
    w_hi = int4_to_f32(wp >> 4)
    if WG > 0:
        sc = _w_scale(ws_base, offs_nc, k0, WGN, stride_wsn, W_SCALE, WG)[None, :]
        w_lo = w_lo * sc
        w_hi = w_hi * sc
    if DOT_F32:  # interpreter: see _qgemm_step
        acc = tl.dot(a_lo.to(tl.float32), round_bf16(w_lo), acc)
        acc = tl.dot(a_hi.to(tl.float32), round_bf16(w_hi), acc)
    else:
        acc = tl.dot(a_lo, w_lo.to(a_lo.dtype), acc)
        acc = tl.dot(a_hi, w_hi.to(a_hi.dtype), acc)
    return acc


@triton.jit
def _qgemm_kernel(
    a_ptr, as_ptr, ags_ptr, w_ptr, ws_ptr, wgs_ptr, c_ptr,
    topk_w_ptr, sorted_ptr, expert_ptr, npost_ptr,
    M, N, K, num_valid, a_div, out_div,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_cm,
    A_FMT: tl.constexpr, A_G: tl.constexpr, W_FMT: tl.constexpr, W_SCALE: tl.constexpr,
    WG: tl.constexpr, WGN: tl.constexpr, HAS_WGS: tl.constexpr,
    IS_MOE: tl.constexpr, MUL_ROUTED: tl.constexpr, SPLIT_K: tl.constexpr, REDUCE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, DOT_F32: tl.constexpr,
    MMA8: tl.constexpr, OUT_BF16: tl.constexpr, SWAP: tl.constexpr, HALVES: tl.constexpr, ASM: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BN)
    offs_bm = tl.arange(0, BM)
    if IS_MOE:
        pid_m = pid // num_pid_n
        pid_n = pid % num_pid_n
        if pid_m * BM >= tl.load(npost_ptr):
            return
        expert = tl.load(expert_ptr + pid_m).to(tl.int64)
        tok = tl.load(sorted_ptr + pid_m * BM + offs_bm)
        row_ok = tok < num_valid
        a_rows = tl.where(row_ok, tok // a_div, 0).to(tl.int64)
        slot_rows = tok.to(tl.int64)
        c_rows = (tok // out_div).to(tl.int64)  # REDUCE: out_div = top-k, each slot lands in its token's row
    else:
        num_pid_m = tl.cdiv(M, BM)
        pid_m, pid_n = tl.swizzle2d(pid // num_pid_n, pid % num_pid_n, num_pid_m, num_pid_n, GROUP_M)
        expert = 0
        rows = pid_m * BM + offs_bm
        row_ok = rows < M
        a_rows = tl.where(row_ok, rows, 0).to(tl.int64)
        c_rows = rows.to(tl.int64)
        slot_rows = c_rows

    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_nc = tl.where(n_ok, offs_n, 0)
    w_base = w_ptr + expert * stride_we
    ws_base = ws_ptr + expert * stride_wse
    kk = tl.arange(0, BK)
    kh = tl.arange(0, BK // 2)

    k_per_split = K // SPLIT_K
    k_start = tl.program_id(1) * k_per_split
    if SWAP:
        acc = tl.zeros((BN, BM), tl.float32)
    else:
        acc = tl.zeros((BM, BN), tl.float32)

    for k0 in range(k_start, k_start + k_per_split, BK):
        if SWAP and W_SCALE == 3:  # the scale fold, swapped (see _qgemm_step)
            at = tl.load(a_ptr + a_rows[None, :] * stride_am + (k0 + kk[:, None]))  # [BK, BM]
            wn = unpack_k_rows(tl.load(w_base + offs_nc[:, None] * stride_wn + (k0 // 2 + kh[None, :])), BN, BK)
            down = tl.load(ws_base + offs_nc[:, None] * stride_wsn + (k0 + kk[None, :]) // 32)
            acc = tl.dot(fp4_fold_e4m3(wn, down), at, acc)
        elif SWAP:
            # C^T = W @ A^T (8-bit MMA only): the weight tile, converted in registers, is the wgmma A operand (which
            # may live in registers), the few activation rows are its N side (8..256 wide) -> small-M GEMMs fill
            # the 64-row MMA with weight rows instead of padding tokens, and no converted tile goes through smem
            if HALVES:  # int4 "halves" packing: two K halves straight from one byte load, no interleave
                wp = tl.load(w_base + offs_nc[:, None] * stride_wn + (k0 // 2 + kh[None, :]))  # [BN, BK/2]
                at_lo = tl.load(a_ptr + a_rows[None, :] * stride_am + (k0 + kh[:, None]))  # [BK/2, BM]
                at_hi = tl.load(a_ptr + a_rows[None, :] * stride_am + (k0 + BK // 2 + kh[:, None]))
                if A_FMT == 1:
                    w_lo, w_hi = int4_halves_to_e4m3(wp, ASM)
                    part = tl.dot(w_lo, at_lo)
                    part = tl.dot(w_hi, at_hi, part)
                elif A_FMT == 0:  # bf16 activations (W4A16): unscaled int4 values are exact in bf16, the group scale
                    # (constant over the tile: WG >= BK) multiplies the [BN, BM] partial below, not every weight
                    w_lo = int4_to_f32(wp & 0xF)
                    w_hi = int4_to_f32(wp >> 4)
                    if DOT_F32:  # interpreter: its bf16 dot is wrong; the values are bf16-exact either way
                        part = tl.dot(w_lo, at_lo.to(tl.float32))
                        part = tl.dot(w_hi, at_hi.to(tl.float32), part)
                    else:
                        part = tl.dot(w_lo.to(tl.bfloat16), at_lo)
                        part = tl.dot(w_hi.to(tl.bfloat16), at_hi, part)
                else:
                    part = tl.dot(int4_value(wp & 0xF).to(tl.int8), at_lo, out_dtype=tl.int32)
                    part = tl.dot(int4_value(wp >> 4).to(tl.int8), at_hi, part, out_dtype=tl.int32).to(tl.float32)
            else:
                at = tl.load(a_ptr + a_rows[None, :] * stride_am + (k0 + kk[:, None]))  # [BK, BM], K-major
                if W_FMT == 3 or W_FMT == 4:
                    wn = unpack_k_rows(tl.load(w_base + offs_nc[:, None] * stride_wn + (k0 // 2 + kh[None, :])), BN,
                                       BK)
                    if W_FMT == 4:
                        wq = fp4_to_e4m3(wn)
                    elif A_FMT == 1:
                        wq = int4_to_e4m3(wn)
                    else:
                        wq = int4_value(wn).to(tl.int8)
                else:
                    wq = tl.load(w_base + offs_nc[:, None] * stride_wn + (k0 + kk[None, :]))  # [BN, BK]
                if A_FMT == 1:
                    part = tl.dot(wq, at)
                else:
                    part = tl.dot(wq, at, out_dtype=tl.int32).to(tl.float32)
            if A_G > 0:
                part = part * tl.load(as_ptr + a_rows * stride_asm + k0 // A_G)[None, :]
            if WG > 0:
                part = part * _w_scale(ws_base, offs_nc, k0, WGN, stride_wsn, W_SCALE, WG)[:, None]
            acc += part
        elif HALVES:  # (16-bit MMA: the 8-bit MMA takes the swapped branch whenever the weight is in halves)
            acc = _qgemm_step_halves(acc, a_ptr, w_base, ws_base, a_rows, offs_nc, k0, kh, stride_am, stride_wn,
                                     stride_wsn, A_FMT, W_SCALE, WG, WGN, BK, DOT_F32)
        else:
            acc = _qgemm_step(acc, a_ptr, as_ptr, w_base, ws_base, a_rows, offs_nc, k0, kk, kh, stride_am, stride_asm,
                              stride_wn, stride_wsn, A_FMT, A_G, W_FMT, W_SCALE, WG, WGN, BM, BN, BK, DOT_F32, MMA8)
    if SWAP:
        acc = tl.trans(acc)  # once per tile, back to [BM, BN] for the shared epilogue

    # ---- epilogue: scales constant over K
    if (A_FMT == 1 or A_FMT == 2) and A_G == 0:
        acc = acc * tl.load(as_ptr + a_rows * stride_asm)[:, None]
    if A_FMT == 4:
        acc = acc * tl.load(ags_ptr)
    if WG == 0 and W_FMT != 0:
        acc = acc * tl.load(ws_base + offs_nc * stride_wsn)[None, :].to(tl.float32)
    if W_SCALE == 3:  # the fold's channel scales (dense only: launch refuses MoE)
        acc = acc * tl.load(wgs_ptr + offs_nc)[None, :]
    if HAS_WGS:
        if IS_MOE:
            acc = acc * tl.load(wgs_ptr + expert)
        else:
            acc = acc * tl.load(wgs_ptr)
    if MUL_ROUTED:
        acc = acc * tl.load(topk_w_ptr + slot_rows, mask=row_ok, other=0.0)[:, None]
    c_off = c_rows[:, None] * stride_cm + offs_n[None, :]
    c_mask = row_ok[:, None] & n_ok[None, :]
    if SPLIT_K > 1 or REDUCE:
        # relaxed: only the sum matters (the launch's end orders it); the default acq_rel fences every add
        tl.atomic_add(c_ptr + c_off, acc, mask=c_mask, sem="relaxed")
    elif OUT_BF16:
        tl.store(c_ptr + c_off, round_bf16(acc).to(tl.bfloat16), mask=c_mask)
    else:
        tl.store(c_ptr + c_off, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@dataclass(frozen=True)
class GemmConfig:
    """Compute config (tile sizes, split-K, pipeline) — the part `kestrel tune` searches."""
    BM: int = 64
    BN: int = 128
    BK: int = 128
    SPLIT_K: int = 1
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3
    SWAP_AB: int = 0  # 1: compute C^T = W @ A^T (8-bit MMA paths; small M: weight rows fill the 64-row wgmma)
    TMA: int = 0  # dense W8A8 with per-token x per-channel scales: 1 = TMA kernel, 2 = TMA + persistent CTAs

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> "GemmConfig":
        """tolerates entries written by older / newer versions (unknown keys dropped, missing ones defaulted)."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass(frozen=True)
class Operand:
    """A quantized GEMM operand: data + its scale tensors and how to read them."""
    fmt: int
    data: torch.Tensor
    scale: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    group: int = 0  # scale group along K (0 = one scale for the whole K)
    group_n: int = 1  # weight scale block along N (DeepSeek 128x128 blocks)
    scale_kind: int = S_FLOAT
    halves: bool = False  # int4 weight in gemm_w4a8's "halves" packing (K tile must be 128)


def uses_mma8(a: Operand, w: Operand) -> bool:
    """8-bit MMA unless the weight scale blocks are shorter than one fp8/int8 MMA step (32 deep): then the 8-bit
    activations (exact in bf16) go through the bf16 path with the weight dequantized in registers (NVFP4 weights)."""
    return a.fmt in (A_FP8, A_INT8) and not (0 < w.group < 32)


def max_block_k(a: Operand, w: Operand, K: int) -> int:
    """largest BK the scale layout allows (8-bit MMA with K-varying scales needs BK <= group)."""
    bk = 128
    if uses_mma8(a, w):
        for g in (a.group, 0 if w.scale_kind == S_FOLD else w.group):  # (folded scales do not bound the K tile)
            if g:
                bk = min(bk, g)
    return bk


def launch(a: Operand, w: Operand, out: torch.Tensor, M: int, N: int, K: int, cfg: GemmConfig, *,
           moe: dict | None = None):
    """Run the kernel. `moe` = dict(sorted_ids, expert_ids, num_post, num_valid, a_div, topk_weights|None)."""
    BK = 128 if w.halves else min(cfg.BK, max_block_k(a, w, K))  # halves: the packing block is the K tile
    while BK > 32 and (K // cfg.SPLIT_K) % BK and not w.halves:  # small / odd K: shrink the K tile rather than fail
        BK //= 2
    if w.scale_kind == S_FOLD and (moe is not None or a.fmt != A_FP8 or a.group or w.fmt != W_FP4):
        raise ValueError("the MXFP4 scale fold takes a dense fp8 GEMM with per-token activation scales")
    if a.group and not uses_mma8(a, w):
        raise ValueError("per-group activation scales need weight scale groups of >= 32 (8-bit MMA path)")
    if K % BK or (K // cfg.SPLIT_K) % BK:
        raise ValueError(f"K={K} must be a multiple of BLOCK_K={BK} (x split_k={cfg.SPLIT_K})")
    if w.halves and (BK != 128 or a.fmt not in (A_BF16, A_FP8, A_INT8) or (w.group and w.group % 128)):
        raise ValueError(f"a halves-packed int4 weight needs a K tile of 128 per split (K={K}, split {cfg.SPLIT_K}), "
                         f"bf16 / 8-bit activations and groups of 128")
    wd = w.data
    stride_we = wd.stride(0) if wd.dim() == 3 else 0
    ws = w.scale if w.scale is not None else wd
    stride_wse = ws.stride(0) if moe is not None else 0
    stride_wsn = ws.stride(-2) if (w.group and ws.dim() >= 2) else ws.stride(-1)
    a_s = a.scale if a.scale is not None else a.data
    # swapped operands: 8-bit MMA (always for halves weights), or a halves int4 weight x bf16 when the config asks
    swap = bool(cfg.SWAP_AB or w.halves) and uses_mma8(a, w) or bool(cfg.SWAP_AB and w.halves and a.fmt == A_BF16)
    dummy = out
    if moe is None:
        grid = (triton.cdiv(M, cfg.BM) * triton.cdiv(N, cfg.BN), cfg.SPLIT_K)
        sorted_ids = expert_ids = npost = topk_w = dummy
        num_valid, a_div, mul_routed, out_div = M, 1, False, 1
    else:
        sorted_ids, expert_ids, npost = moe["sorted_ids"], moe["expert_ids"], moe["num_post"]
        topk_w = moe.get("topk_weights")
        mul_routed = topk_w is not None
        topk_w = topk_w if mul_routed else dummy
        num_valid, a_div, out_div = moe["num_valid"], moe["a_div"], moe.get("reduce_k") or 1
        grid = (expert_ids.numel() * triton.cdiv(N, cfg.BN), cfg.SPLIT_K)  # split-K: out zeroed fp32 (atomics)
    _qgemm_kernel[grid](
        a.data, a_s, a.global_scale if a.global_scale is not None else a_s,
        wd, ws, w.global_scale if w.global_scale is not None else ws, out,
        topk_w, sorted_ids, expert_ids, npost,
        M, N, K, num_valid, a_div, out_div,
        a.data.stride(0), a_s.stride(0) if a_s.dim() > 1 else 1, stride_we, wd.stride(-2), stride_wse, stride_wsn,
        out.stride(0),
        A_FMT=a.fmt, A_G=a.group if a.fmt in (A_FP8, A_INT8) else 0, W_FMT=w.fmt, W_SCALE=w.scale_kind,
        WG=w.group, WGN=w.group_n, HAS_WGS=w.global_scale is not None and w.scale_kind != S_FOLD,
        IS_MOE=moe is not None, MUL_ROUTED=mul_routed, SPLIT_K=cfg.SPLIT_K, REDUCE=out_div > 1,
        BM=cfg.BM, BN=cfg.BN, BK=BK, GROUP_M=cfg.GROUP_M, DOT_F32=not out.is_cuda, MMA8=uses_mma8(a, w),
        OUT_BF16=out.dtype == torch.bfloat16, SWAP=swap, HALVES=w.halves,
        ASM=0 if not out.is_cuda else DECODE_ASM,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# W4A8 at 16 < M <= 256: the swapped BM x 64 tile makes one CTA per 64 weight rows, so N = 4096 / 8192 fill 64 / 128
# of the H200's 132 SMs (session 10: M = 64 0.34 / 0.50x Humming W4A8). KESTREL_W4A8_SPLIT=S (> 1): split K (fp32
# atomics, as the decode tiles) in up to S parts while the grid is under one wave (grid_fill_split). 1 (default until
# a GPU measurement): no split, the session-10 heuristic
W4A8_SPLIT = int(os.environ.get("KESTREL_W4A8_SPLIT", "1"))
# the same for the FP8 / INT8 TMA kernel at 16 < M <= 256 (4096 x 14336 at M = 64: 64 CTAs, GEMM 27.2 us where the
# weight stream alone is ~12; 0.80x Humming W8A8 e2e, session 10): KESTREL_W8A8_SPLIT=S, K parts summed in the kernel
# (lowbit_tma.launch_tma). 1 (default until a GPU measurement): no split
W8A8_SPLIT = int(os.environ.get("KESTREL_W8A8_SPLIT", "1"))


def grid_fill_split(tiles: int, K: int, max_split: int, num_sms: int = 132) -> int:
    """K parts for a grid of `tiles` CTAs: doubled while the grid is under one wave, every part keeps at least
    four 128-deep K tiles (group-128 scales stay whole per part) and K divides evenly."""
    split = 1
    while tiles * split < num_sms and split < max_split and K % (128 * split * 2) == 0 and K // (split * 2) >= 512:
        split *= 2
    return split


def heuristic_config(M: int, N: int, K: int, a_fmt: int, w_fmt: int, num_sms: int = 132) -> GemmConfig:
    """Default compute config when the tune cache has no entry. The 8-bit-MMA choices are the H200 sweep's best on
    average over nine Llama-3 shapes (bench/results/gemm_w8a8_sweep.md); 6 stages at 16 < M <= 256 and the fused
    W4A8 kernel at M > 256 come from the follow-up run at 8192x8192 (bench/results/gemm_w8a8.md)."""
    dq16 = a_fmt in (A_BF16, A_MXFP4, A_NVFP4)
    w4 = w_fmt in (W_INT4, W_FP4)
    if not dq16 and M > 16:
        if w4:  # W4A8: swapped (weight rows on the MMA's 64-row side). (Expand-to-fp8 + TMA, config TMA=1, measured
            # slower: its per-K-tile group scaling stalls the wgmma pipeline.)
            if M <= 256:
                bm = min(128, triton.next_power_of_2(M))
                split = grid_fill_split(triton.cdiv(M, bm) * triton.cdiv(N, 64), K, W4A8_SPLIT, num_sms)
                return GemmConfig(BM=bm, BN=64, BK=128, SPLIT_K=split, num_warps=4, num_stages=4, SWAP_AB=1)
            return GemmConfig(BM=128, BN=128, BK=128, num_warps=8, num_stages=3, SWAP_AB=1)
        if M <= 256:  # TMA kernel (per-token x per-channel scales; other scale layouts reuse the tiles unTMA'd).
            # BN 64 when 64x128 tiles leave SMs idle (H200 8192x8192 M = 64: 64 -> 128 CTAs, 22.8 -> 22.0 us,
            # bench/results/moe_h200_run6.md)
            bn = 64 if triton.cdiv(M, 64) * triton.cdiv(N, 128) < num_sms else 128
            split = grid_fill_split(triton.cdiv(M, 64) * triton.cdiv(N, bn), K, W8A8_SPLIT, num_sms)
            return GemmConfig(BM=64, BN=bn, BK=128, SPLIT_K=split, num_warps=4, num_stages=6, TMA=1)
        return GemmConfig(BM=128, BN=256, BK=128, num_warps=8, num_stages=3, TMA=1)
    bk = 64 if dq16 else 128
    if M <= 16:
        bm, bn, warps, stages = 16, 64, 4, 4
    elif M <= 64:
        bm, bn, warps, stages = 32 if M <= 32 else 64, 128, 4, 4
    elif M <= 256:
        bm, bn, warps, stages = 64, 128, 4, 4
    else:
        bm, bn, warps, stages = 128, 128, 8, 3 if dq16 else 4
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    split = 1
    max_split = 2 if (w4 and not dq16) else 8  # W4A8 decode: split 2 measured best on every shape
    while tiles * split < num_sms and K % (bk * split * 2) == 0 and split < max_split and K // (split * 2) >= 512:
        split *= 2
    swap = int(w4 and not dq16)  # W4A8 decode: the converted weight tile stays in registers as the MMA A operand
    return GemmConfig(BM=bm, BN=bn, BK=bk, SPLIT_K=split, num_warps=warps, num_stages=stages, SWAP_AB=swap)


def candidate_configs(M: int, a_fmt: int, w_fmt: int | None = None) -> list[GemmConfig]:
    """Search space for `kestrel tune` (kept small: each candidate is a JIT compile)."""
    dq16 = a_fmt in (A_BF16, A_MXFP4, A_NVFP4)
    bks = (64,) if dq16 else (64, 128)
    bms = (16, 32) if M <= 16 else (32, 64) if M <= 64 else (64, 128)
    out = []
    for bm in bms:
        for bn in (64, 128, 256):
            for bk in bks:
                for split in ((1, 2, 4) if M <= 64 else (1,)):
                    for stages in (3, 4):
                        warps = 8 if bm * bn >= 128 * 128 else 4
                        out.append(GemmConfig(BM=bm, BN=bn, BK=bk, SPLIT_K=split, num_warps=warps, num_stages=stages))
    if not dq16:  # swapped operands (8-bit MMA) and, above decode sizes, the TMA kernel
        # (16 < M <= 64: also 32-row tiles, twice the CTAs, and 4 K parts: W4A8's under-filled grid at small N)
        for bm in ((16,) if M <= 16 else (32, 64, 128) if M <= 64 else (64, 128)):
            for bn, split in ((64, 1), (64, 2), (128, 1), (128, 2), (256, 1)) + (((64, 4), (128, 4)) if 16 < M <= 64
                                                                               else ()):
                w = 8 if bm * bn >= 128 * 128 else 4
                out.append(GemmConfig(BM=bm, BN=bn, BK=128, SPLIT_K=split, num_warps=w, num_stages=4, SWAP_AB=1))
        if M > 16:
            for bm, bn, w, st in ((64, 128, 4, 4), (64, 128, 4, 6), (128, 64, 4, 4), (128, 64, 4, 6),
                                  (128, 128, 8, 4), (128, 256, 8, 3), (256, 128, 8, 3)):
                for tma in (1, 2):
                    out.append(GemmConfig(BM=bm, BN=bn, BK=128, num_warps=w, num_stages=st, TMA=tma))
            if M <= 64:  # small grids: narrower tiles and in-kernel K parts (lowbit_tma SPLIT)
                for bn, split in ((32, 1), (64, 2), (64, 4), (128, 2)):
                    out.append(GemmConfig(BM=64, BN=bn, BK=128, SPLIT_K=split, num_warps=4, num_stages=6, TMA=1))
    return out


def _tma_shape(a: Operand, w: Operand) -> bool:
    """the TMA kernel covers 8-bit x 8-bit with per-token x per-channel scales (scales constant over K)."""
    return ((a.fmt, w.fmt) in ((A_FP8, W_FP8), (A_INT8, W_INT8)) and a.group == 0 and w.group == 0
            and a.scale is not None and w.scale is not None and w.data.dim() == 2)


def run_dense(a: Operand, w: Operand, M: int, N: int, K: int, out_dtype: torch.dtype,
              cfg: GemmConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """Dense C[M, N] = A[M, K] @ W[N, K]^T with the scales of both operands. pdl: the TMA kernel (if it runs) is a
    programmatic dependent launch of the kernel before it (lowbit_tma.launch_tma)."""
    if M == 0:
        return torch.empty((0, N), dtype=out_dtype, device=a.data.device)
    if cfg is None:
        cfg = heuristic_config(M, N, K, a.fmt, w.fmt)
    if cfg.TMA and (cfg.SPLIT_K == 1 or cfg.TMA == 1) and _tma_shape(a, w):  # (TMA 1: K parts summed in-kernel)
        from kestrel.kernels.lowbit_tma import launch_tma, tma_ok
        out = torch.empty((M, N), dtype=out_dtype, device=a.data.device)
        if tma_ok(a.data, w.data, out):
            return launch_tma(a.data, a.scale.reshape(-1), w.data, w.scale.reshape(-1), out, cfg, pdl=pdl)
    if cfg.SPLIT_K > 1:
        acc = torch.zeros((M, N), dtype=torch.float32, device=a.data.device)
        launch(a, w, acc, M, N, K, cfg)
        return acc.to(out_dtype)
    out = torch.empty((M, N), dtype=out_dtype, device=a.data.device)
    launch(a, w, out, M, N, K, cfg)
    return out
