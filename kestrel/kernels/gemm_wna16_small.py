"""Small-M (decode, M <= 16) WNA16 kernels: memory-bound, so the aim is to stream the packed weight once at close to
copy bandwidth with as few instructions per weight element as possible.

- "mv"   tensor cores for every M <= 16 (M padded to BLOCK_M = 16): each bit field i of a planar [R, BN] word tile
         (packing.py) is a [R, BN] tile of contiguous k, decoded to an *unscaled* exact value and fed to a K=16 MMA
         chained over the fields of one quantization group; the affine correction
         sum (c - z) x = sum (OFF + c) x - (OFF + z) sum x  and the group scale are applied once per group to the
         [BM, BN] dot result, not per weight element. Decode: 4-bit ints on the GPU take two words per PRMT + LOP3
         (inline PTX, OFF + c straight into bf16/fp16 bits, as Marlin-style kernels do), e2m1 (MXFP4/NVFP4) by
         bit moves into bf16/fp16 (value / 2^126 resp. / 2^14) and one exact packed multiply (inline PTX);
         elsewhere 1 + c/2^B through fp32 mantissa bits (OFF = 2^B after scaling by 2^B), c itself for 8-bit codes,
         minifloats their value.
         Triton moves the int32 word tile (not the decoded values) through shared memory into the MMA operand
         layout and decodes there, so the decode is ~1 integer op per element. "mvs" swaps the operands (W is the
         MMA A operand, wgmma on Hopper).
- "gemv" CUDA-core FMA path for M = 1 (one program per row of x); kept for formats/shapes where it wins.

Split-K finishes in the same launch: each K split stores its fp32 partial, the last program of a tile (an acq_rel
counter per tile, reset by that program) sums the partials in split order (deterministic) and writes y in the
activation dtype. No zero-fill launch, no atomics on y, no cast launch: one kernel per GEMM inside a CUDA graph.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kestrel.kernels.dequant import decode_scale, fp_plane, int_plane, int_to_f32


@triton.jit
def _nibble_pairs(q, FIELD: tl.constexpr, FP16: tl.constexpr, SUB: tl.constexpr):
    """GPU only (inline PTX): 4-bit field FIELD of int32 words -> bf16/fp16, two words per PRMT + LOP3 (+ SHR for
    odd fields): OFF + c exactly (magic exponent, OFF = 128 in bf16, 1024 in fp16), and with SUB >= 0 minus
    (OFF + SUB) in one packed FMA, i.e. c - SUB exactly."""
    B: tl.constexpr = FIELD // 2
    sel = tl.full(q.shape, ((4 + B) << 12) | ((4 + B) << 8) | (B << 4) | B, tl.int32)  # byte B of each word
    magic = tl.full(q.shape, 0x64006400 if FP16 else 0x43004300, tl.int32)
    one = tl.full(q.shape, 0x3C003C00 if FP16 else 0x3F803F80, tl.int32)
    NEG: tl.constexpr = (0xE400 if FP16 else 0xC300) | (SUB if SUB >= 0 else 0)
    neg = tl.full(q.shape, (NEG << 16) | NEG, tl.int32)
    cons: tl.constexpr = "=r,r,r,r,r,r,r,r,r,r,r"
    if FIELD % 2 == 0:
        if SUB < 0:
            asm: tl.constexpr = "prmt.b32 $0, $1, $2, $3; lop3.b32 $0, $0, 0x000F000F, $5, 0xEA;"
        elif FP16:
            asm: tl.constexpr = "prmt.b32 $0, $1, $2, $3; lop3.b32 $0, $0, 0x000F000F, $5, 0xEA; fma.rn.f16x2 $0, $0, $7, $9;"
        else:
            asm: tl.constexpr = "prmt.b32 $0, $1, $2, $3; lop3.b32 $0, $0, 0x000F000F, $5, 0xEA; fma.rn.bf16x2 $0, $0, $7, $9;"
    else:
        if SUB < 0:
            asm: tl.constexpr = "prmt.b32 $0, $1, $2, $3; shr.b32 $0, $0, 4; lop3.b32 $0, $0, 0x000F000F, $5, 0xEA;"
        elif FP16:
            asm: tl.constexpr = "prmt.b32 $0, $1, $2, $3; shr.b32 $0, $0, 4; lop3.b32 $0, $0, 0x000F000F, $5, 0xEA; fma.rn.f16x2 $0, $0, $7, $9;"
        else:
            asm: tl.constexpr = "prmt.b32 $0, $1, $2, $3; shr.b32 $0, $0, 4; lop3.b32 $0, $0, 0x000F000F, $5, 0xEA; fma.rn.bf16x2 $0, $0, $7, $9;"
    if FP16:
        return tl.inline_asm_elementwise(asm, cons, [q, sel, magic, one, neg], dtype=tl.float16, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(asm, cons, [q, sel, magic, one, neg], dtype=tl.bfloat16, is_pure=True, pack=2)


def _asm_fp4_field(odd: bool, fp16: bool) -> tl.constexpr:
    """PTX: e2m1 field (byte $3's low nibble, or the high one when odd) of two words -> their values times the
    multiplier $5 as one bf16x2/f16x2 register. The byte permute puts byte B of word 0 in bytes 0-1 and of word 1
    in bytes 2-3 (ptxas shares it between the two fields of a byte); from the copy in byte 1 (3) the sign goes to
    bit 15 (31) and the exponent + mantissa to bits 8..6 (bf16) or 11..9 (fp16), where an e2m1 subnormal is a
    bf16/fp16 subnormal, i.e. value / 2^126 (bf16) or / 2^14 (fp16); sign and magnitude are merged, and the
    multiply by $5 (2^126 / 2^14, or with e8m0 scales folded in: 2^126 * scale * 2^-FOLD_EXP, bf16) gives the
    (scaled) value exactly."""
    if fp16:
        mag, sign = ("shr.u32 u, t, 3; ", "") if odd else ("shl.b32 u, t, 1; ", "shl.b32 t, t, 4; ")
        mask, ty = "0x0E000E00", "f16x2"
    else:
        mag, sign = ("shr.u32 u, t, 6; ", "") if odd else ("shr.u32 u, t, 2; ", "shl.b32 t, t, 4; ")
        mask, ty = "0x01C001C0", "bf16x2"
    # the and/and/or below is the GPU-verified form (session 2); ptxas merges it into one LOP3 itself (sm_90 SASS)
    return tl.constexpr("{ .reg .b32 t, u; prmt.b32 t, $1, $2, $3; " + mag + sign + f"and.b32 u, u, {mask}; "
                        f"and.b32 t, t, 0x80008000; or.b32 t, t, u; mul.rn.{ty} $0, t, $5; }}")


def _asm_fp4_imad(odd: bool) -> tl.constexpr:
    """A bf16 e2m1 field with its bit moves on the FMA pipe: the nibble of the byte-0 (byte-2) copy, masked, times
    0x1040 (even; 0x0104 odd) makes two non-overlapping shifted copies (one with the sign at bit 15, one with the
    exponent + mantissa at bits 8..6) and one mask keeps exactly those bits: LOP3, IMAD, LOP3 where _asm_fp4_field
    takes SHF (+ SHL), LOP3, LOP3 (sm_90 SASS), i.e. one integer-pipe op less per register pair, the integer pipe
    (half rate on Hopper) being the decode's limit. Then the multiply by $5 as in _asm_fp4_field."""
    mask, k = ("0x00F000F0", "0x0104") if odd else ("0x000F000F", "0x1040")
    tail = "and.b32 u, u, 0x81C081C0; mul.rn.bf16x2 $0, u, $5; }"
    return tl.constexpr("{ .reg .b32 t, u; prmt.b32 t, $1, $2, $3; " + f"and.b32 u, t, {mask}; "
                        f"mul.lo.u32 u, u, {k}; " + tail)


def _asm_fp4_pair_order(field: int) -> str:
    """A bf16 e2m1 field of a pair-order word pair (packing.pair_halves: $1 holds fields 0-3 of the two k rows in
    its low | high halves, $2 fields 4-7): the field's two codes are nibble field % 4 of both halves already, so
    _asm_fp4_imad's form runs on the word itself (nibbles 0, 1) or on the word >> 8 (nibbles 2, 3; one SHF that
    ptxas can share between the two) instead of on a byte-permuted copy: no PRMT. Then the multiply by $3 (the
    pair's multiplier: int32 both halves, or the two 16-bit ones)."""
    word, j = ("$1" if field < 4 else "$2"), field % 4
    src, shift = (word, "") if j < 2 else ("t", f"shr.u32 t, {word}, 8; ")
    mask, k = ("0x00F000F0", "0x0104") if j % 2 else ("0x000F000F", "0x1040")
    return ("{ .reg .b32 t, u; " + shift + f"and.b32 u, {src}, {mask}; mul.lo.u32 u, u, {k}; "
            "and.b32 u, u, 0x81C081C0; mul.rn.bf16x2 $0, u, $3; }")


def _asm_int4_pair_order(field: int, fp16: bool, sub: int) -> str:
    """_nibble_pairs for a pair-order word pair: nibble field % 4 of both halves of $1 (fields 0-3) or $2 (4-7),
    shifted down (SHF; none for nibble 0) and merged with the magic exponent $3 (LOP3): OFF + c, and with sub >= 0
    minus (OFF + sub) by the packed FMA ($5 = one, $7 = -(OFF + sub)); no PRMT."""
    word, j = ("$1" if field < 4 else "$2"), field % 4
    src, shift = (word, "") if j == 0 else ("t", f"shr.u32 t, {word}, {4 * j}; ")
    fma = "" if sub < 0 else f"fma.rn.{'f16x2' if fp16 else 'bf16x2'} $0, $0, $5, $7; "
    return "{ .reg .b32 t; " + shift + f"lop3.b32 $0, {src}, 0x000F000F, $3, 0xEA; " + fma + "}"


# by field; int4 by (fp16 * 2 + (sub >= 0)) * 8 + field (the string depends on sub's sign only)
_ASM_FP4_PAIR = tl.constexpr(tuple(_asm_fp4_pair_order(f) for f in range(8)))
_ASM_INT4_PAIR = tl.constexpr(tuple(_asm_int4_pair_order(f, h, s) for h in (False, True) for s in (-1, 0)
                                    for f in range(8)))


_ASM_FP4_EVEN_BF16 = _asm_fp4_field(False, False)
_ASM_FP4_ODD_BF16 = _asm_fp4_field(True, False)
_ASM_FP4_EVEN_F16 = _asm_fp4_field(False, True)
_ASM_FP4_EVEN_BF16_IMAD = _asm_fp4_imad(False)
_ASM_FP4_ODD_BF16_IMAD = _asm_fp4_imad(True)
_ASM_FP4_ODD_F16 = _asm_fp4_field(True, True)
# e8m0 scales folded into the bf16 decode multiplier (mv / mvs, bf16 activations): 2^126 * 2^(e-127) * 2^-FOLD_EXP,
# i.e. bf16 exponent field e + 126 - FOLD_EXP, exact for e in [FOLD_EXP - 125, FOLD_EXP + 128] (clamped outside);
# 2^FOLD_EXP goes back on the fp32 accumulator once. FOLD_EXP = 16: scales 2^-109 .. 2^17 exact, and the folded
# weights (>= 0.5 * 2^(e-143)) stay bf16-normal for e >= 18. Real MXFP4 scales are ~2^-20 .. 2^2.
FOLD_EXP = tl.constexpr(16)
# On by measurement with SCALE_WORDS (mv / mvs, MXFP4, bf16 activations; it takes precedence over GROUP_ROWS):
# H200 2026-12-04 (bench/results/gemm_wna16_smallm.md, session 10 R1), same process, default tile, FOLD + SCALE_WORDS
# + E2M1_IMAD 1 vs the session 9 defaults (SCALE_PREFETCH at M > 4, GROUP_ROWS at M <= 8) on the 8 Llama shapes:
# M = 16 1.08-1.24x, M = 8 1.04-1.13x, M = 4 0.99-1.09x, M = 1 0.97-1.07x (mv defaults). Without SCALE_WORDS
# (session 9) it lost: 0.70-0.95x. False = the group scale is applied on each group's fp32 MMA partial.
FOLD_E8M0 = True
# bf16 e2m1 decode through _asm_fp4_imad with FOLD: 0 off, 1 even fields, 2 all fields. 2 by measurement on the
# H200, FOLD + SCALE_WORDS on the default tile (bench/results/gemm_wna16_smallm.md, session 10): R1 imad1 vs 0
# 1.02-1.07x at M = 16 on the 8 Llama shapes (964 -> 899 instructions per loop, bn128 w2); R2 imad2 vs imad1
# 1.01-1.06x on 27 of the 30 mv points at M = 1..16 (8B qkv M = 16 1.006x, 8B o M = 16 0.999x, 70B qkv M = 8
# 0.97x). Without FOLD it is not used (the GROUP_ROWS / SCALE_PREFETCH paths were timed without it only).
E2M1_IMAD = 2
# Cost probe, timing only (results are WRONG on purpose; bench/wna16_mvs8_sweep.py --probe): which part of the
# MXFP4 mv loop the GPU time goes to. Bit flags on the e2m1 (ASM, no FOLD) path: 1 = no group scale (no scale
# load / decode / accumulator FMA: acc += d), 2 = the e2m1 fields decoded as int4 nibbles (_nibble_pairs: PRMT +
# LOP3 per pair, int4's cost), 4 = no decode beyond the PRMT that gathers a pair (the MMA gets raw word bytes),
# 8 = every group of a planar block takes the block's first scale row (one scale load / decode per block instead
# of one per group; the accumulator FMAs stay).
PROBE = 0
# Groups on the MMA's spare rows (mv, minifloat weights with several scale groups per planar block, M <= BLOCK_M /
# groups): row r of the x tile is x row r // G restricted to the block's group r % G (the other k masked to 0), so
# one MMA chain over the whole block gives every group's partial in its own row; the group scales are applied once
# per block as one [BM, BN] tile (scale row of each row's group) instead of G passes over the accumulator, and the
# G rows of each x row are summed once at the end. MXFP4 (G = 4): 4x fewer accumulator FMAs and scale loads. On by
# measurement: H200 2026-12-04 (bench/results/gemm_wna16_smallm.md, session 8), same config, MXFP4 M = 1 / 4 on
# every Llama shape whose default is mv: 1.155-1.307x faster.
GROUP_ROWS = True
# Partial GROUP_ROWS where all G groups do not fit (MXFP4 M = 5..8, NVFP4 M = 3..8): GROW = the largest power of 2
# d < G with M * d <= BLOCK_M groups per pass, G / d passes per block (row r: x row r // d, group r % d of the
# pass), i.e. d x fewer accumulator FMAs than one pass per group at the same MMA count. On by measurement: H200
# 2026-12-04 (bench/results/gemm_wna16_smallm.md, session 9 R1), MXFP4 M = 8, best tile / split with it vs the
# previous default on the 8 Llama shapes: 1.053-1.139x (winners merged into the tune cache's M = 8 bucket).
GROUP_ROWS_PARTIAL = True
# e8m0 scales with 4 groups per planar block (MXFP4), cp.async pipeline with one block per step: the 4 scale rows of
# block b + 1 are loaded (packed into one int32 per column) while block b is computed. Without it each group's scale
# row is a synchronous 1-byte LDG in the loop (cp.async cannot copy single bytes), waited on 4x per block (sm_90
# SASS). On by measurement except with all groups on the rows (GROUP_ROWS at M <= 4, where it lost 0.81-0.93x on
# the default tile: 156 -> 204 registers at bn64 w1): H200 2026-12-04 (bench/results/gemm_wna16_smallm.md, session 9
# R2), MXFP4 best tile with it vs the default: M = 16 1.04-1.19x, M = 8 1.05-1.17x on the 8 Llama shapes (winners
# merged into the tune cache's M = 8 / 16 buckets).
SCALE_PREFETCH = True
# With FOLD_E8M0 (mv / mvs), e8m0 scales with 4 groups per planar block (MXFP4): the kernel reads e8m0_words(qw)
# (the block's 4 codes of a column in one int32) instead of the scale rows. On the per-row uint8 loads Triton puts
# a shared-memory layout conversion (2 CTA barriers) per group between the coalesced load and the MMA operand
# layout of the multiplier; the int32 word load is pipelined with the word tile and read from shared memory in
# that layout directly (offline sm_90 SASS, bench/wna16_mv_sass.py, MXFP4 bn128 w2 M-tile 16: 8 -> 2 barriers,
# 204 -> 160 registers, 1216 -> 964 instructions per loop; SCALE_PREFETCH's default 1047 / 183 / 8).
SCALE_WORDS = True
# FOLD's e2m1 PTX with each element's own 16-bit multiplier (_fp4_pairs MUL16; Triton packs a pair's two into one
# register), right in whatever layout Triton decodes in. The int32 form (each multiplier twice, the asm reads the
# pair's first) is right only where a pair is two k of one column (the MMA operand layout of num_stages 2 / 3); with
# the manual register prefetch of num_stages 1 Triton decodes all 8 fields in the word load's blocked layout
# (sizePerThread [1, 8] along N: offline sm_90 TTGIR, bench/wna16_mv_sass.py --ab), where a pair is two columns, so
# the second column took the first one's scale: the H200's rel err 0.2-0.25 of session 10. num_stages 1 always takes
# MUL16 (with FOLD_S1); elsewhere an A/B switch until GPU-timed (offline sm_90 SASS at s2 / s3: 1 instruction less
# per loop, IMAD -> LEA, not identical).
MUL16 = False
# FOLD at num_stages 1 (with MUL16 there): off until the H200 confirms the fix (job_decode.sh stage 1); off, s1 takes
# the unfolded path (0ef148d).
FOLD_S1 = False
# With FOLD + SCALE_WORDS the words hold the folded multiplier's bf16 exponent field, clamp(e + 126 - FOLD_EXP, 1,
# 254), instead of the e8m0 code e (fold_words, built once per weight like e8m0_words): the kernel's per group and
# column clamp (VIMNMX) and bias go to pack time; byte << 7 duplicated is the multiplier (offline sm_90a SASS, see
# bench/results/gemm_wna16_smallm.md session 11: MXFP4 bn128 w2 s3 900 -> 867 instructions per loop; with MUL16
# 899 -> 875, and at num_stages 1 (FOLD_S1) bn64 w1 1051 -> 985, spills 24 -> 0 B). On since session 15: H100,
# same process, 8 Llama-3 layers x M 1/4/8/16 (bench/results/gemm_wna16_smallm_h100_s15.md): median 1.014x the
# unbiased words, 25 of 32 faster, worst 0.982x; its GPU tests pass.
FOLD_BIAS_WORDS = True
# Integer weights (int4 g128, ...), mv / mvs: the group's x sum from one extra MMA per field (x times a ones tile)
# so the decode keeps OFF + c and drops its packed FMA per register pair; the OFF + offset correction is one FFMA
# per accumulator element per group (_mv_block XSD); with zero points it replaces the x sum by tl.sum. Offline
# sm_90a SASS (Triton 3.6, mv K loop): int4 bn128 w2 s3 642 -> 555 instructions (HFMA2 128 -> 0, HMMA 64 -> 72,
# FFMA 32 -> 64), registers 147 -> 160; bn128 w4 s2 351 -> 307 (96 -> 127 registers); uint4 (zero points) g128
# 819 -> 603. On since session 15: H100, same process, int4 8 Llama-3 layers x M 1/4/8/16: median 1.010x the
# per-pair FMA decode, 26 of 32 faster or equal, worst 0.988x; its GPU tests pass.
INT_XSUM = True
# The same word load for the GROUP_ROWS passes (mv, M <= 8; A/B switch until GPU-timed): offline sm_90 SASS
# (MXFP4, M-tile 16) bn64 w1 all 4 groups on the rows 979 -> 926 instructions per loop (156 -> 197 registers),
# 2 groups per pass 1029 -> 1001 (217 -> 212).
SCALE_WORDS_GROW = False


# Pair word order (QuantizedWeight.pair_words, packing.pair_halves; opt-in at pack time, the weight carries it and
# the mv / mvs kernels specialise on it: PAIRW): e2m1 (bf16) and int4 decode a register pair without the byte
# permute; with QuantizedWeight.pair_adjacent (ADJ) a pair's two words are also adjacent in memory (64-bit LDS).
# Offline sm_90a SASS (bench/results/gemm_wna16_smallm.md session 11, K loop bn128 w2 s3): int4 642 -> 615 (ADJ 591),
# MXFP4 fold 900 -> 880 (ADJ 864); off (planar) unless a weight is repacked with quant.weight.with_pair_words.

_FP4_CONS = tl.constexpr("=r,r,r,r,r,r,r")  # $0; $1 $2 words, $3 $4 selector, $5 $6 int32 multipliers
_FP4_CONS_MUL16 = tl.constexpr("=r,r,r,r,r,r")  # $0; $1 $2 words, $3 $4 selector, $5 = both 16-bit multipliers


@triton.jit
def _fp4_pairs(q, FIELD: tl.constexpr, FP16: tl.constexpr, mul, IMAD: tl.constexpr = 0, MUL16: tl.constexpr = False):
    """GPU only (inline PTX): e2m1 field FIELD of int32 words -> bf16/fp16 values * mul, two words per register
    pair (the two elements Triton packs: adjacent registers of q's layout). MUL16: `mul` is a 16-bit tensor of q's
    shape, each element's own multiplier; Triton packs a pair's two into one register ($5), right in any layout.
    Else `mul` (int32) holds each element's multiplier in both halves and the asm takes the pair's first ($5 of
    $5, $6): right only when both elements of every pair share it, as a constant does, or a per-column multiplier
    in the MMA operand layout (a pair = adjacent k of one column); in the word load's blocked layout a pair is two
    columns (the FOLD + num_stages 1 bug of session 10)."""
    B: tl.constexpr = FIELD // 2
    sel = tl.full(q.shape, ((4 + B) << 12) | ((4 + B) << 8) | (B << 4) | B, tl.int32)
    asm: tl.constexpr = (_ASM_FP4_EVEN_F16 if FIELD % 2 == 0 else _ASM_FP4_ODD_F16) if FP16 else (
        (_ASM_FP4_EVEN_BF16_IMAD if IMAD else _ASM_FP4_EVEN_BF16) if FIELD % 2 == 0 else (
            _ASM_FP4_ODD_BF16_IMAD if IMAD == 2 else _ASM_FP4_ODD_BF16))
    if MUL16:  # out; words (twice: pack=2), selector (twice), the pair's two multipliers in one register
        return tl.inline_asm_elementwise(asm, _FP4_CONS_MUL16, [q, sel, mul],
                                         dtype=tl.float16 if FP16 else tl.bfloat16, is_pure=True, pack=2)
    # out; words, selector, multiplier (each twice: pack=2)
    return tl.inline_asm_elementwise(asm, _FP4_CONS, [q, sel, mul], dtype=tl.float16 if FP16 else tl.bfloat16,
                                     is_pure=True, pack=2)


_FP4_PAIR_CONS = tl.constexpr("=r,r,r,r,r")  # $0; $1 $2 words, $3 $4 int32 multipliers
_FP4_PAIR_CONS_MUL16 = tl.constexpr("=r,r,r,r")  # $0; $1 $2 words, $3 both 16-bit multipliers


@triton.jit
def _fp4_pairs_pw(q, FIELD: tl.constexpr, mul, MUL16: tl.constexpr = False):
    """_fp4_pairs (bf16, IMAD form) for pair-order words: GPU only, and right only where a pack=2 pair is two
    adjacent k (rows 2p, 2p + 1) of one column, the MMA operand layout of num_stages 2 / 3 (PAIRW 2)."""
    asm: tl.constexpr = _ASM_FP4_PAIR[FIELD]
    if MUL16:
        return tl.inline_asm_elementwise(asm, _FP4_PAIR_CONS_MUL16, [q, mul], dtype=tl.bfloat16, is_pure=True, pack=2)
    return tl.inline_asm_elementwise(asm, _FP4_PAIR_CONS, [q, mul], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _nibble_pairs_pw(q, FIELD: tl.constexpr, FP16: tl.constexpr, SUB: tl.constexpr):
    """_nibble_pairs for pair-order words (PAIRW 2; same layout condition as _fp4_pairs_pw)."""
    asm: tl.constexpr = _ASM_INT4_PAIR[(2 * FP16 + (SUB >= 0)) * 8 + FIELD]
    magic = tl.full(q.shape, 0x64006400 if FP16 else 0x43004300, tl.int32)
    one = tl.full(q.shape, 0x3C003C00 if FP16 else 0x3F803F80, tl.int32)
    NEG: tl.constexpr = (0xE400 if FP16 else 0xC300) | (SUB if SUB >= 0 else 0)
    neg = tl.full(q.shape, (NEG << 16) | NEG, tl.int32)
    return tl.inline_asm_elementwise(asm, "=r,r,r,r,r,r,r,r,r", [q, magic, one, neg],
                                     dtype=tl.float16 if FP16 else tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _unpair_words(q, R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pair-order word tile [R, BN] -> the planar words (packing.pair_halves is its own inverse): for PAIRW 1, the
    interpreter and the layouts where a pack=2 pair is not two k of one column (num_stages 1, fp16 e2m1)."""
    q3 = tl.permute(tl.reshape(q, (R // 2, 2, BLOCK_N)), (0, 2, 1))  # [pair, column, row in pair]
    a, c = tl.split(q3)
    lo = (a & 0xFFFF) | (c << 16)
    hi = ((a >> 16) & 0xFFFF) | (c & -65536)
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (R, BLOCK_N))


@triton.jit
def _adj_tile(q2, R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Planar block's [R, BN] word tile from the [R / 2, 2 BN] tile of the adjacent-pair storage
    (packing.adjacent_pairs, ADJ), which loads as contiguous rows (16-byte cp.async, as the planar tile); Triton then
    reads each thread's two words of a column from shared memory with one 64-bit LDS (offline sm_90a SASS, MXFP4
    fold bn128 w2 s3: LDS 43 -> 27 per loop, same LDGSTS and barriers)."""
    return tl.reshape(tl.permute(tl.reshape(q2, (R // 2, BLOCK_N, 2)), (0, 2, 1)), (R, BLOCK_N))


@triton.jit
def _gather_pairs(q, FIELD: tl.constexpr):
    """Cost probe only (PROBE & 4): the PRMT that gathers byte FIELD // 2 of two words, read as bf16x2."""
    B: tl.constexpr = FIELD // 2
    sel = tl.full(q.shape, ((4 + B) << 12) | ((4 + B) << 8) | (B << 4) | B, tl.int32)
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r,r", [q, sel], dtype=tl.bfloat16,
                                     is_pure=True, pack=2)


@triton.jit
def _scale_word(s_ptr, b, N, offs_n, mask):
    """The e8m0 codes of planar block b's 4 groups (scale rows 4b .. 4b + 3), one byte each of an int32 per
    column (group j in bits 8j .. 8j + 7)."""
    ptrs = s_ptr + (b * 4) * N + offs_n
    w = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
    for j in tl.static_range(1, 4):
        w = w | (tl.load(ptrs + j * N, mask=mask, other=0).to(tl.int32) << (8 * j))
    return w


@triton.jit
def _l2_prefetch(qw_ptr, blk, n0, N, BLOCK_N: tl.constexpr, R: tl.constexpr):
    """GPU only: ask the L2 to fetch planar block `blk`'s R word rows of this program's BLOCK_N columns, one
    prefetch.global.L2 per 128-byte line (about one instruction per thread, no registers or shared memory held):
    the later cp.async loads of that block then hit the L2 instead of waiting on HBM."""
    LINES: tl.constexpr = BLOCK_N // 32 if BLOCK_N >= 32 else 1
    rows = blk * R + tl.arange(0, R)
    cols = tl.minimum(n0 + tl.arange(0, LINES) * 32, N - 1)
    ptrs = qw_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _finish(acc, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym, tile, pid_k, split_k,
            SPLIT: tl.constexpr, RED_STEP: tl.constexpr = 2, ONE_DIRECT: tl.constexpr = False):
    """Write acc [BM, BN] (fp32) to y; with SPLIT (split_k > 1) the last split of this tile reduces all partials,
    RED_STEP (1 or 2) of them per loop step. ONE_DIRECT (stream-K, where split_k is this tile's part count, 1 for a
    tile one program covers whole): a tile of one part stores y straight away."""
    mask = m_mask[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if not SPLIT:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    elif ONE_DIRECT:
        if split_k == 1:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            _split_sum(acc, y_ptrs, mask, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, tile, pid_k, split_k, RED_STEP)
    else:
        _split_sum(acc, y_ptrs, mask, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, tile, pid_k, split_k, RED_STEP)


@triton.jit
def _split_sum(acc, y_ptrs, mask, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, tile, pid_k, split_k,
               RED_STEP: tl.constexpr):
    """_finish's split-K sum: partial pid_k of split_k into its workspace slab; the last to arrive sums them."""
    ws = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(ws + pid_k * M * N, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is written before the (release) count below
    done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if done == split_k - 1:
        # fixed order: the result does not depend on who finished last. The split count is a runtime value,
        # so a loop of one partial per step waits for one L2 round trip per split, on the critical path of
        # every split-K launch; two per step halve that (4 cost 36 more registers: 155 -> 191 on int4 mv
        # bn128 w2, one CTA less per SM). Masked-off slots add exact zeros.
        tot = tl.load(ws, mask=mask, other=0.0, cache_modifier=".cg")
        if RED_STEP == 1:
            for s in range(1, split_k):
                tot += tl.load(ws + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
        else:
            for s in range(1, split_k, 2):
                p1 = tl.load(ws + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
                m2 = mask & ((offs_n[None, :] * 0 + s + 1) < split_k)
                p2 = tl.load(ws + (s + 1) * M * N, mask=m2, other=0.0, cache_modifier=".cg")
                tot += p1
                tot += p2
        tl.store(y_ptrs, tot.to(y_ptrs.dtype.element_ty), mask=mask)
        # ready for the next launch (and the next CUDA-graph replay): a kernel boundary (or PDL's gdc_wait,
        # which waits for this grid's completion and memory flush) orders it, so no fence is needed here
        # (RED_STEP 1 keeps the fenced reset of before, for A/B timing)
        if RED_STEP == 1:
            tl.atomic_xchg(cnt_ptr + tile, 0)
        else:
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed")


@triton.jit
def _mv_block(acc, q, s_pre, b, b1, n_blocks, x_ptr, s_ptr, z_ptr, offs_m, offs_n, m_mask, nb_mask, K, N, stride_xm,
              BITS: tl.constexpr, EPW: tl.constexpr, IS_INT: tl.constexpr, EXP_BITS: tl.constexpr,
              MAN_BITS: tl.constexpr, CODE_OFFSET: tl.constexpr, HAS_ZERO: tl.constexpr, SCALE_KIND: tl.constexpr,
              GROUP_SIZE: tl.constexpr, PER_CHANNEL: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr,
              EVEN_K: tl.constexpr, DOT_F32: tl.constexpr, ASM: tl.constexpr, MASK_B: tl.constexpr,
              PRE_S: tl.constexpr, R: tl.constexpr, FOLD: tl.constexpr = False,
              IMAD: tl.constexpr = 0, PROBE: tl.constexpr = 0, GROW: tl.constexpr = 0, row_g=None,
              PRE_G: tl.constexpr = False, SCALE_WORDS: tl.constexpr = False,
              MUL16: tl.constexpr = False, BIASED: tl.constexpr = False,
              XSUM: tl.constexpr = False, PAIRW: tl.constexpr = 0):
    """acc += this planar block's [BM, BN] (or [BN, BM] with SWAP) contribution; q is its [R, BN] word tile,
    s_pre its group-scale row when PRE_S, or with PRE_G its 4 e8m0 group codes packed (_scale_word), both
    prefetched by the caller. FOLD (e2m1 + e8m0, bf16): the group scale is
    folded into the decoded weights (times 2^-FOLD_EXP, exact), so every field's MMA chains straight into acc
    (the caller multiplies acc by 2^FOLD_EXP at the end); a block past the split's end has zero words (masked
    load), so it adds exact zeros. With SCALE_WORDS (FOLD or GROW, 4 groups per block) s_ptr is e8m0_words(qw): one
    int32 load per column per block, which Triton pipelines (cp.async, with the word tile) and reads from shared
    memory straight into the layout it is used in (the multiplier's MMA operand layout, or the accumulator's): no
    layout conversion, no extra CTA barrier. PAIRW (pair-order words, packing.pair_halves): 1 = back to planar
    first (_unpair_words), 2 = the pair-order PTX decode (bf16 e2m1 / int4, num_stages 2 / 3)."""
    PB: tl.constexpr = R * EPW
    if PAIRW == 1:
        q = _unpair_words(q, R, BLOCK_N)
    # fields per quantization group run: all of a block when one group covers it
    FPG: tl.constexpr = EPW if (PER_CHANNEL or GROUP_SIZE >= PB) else GROUP_SIZE // R
    FPP: tl.constexpr = FPG * GROW  # GROW: fields per pass (one MMA chain, one scale tile)
    MANT: tl.constexpr = BITS < 8  # 1 + c/2^B is exact in bf16 only up to 7 mantissa bits
    # XSUM (ints): the group's x sum from an MMA of x with a ones tile, [BM, BN] in d's layout
    # (every column the row's sum; ptxas keeps one MMA per field, the B operand being the same constant for every
    # N tile), so the ASM decode keeps OFF + c (no packed FMA per pair) and the correction is one FFMA per acc element
    XSD: tl.constexpr = IS_INT and XSUM  # (with zero points: instead of tl.sum's shuffles and barriers)
    # < 0: keep OFF + c and correct through the x sum (zero points, XSUM)
    SUB: tl.constexpr = CODE_OFFSET - 1000 if HAS_ZERO or XSD else CODE_OFFSET
    XS: tl.constexpr = IS_INT and (not ASM or HAS_ZERO) and not XSD  # the group's x sum by tl.sum
    offs_k = tl.arange(0, R)
    # a block past this split's end (MASK_B) reads an in-range x block and is weighted 0
    bc = tl.minimum(b, n_blocks - 1)
    okf = (b < b1).to(tl.float32)
    if SCALE_WORDS:  # the block's 4 e8m0 codes per column (e8m0_words), pipelined by Triton with the word tile
        sw = tl.load(s_ptr + b * N + offs_n, mask=nb_mask, other=0)
        if not FOLD:
            s_pre = sw
    for i in tl.static_range(EPW):
        # field i of the tile: k = b*PB + i*R + r, decoded where the MMA operand lives (Triton moves the word
        # tile, not the decoded values, through shared memory)
        if FOLD and i % FPG == 0:  # this group's e8m0 codes -> the folded multiplier (see FOLD_EXP)
            g = (b * PB + i * R) // GROUP_SIZE
            if SCALE_WORDS:  # byte (group in block) of the block's word
                e = (sw >> (8 * ((i * R) // GROUP_SIZE))) & 0xFF
            else:
                e = tl.load(s_ptr + g * N + offs_n, mask=nb_mask, other=0).to(tl.int32)
            if ASM:
                if BIASED:  # fold_words: the byte is the multiplier's bf16 exponent field already
                    mb = e << 7
                else:
                    mb = tl.minimum(tl.maximum(e + (126 - FOLD_EXP), 1), 254) << 7  # bf16 bits of 2^(e-1-FOLD_EXP)
                if MUL16:  # each element's own bf16 multiplier (right in any layout Triton decodes in)
                    mulq = tl.broadcast_to(mb.to(tl.int16).to(tl.bfloat16, bitcast=True)[None, :], q.shape)
                elif BIASED:  # byte * 0x00800080: the exponent field in both halves (one IMAD after the extract)
                    mulq = tl.broadcast_to((e * 0x00800080)[None, :], q.shape)
                else:
                    mulq = tl.broadcast_to((mb | (mb << 16))[None, :], q.shape)
            elif BIASED:  # e = clamp(e8m0 + 126 - FOLD_EXP): the same 2^(e8m0 - 127 - FOLD_EXP) as below
                sf = (tl.minimum(tl.maximum(e - 126, 1), 254) << 23).to(tl.float32, bitcast=True)
            else:
                sf = (tl.minimum(tl.maximum(e - FOLD_EXP, 1), 254) << 23).to(tl.float32, bitcast=True)
        if ASM and not IS_INT:  # e2m1: the exact value (FOLD: times scale * 2^-FOLD_EXP)
            if PROBE & 4:
                w = _gather_pairs(q, i)
            elif PROBE & 2:
                w = _nibble_pairs(q, i, False, -1)
            elif FOLD and PAIRW == 2:
                w = _fp4_pairs_pw(q, i, mulq, MUL16)
            elif FOLD:
                w = _fp4_pairs(q, i, False, mulq, IMAD, MUL16)
            elif PAIRW == 2:  # (bf16 only: gemm_small) value * 2^126 exactly
                w = _fp4_pairs_pw(q, i, tl.full(q.shape, 0x7E807E80, tl.int32))
            else:
                w = _fp4_pairs(q, i, x_ptr.dtype.element_ty == tl.float16,
                               tl.full(q.shape, 0x74007400 if x_ptr.dtype.element_ty == tl.float16 else 0x7E807E80,
                                       tl.int32), IMAD)  # 2^14 / 2^126 in both halves
        elif FOLD:  # the same folded value without PTX (interpreter)
            w = (fp_plane(q, i, BITS, EXP_BITS, MAN_BITS) * sf[None, :]).to(x_ptr.dtype.element_ty)
        elif ASM and PAIRW == 2:
            w = _nibble_pairs_pw(q, i, x_ptr.dtype.element_ty == tl.float16, SUB)
        elif ASM:  # c - CODE_OFFSET (symmetric) or OFF + c (zero points: corrected through the x sum)
            w = _nibble_pairs(q, i, x_ptr.dtype.element_ty == tl.float16, SUB)
        else:
            if IS_INT:
                if MANT:
                    v = int_plane(q, i, BITS)  # 1 + c/2^B
                else:
                    v = int_to_f32((q >> (i * BITS)) & ((1 << BITS) - 1))
            else:
                v = fp_plane(q, i, BITS, EXP_BITS, MAN_BITS)
            w = v.to(x_ptr.dtype.element_ty)
        kx = bc * PB + i * R + offs_k
        if EVEN_K:
            xmask = m_mask[:, None]
        else:
            xmask = m_mask[:, None] & (kx < K)[None, :]
        if GROW:  # rows of the pass's other groups see x = 0 for this field
            xmask = xmask & (row_g == ((i * R) // GROUP_SIZE) % GROW)[:, None]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kx[None, :], mask=xmask, other=0.0)
        if XS:
            if i % FPG == 0:
                xs = tl.sum(x.to(tl.float32), axis=1)
            else:
                xs += tl.sum(x.to(tl.float32), axis=1)
        if DOT_F32:  # the CPU interpreter's bf16 dot is wrong; fp32 operands hold the same rounded values
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        if XSD:  # x @ ones (XSUM): every element of the tile holds its row's x sum
            ones = tl.full(w.shape, 1.0, w.dtype)
            if SWAP:
                if i % FPG == 0:
                    xsd = tl.dot(tl.trans(ones), tl.trans(x))
                else:
                    xsd = tl.dot(tl.trans(ones), tl.trans(x), xsd)
            else:
                if i % FPG == 0:
                    xsd = tl.dot(x, ones)
                else:
                    xsd = tl.dot(x, ones, xsd)
        if FOLD:  # one fresh chain per block, added to acc once (chaining into acc itself cost ~160 register moves)
            if SWAP:
                if i == 0:
                    d = tl.dot(tl.trans(w), tl.trans(x))
                else:
                    d = tl.dot(tl.trans(w), tl.trans(x), d)
            else:
                if i == 0:
                    d = tl.dot(x, w)
                else:
                    d = tl.dot(x, w, d)
            if i == EPW - 1:
                acc += d
        elif GROW:  # one chain per pass of GROW groups (FPP fields): the pass's groups are apart in rows
            if i % FPP == 0:
                d = tl.dot(x, w)
            else:
                d = tl.dot(x, w, d)
            if (i + 1) % FPP == 0:
                if MASK_B:
                    d = d * okf
                g0 = (b * PB + (i + 1 - FPP) * R) // GROUP_SIZE  # the pass's first group
                if PRE_G or SCALE_WORDS:  # code of row r's group: byte (pass's first group in the block + r % GROW)
                    sg = (s_pre[None, :] >> (8 * (((i + 1 - FPP) * R) // GROUP_SIZE + row_g))[:, None]) & 0xFF
                else:
                    sg = tl.load(s_ptr + (g0 + row_g)[:, None] * N + offs_n[None, :],
                                 mask=m_mask[:, None] & nb_mask[None, :], other=0)
                acc += d * decode_scale(sg, SCALE_KIND)
        elif SWAP:
            if i % FPG == 0:
                d = tl.dot(tl.trans(w), tl.trans(x))  # [BN, BM]
            else:
                d = tl.dot(tl.trans(w), tl.trans(x), d)
        else:
            if i % FPG == 0:
                d = tl.dot(x, w)  # [BM, BN]
            else:
                d = tl.dot(x, w, d)
        if (i + 1) % FPG == 0 and not FOLD and not GROW:  # end of a quantization group run: correction and scale on [BM, BN]
            if PROBE & 8:
                g = (b * PB) // GROUP_SIZE
            else:
                g = (b * PB + (i + 1 - FPG) * R) // GROUP_SIZE
            if XSD and HAS_ZERO:  # d - (OFF + zero) x sum, per column
                zero = tl.load(z_ptr + g * N + offs_n, mask=nb_mask, other=0).to(tl.float32)
                if ASM:
                    zero = zero + (1024.0 if x_ptr.dtype.element_ty == tl.float16 else 128.0)
                elif MANT:
                    d = d * (1 << BITS)
                    zero = zero + (1 << BITS)
                if SWAP:
                    d = d - xsd * zero[:, None]
                else:
                    d = d - xsd * zero[None, :]
            elif XSD:  # d - (OFF + CODE_OFFSET) x sum, OFF as below
                if ASM:
                    d = d - (CODE_OFFSET + (1024.0 if x_ptr.dtype.element_ty == tl.float16 else 128.0)) * xsd
                elif MANT:
                    d = d * (1 << BITS) - (CODE_OFFSET + (1 << BITS)) * xsd
                else:
                    d = d - CODE_OFFSET * xsd
            elif XS:
                if HAS_ZERO:
                    zero = tl.load(z_ptr + g * N + offs_n, mask=nb_mask, other=0).to(tl.float32)
                else:
                    zero = tl.zeros((BLOCK_N,), dtype=tl.float32) + CODE_OFFSET
                if ASM:
                    zero = zero + (1024.0 if x_ptr.dtype.element_ty == tl.float16 else 128.0)
                elif MANT:
                    d = d * (1 << BITS)
                    zero = zero + (1 << BITS)
                if SWAP:
                    d = d - zero[:, None] * xs[None, :]
                else:
                    d = d - xs[:, None] * zero[None, :]
            if MASK_B:
                d = d * okf
            if PER_CHANNEL or PROBE & 1:
                acc += d
            else:
                if PRE_S:
                    s = decode_scale(s_pre, SCALE_KIND)
                elif PRE_G or SCALE_WORDS:
                    s = decode_scale((s_pre >> (8 * (((i + 1 - FPG) * R) // GROUP_SIZE))) & 0xFF, SCALE_KIND)
                else:
                    s = decode_scale(tl.load(s_ptr + g * N + offs_n, mask=nb_mask, other=0), SCALE_KIND)
                if SWAP:
                    acc += d * s[:, None]
                else:
                    acc += d * s[None, :]
    return acc


@triton.jit(do_not_specialize=["M", "split_k"])
def _mv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_ym, split_k,
               BITS: tl.constexpr, EPW: tl.constexpr, IS_INT: tl.constexpr, EXP_BITS: tl.constexpr,
               MAN_BITS: tl.constexpr, CODE_OFFSET: tl.constexpr, HAS_ZERO: tl.constexpr,
               SCALE_KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, PER_CHANNEL: tl.constexpr,
               HAS_GSCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
               NUM_STAGES: tl.constexpr, SWAP: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
               ASM: tl.constexpr, KB: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr, R: tl.constexpr,
               RED_STEP: tl.constexpr, FOLD: tl.constexpr = False,
               IMAD: tl.constexpr = 0, PROBE: tl.constexpr = 0, GROW: tl.constexpr = 0,
               PRE_G: tl.constexpr = False, SCALE_WORDS: tl.constexpr = False,
               MUL16: tl.constexpr = False, BIASED: tl.constexpr = False,
               XSUM: tl.constexpr = False, PAIRW: tl.constexpr = 0, ADJ: tl.constexpr = False,
               STREAMK: tl.constexpr = False):
    # programmatic dependent launch, PDL 1: the next kernel may be launched (and run its prologue up to its
    # gdc_wait) as soon as every program of this one has started; PDL 2: once every program is past its K loop
    # (only the epilogue left), so the next kernel's programs do not take SM slots from this one's main loop
    if PDL == 1:
        gdc_launch_dependents()
    if STREAMK:
        # stream-K (ComputeConfig.streamk, a persistent grid): program p takes K blocks [p per, (p + 1) per) of
        # the N tiles' blocks laid end to end (per = split_k), crossing tile boundaries; a tile cut among several
        # programs is summed by _finish's ticketed split sum (its parts in program order), a whole one stores y
        p = tl.program_id(0)
        pid_m = tl.program_id(1)
        n_blocks = tl.cdiv(K, R * EPW)
        n_tiles = tl.cdiv(N, BLOCK_N)
        s0 = p * split_k
        s1 = tl.minimum(s0 + split_k, n_tiles * n_blocks)
        for t in range(s0 // n_blocks, (s1 - 1) // n_blocks + 1):
            first = (t * n_blocks) // split_k
            # pid_m + an opaque zero (t < 2^30): the row offsets are rebuilt per tile instead of hoisted out of this
            # loop and held through every K loop (offline sm_90: MXFP4 16x128 w4 153 -> 125 registers, int4 -4)
            _mv_tile(x_ptr, qw_ptr, s_ptr, z_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_ym, t,
                     pid_m + (t >> 30), tl.maximum(s0 - t * n_blocks, 0), tl.minimum(s1 - t * n_blocks, n_blocks),
                     p - first, ((t + 1) * n_blocks - 1) // split_k - first + 1,
                     BITS, EPW, IS_INT, EXP_BITS, MAN_BITS, CODE_OFFSET, HAS_ZERO, SCALE_KIND,
                     GROUP_SIZE, PER_CHANNEL, HAS_GSCALE, BLOCK_M, BLOCK_N, SPLIT, NUM_STAGES,
                     SWAP, EVEN_K, DOT_F32, ASM, KB, PDL, PF, R, RED_STEP, FOLD, IMAD, PROBE, GROW,
                     PRE_G, SCALE_WORDS, MUL16, BIASED, XSUM, PAIRW, ADJ, STREAMK)
    else:  # the split-K grid: (N tile, M tile, K split); _mv_tile takes this split's blocks
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        _mv_tile(x_ptr, qw_ptr, s_ptr, z_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_ym,
                 pid_n, pid_m, 0, 0, pid_k, split_k,
                 BITS, EPW, IS_INT, EXP_BITS, MAN_BITS, CODE_OFFSET, HAS_ZERO, SCALE_KIND, GROUP_SIZE,
                 PER_CHANNEL, HAS_GSCALE, BLOCK_M, BLOCK_N, SPLIT, NUM_STAGES, SWAP, EVEN_K, DOT_F32,
                 ASM, KB, PDL, PF, R, RED_STEP, FOLD, IMAD, PROBE, GROW, PRE_G, SCALE_WORDS, MUL16,
                 BIASED, XSUM, PAIRW, ADJ, STREAMK)


@triton.jit
def _mv_tile(x_ptr, qw_ptr, s_ptr, z_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_ym, pid_n,
             pid_m, b0, b1, part, parts,
             BITS: tl.constexpr, EPW: tl.constexpr, IS_INT: tl.constexpr, EXP_BITS: tl.constexpr,
             MAN_BITS: tl.constexpr, CODE_OFFSET: tl.constexpr, HAS_ZERO: tl.constexpr,
             SCALE_KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, PER_CHANNEL: tl.constexpr,
             HAS_GSCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
             NUM_STAGES: tl.constexpr, SWAP: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
             ASM: tl.constexpr, KB: tl.constexpr, PDL: tl.constexpr, PF: tl.constexpr, R: tl.constexpr,
             RED_STEP: tl.constexpr, FOLD: tl.constexpr = False,
             IMAD: tl.constexpr = 0, PROBE: tl.constexpr = 0, GROW: tl.constexpr = 0,
             PRE_G: tl.constexpr = False, SCALE_WORDS: tl.constexpr = False,
             MUL16: tl.constexpr = False, BIASED: tl.constexpr = False,
             XSUM: tl.constexpr = False, PAIRW: tl.constexpr = 0, ADJ: tl.constexpr = False,
             STREAMK: tl.constexpr = False):
    """One output tile's K blocks of _mv_kernel: y, or the tile's partial `part` of `parts` (SPLIT). Stream-K:
    blocks [b0, b1), a segment of the program's range; else split `part` of `parts` (b0, b1 computed here)."""
    PB: tl.constexpr = R * EPW
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if GROW:  # tile row r: x row r // GROW, scale group r % GROW of each block
        rows = tl.arange(0, BLOCK_M)
        offs_m = pid_m * (BLOCK_M // GROW) + rows // GROW
        row_g = rows % GROW
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_g = offs_m
    n_mask = offs_n < N
    m_mask = offs_m < M
    offs_r = tl.arange(0, R)
    n_blocks = tl.cdiv(K, PB)
    if not STREAMK:
        per_split = tl.cdiv(tl.cdiv(n_blocks, parts), KB) * KB
        b0 = part * per_split
        b1 = tl.minimum(b0 + per_split, n_blocks)
    if PF > 0:  # the first PF blocks into the L2 (weights are constant: before waiting on the previous kernel)
        for j in tl.static_range(PF):
            _l2_prefetch(qw_ptr, tl.minimum(b0 + j, b1 - 1), pid_n * BLOCK_N, N, BLOCK_N, R)
    if PDL:  # x (and the split-K workspace) may still be in use by the previous kernel until here
        gdc_wait()
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    q_ptrs = qw_ptr + offs_r[:, None] * N + offs_n[None, :]
    if ADJ:  # the adjacent-pair storage (pair-order words): a block's tile is [R / 2, 2 BN] in memory
        offs_c = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        q_ptrs = qw_ptr + tl.arange(0, R // 2)[:, None] * (2 * N) + offs_c[None, :]
        c_mask = offs_c < 2 * N
    if NUM_STAGES == 1:
        # manual prefetch instead of Triton's cp.async pipeline (one step in flight, several CTA barriers per step):
        # the words (and scale row) of blocks b+1 and b+2 are loaded into registers before block b is computed, so
        # two blocks per program stay in flight
        PRE_S: tl.constexpr = not PER_CHANNEL and GROUP_SIZE >= PB
        m1 = n_mask & ((offs_n * 0 + b0) < b1)
        m2 = n_mask & ((offs_n * 0 + b0 + 1) < b1)
        if ADJ:  # (the adjacent-pair storage of pair-order words)
            q_n1 = _adj_tile(tl.load(q_ptrs + b0 * R * N, mask=(c_mask & ((offs_c * 0 + b0) < b1))[None, :],
                                     other=0), R, BLOCK_N)
            q_n2 = _adj_tile(tl.load(q_ptrs + (b0 + 1) * R * N,
                                     mask=(c_mask & ((offs_c * 0 + b0 + 1) < b1))[None, :], other=0), R, BLOCK_N)
        else:
            q_n1 = tl.load(q_ptrs + b0 * R * N, mask=m1[None, :], other=0)
            q_n2 = tl.load(q_ptrs + (b0 + 1) * R * N, mask=m2[None, :], other=0)
        if PRE_S:
            s_n1 = tl.load(s_ptr + (b0 * PB // GROUP_SIZE) * N + offs_n, mask=m1, other=0)
            s_n2 = tl.load(s_ptr + ((b0 + 1) * PB // GROUP_SIZE) * N + offs_n, mask=m2, other=0)
        else:
            s_n1 = q_n1
            s_n2 = q_n2
        for b in tl.range(b0, b1, num_stages=1):
            q = q_n1
            s_cur = s_n1
            q_n1 = q_n2
            s_n1 = s_n2
            m2 = n_mask & ((offs_n * 0 + b + 2) < b1)
            if ADJ:
                q_n2 = _adj_tile(tl.load(q_ptrs + (b + 2) * R * N,
                                         mask=(c_mask & ((offs_c * 0 + b + 2) < b1))[None, :], other=0), R, BLOCK_N)
            else:
                q_n2 = tl.load(q_ptrs + (b + 2) * R * N, mask=m2[None, :], other=0)
            if PRE_S:
                s_n2 = tl.load(s_ptr + ((b + 2) * PB // GROUP_SIZE) * N + offs_n, mask=m2, other=0)
            else:
                s_n2 = q_n2
            acc = _mv_block(acc, q, s_cur, b, b1, n_blocks, x_ptr, s_ptr, z_ptr, offs_m, offs_n, m_mask, n_mask, K,
                            N, stride_xm, BITS, EPW, IS_INT, EXP_BITS, MAN_BITS, CODE_OFFSET, HAS_ZERO, SCALE_KIND,
                            GROUP_SIZE, PER_CHANNEL, BLOCK_N, SWAP, EVEN_K, DOT_F32, ASM, False, PRE_S, R, FOLD,
                            IMAD, PROBE, GROW, row_g, SCALE_WORDS=SCALE_WORDS, MUL16=MUL16, BIASED=BIASED, XSUM=XSUM,
                            PAIRW=PAIRW)
    else:
        if PRE_G:  # (KB = 1, e8m0, 4 groups per block: SCALE_PREFETCH) block b0's scale codes
            s_nx = _scale_word(s_ptr, b0, N, offs_n, n_mask & ((offs_n * 0 + b0) < b1))
        for b_step in tl.range(b0, b1, KB, num_stages=NUM_STAGES):
            if PF > 0:  # keep PF blocks ahead of the cp.async pipeline in flight to the L2
                for kb in tl.static_range(KB):
                    _l2_prefetch(qw_ptr, tl.minimum(b_step + PF + kb, b1 - 1), pid_n * BLOCK_N, N, BLOCK_N, R)
            for kb in tl.static_range(KB):  # KB word tiles per step: more bytes in flight per program
                b = b_step + kb
                nb_mask = n_mask & ((offs_n * 0 + b) < b1)
                if ADJ:
                    q = _adj_tile(tl.load(q_ptrs + b * R * N, mask=(c_mask & ((offs_c * 0 + b) < b1))[None, :],
                                          other=0), R, BLOCK_N)
                else:
                    q = tl.load(q_ptrs + b * R * N, mask=nb_mask[None, :], other=0)
                if PRE_G:  # this block's codes; the next block's in flight while this one is computed
                    s_cur = s_nx
                    s_nx = _scale_word(s_ptr, b + 1, N, offs_n, n_mask & ((offs_n * 0 + b + 1) < b1))
                else:
                    s_cur = q
                acc = _mv_block(acc, q, s_cur, b, b1, n_blocks, x_ptr, s_ptr, z_ptr, offs_m, offs_n, m_mask,
                                nb_mask, K, N, stride_xm, BITS, EPW, IS_INT, EXP_BITS, MAN_BITS, CODE_OFFSET,
                                HAS_ZERO, SCALE_KIND, GROUP_SIZE, PER_CHANNEL, BLOCK_N, SWAP, EVEN_K, DOT_F32, ASM,
                                KB > 1, False, R, FOLD, IMAD, PROBE, GROW, row_g, PRE_G,
                                SCALE_WORDS=SCALE_WORDS, MUL16=MUL16, BIASED=BIASED, XSUM=XSUM,
                                PAIRW=PAIRW)
    if PDL == 2:
        gdc_launch_dependents()
    if SWAP:
        acc = tl.trans(acc)
    if FOLD:
        acc = acc * (2.0 ** FOLD_EXP)
    if GROW:  # the GROW group rows of each x row -> one row
        acc = tl.sum(tl.reshape(acc, (BLOCK_M // GROW, GROW, BLOCK_N)), axis=1)
        offs_m = pid_m * (BLOCK_M // GROW) + tl.arange(0, BLOCK_M // GROW)
        m_mask = offs_m < M
    if PER_CHANNEL:
        acc = acc * decode_scale(tl.load(s_ptr + offs_n, mask=n_mask, other=0), SCALE_KIND)[None, :]
    if HAS_GSCALE:
        acc = acc * tl.load(gs_ptr)
    # the tile's counter (computed here, not carried through the K loop: a register less there)
    tile = pid_m * (tl.cdiv(N, BLOCK_N) if STREAMK else tl.num_programs(0)) + pid_n
    _finish(acc, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, M, N, stride_ym, tile, part, parts, SPLIT,
            RED_STEP, STREAMK)


@triton.jit(do_not_specialize=["M", "split_k"])
def _gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, gs_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_ym, split_k,
                 BITS: tl.constexpr, EPW: tl.constexpr, IS_INT: tl.constexpr, EXP_BITS: tl.constexpr,
                 MAN_BITS: tl.constexpr, CODE_OFFSET: tl.constexpr, HAS_ZERO: tl.constexpr,
                 SCALE_KIND: tl.constexpr, GROUP_SIZE: tl.constexpr, PER_CHANNEL: tl.constexpr,
                 HAS_GSCALE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                 NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, KB: tl.constexpr, PDL: tl.constexpr,
                 R: tl.constexpr):
    """CUDA cores, one row of x per program: each bit field of the [R, BN] word tile is a [R, BN] tile of
    contiguous k decoded into fp32 1 + c/2^B (ints) or value * 2^(bias-127) (minifloats) and FMA'd with x; the
    group scale (and zero, through the x sum) is applied once per field group after an in-thread reduction."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    PB: tl.constexpr = R * EPW
    PPG: tl.constexpr = EPW if PER_CHANNEL else (EPW if GROUP_SIZE // R >= EPW else GROUP_SIZE // R)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, R)
    n_blocks = tl.cdiv(K, PB)
    per_split = tl.cdiv(tl.cdiv(n_blocks, split_k), KB) * KB
    b0 = pid_k * per_split
    b1 = tl.minimum(b0 + per_split, n_blocks)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    x_row = x_ptr + pid_m * stride_xm
    for b_step in tl.range(b0, b1, KB, num_stages=NUM_STAGES):
        for kb in tl.static_range(KB):  # KB word tiles per step: more bytes in flight per program
            b = b_step + kb
            nb_mask = n_mask & ((offs_n * 0 + b) < b1)
            bc = tl.minimum(b, n_blocks - 1)  # a step past the split's end reads an in-range x block, weight 0
            okf = (b < b1).to(tl.float32)
            q = tl.load(qw_ptr + (b * R + offs_r)[:, None] * N + offs_n[None, :], mask=nb_mask[None, :], other=0)
            for i in tl.static_range(EPW):
                kx = bc * PB + i * R + offs_r
                if EVEN_K:
                    xi = tl.load(x_row + kx).to(tl.float32)
                else:
                    xi = tl.load(x_row + kx, mask=kx < K, other=0.0).to(tl.float32)
                if IS_INT:
                    v = int_plane(q, i, BITS)
                else:
                    v = fp_plane(q, i, BITS, EXP_BITS, MAN_BITS)
                if i % PPG == 0:
                    part = v * xi[:, None]
                    if IS_INT:
                        xs = tl.sum(xi, axis=0)
                else:
                    part += v * xi[:, None]
                    if IS_INT:
                        xs += tl.sum(xi, axis=0)
                if (i + 1) % PPG == 0:
                    t = tl.sum(part, axis=0)
                    if IS_INT:
                        g = (b * PB + (i + 1 - PPG) * R) // GROUP_SIZE
                        if HAS_ZERO:
                            zero = tl.load(z_ptr + g * N + offs_n, mask=nb_mask, other=0).to(tl.float32)
                        else:
                            zero = CODE_OFFSET * 1.0
                        t = t * (1 << BITS) - ((1 << BITS) + zero) * xs  # v = 1 + c/2^B
                    if KB > 1:
                        t = t * okf
                    if PER_CHANNEL:
                        acc += t
                    else:
                        g = (b * PB + (i + 1 - PPG) * R) // GROUP_SIZE
                        acc += t * decode_scale(tl.load(s_ptr + g * N + offs_n, mask=nb_mask, other=0), SCALE_KIND)
    if PER_CHANNEL:
        acc = acc * decode_scale(tl.load(s_ptr + offs_n, mask=n_mask, other=0), SCALE_KIND)
    if HAS_GSCALE:
        acc = acc * tl.load(gs_ptr)
    offs_m = pid_m + tl.arange(0, 1)
    _finish(acc[None, :], y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, offs_m < M, n_mask, M, N, stride_ym,
            pid_m * tl.num_programs(0) + pid_n, pid_k, split_k, SPLIT)


_ASM = True  # inline-PTX nibble decode on the GPU (the interpreter takes the plain Triton path)
# programmatic dependent launch (sm_90+) for the decode kernels: the launch and prologue (and the stream kernel's
# first weight block) overlap the previous kernel. Off by default: on the H200 (2026-12-03, bench/results/
# gemm_wna16_smallm.md) the default mv config took 12.7 us with it vs 9.35 us without at 4096x4096, M = 1.
# KESTREL_PDL=1 turns it on; KESTREL_PDL=late (mv / mvs) lets the next kernel launch only once every program is
# past its K loop (PDL_LATE). Session 3 (same process, int4 defaults, 3 shapes, M = 1 / 16): early 3.3-13 us and
# late 1-9 us slower than off on every point.
PDL = os.environ.get("KESTREL_PDL", "0") in ("1", "late")
PDL_LATE = os.environ.get("KESTREL_PDL", "0") == "late"


def set_pdl(mode: str) -> None:
    """Switch programmatic dependent launch at run time, as KESTREL_PDL does: "0", "1" or "late"."""
    global PDL, PDL_LATE
    if mode not in ("0", "1", "late"):
        raise ValueError(f"PDL mode must be 0, 1 or late, got {mode!r}")
    PDL, PDL_LATE = mode != "0", mode == "late"


@functools.lru_cache(maxsize=None)
def _sm90(index) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    return device.type == "cuda" and PDL and _sm90(device.index)


# split-K partials summed per loop step by the last program of a tile (mv / mvs; _finish): 1 is the loop of before,
# kept for A/B timing (bench/wna16_decode_sweep.py --red-steps)
RED_STEP = 2

_WS: dict = {}
_CNT_SLOTS = 1 << 16


def _workspace(device: torch.device, floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partials (fp32) and per-tile counters (`tiles` of them in use) for this device and stream. The
    counters are zeroed once and every launch leaves them zero; the partials need no zeroing. Per stream, so
    concurrent streams never share counters."""
    if tiles > _CNT_SLOTS:
        raise ValueError(f"split-K over {tiles} tiles exceeds {_CNT_SLOTS} counters")
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    ws, cnt = _WS.get(key, (None, None))
    if cnt is None:
        cnt = torch.zeros(_CNT_SLOTS, dtype=torch.int32, device=device)
    if ws is None or ws.numel() < floats:
        ws = torch.empty(max(floats, 1 << 20), dtype=torch.float32, device=device)
    _WS[key] = (ws, cnt)
    return ws, cnt


def fold_e8m0(fmt: dict, dtype: torch.dtype) -> bool:
    """mv / mvs fold the group scales into the decoded weights (FOLD_EXP): e2m1 weights, e8m0 group scales and
    bf16 activations (fp16's range cannot hold the folded weights)."""
    return (FOLD_E8M0 and dtype == torch.bfloat16 and not fmt["IS_INT"] and fmt["SCALE_KIND"] == 1
            and not fmt["PER_CHANNEL"] and fmt["EXP_BITS"] == 2 and fmt["MAN_BITS"] == 1
            and fmt["GROUP_SIZE"] % fmt["R"] == 0)


def group_rows(fmt: dict, cfg, m: int) -> int:
    """Scale groups per pass put on the mv tile's rows (GROW of GROUP_ROWS), or 0: minifloat weights with >= 2
    power-of-2 groups per block, plain mv (no FOLD); all groups of a block where every x row's groups fit the
    tile, else (GROUP_ROWS_PARTIAL) the most that fit, >= 2."""
    pb = fmt["R"] * fmt["EPW"]
    g = pb // fmt["GROUP_SIZE"] if not fmt["PER_CHANNEL"] and fmt["GROUP_SIZE"] % fmt["R"] == 0 else 0
    if not (GROUP_ROWS and cfg.kernel == "mv" and not fmt["IS_INT"] and g >= 2 and pb % fmt["GROUP_SIZE"] == 0
            and g & (g - 1) == 0):
        return 0
    d = g
    while d >= 2 and (m * d > cfg.block_m or cfg.block_m % d):
        d //= 2
    return d if d == g or (GROUP_ROWS_PARTIAL and d >= 2) else 0


def prefetch_scales(fmt: dict, cfg, kb: int, grow: int = 0) -> bool:
    """mv loads the next block's 4 e8m0 scale rows during this block (SCALE_PREFETCH; GPU-timed on mv only, the
    kernel supports mvs too): e8m0 scales, 4 groups
    per planar block, the cp.async pipeline (num_stages > 1) with one block per step, not all 4 groups on the rows
    (grow = group_rows(...) < 4)."""
    return (SCALE_PREFETCH and cfg.kernel == "mv" and fmt["SCALE_KIND"] == 1 and not fmt["PER_CHANNEL"]
            and fmt["GROUP_SIZE"] * 4 == fmt["R"] * fmt["EPW"] and kb == 1 and cfg.num_stages > 1 and grow < 4)


def e8m0_words(qw) -> torch.Tensor:
    """int32 [G / 4, N]: byte j of word (b, n) = e8m0 code of group 4b + j, column n (SCALE_WORDS). Built once
    per weight and kept on it (the first call should be outside CUDA-graph capture, as the engine's warm-up is)."""
    w = getattr(qw, "_e8m0_words", None)
    if w is None or w.device != qw.scales.device:
        g, n = qw.scales.shape
        w = qw.scales.view(g // 4, 4, n).transpose(1, 2).contiguous().view(torch.int32).view(g // 4, n)
        qw._e8m0_words = w
    return w


def fold_words(qw) -> torch.Tensor:
    """int32 [G / 4, N] as e8m0_words, byte j = clamp(e + 126 - FOLD_EXP, 1, 254) for the e8m0 code e of group
    4b + j: the bf16 exponent field of FOLD's multiplier 2^(e - 1 - FOLD_EXP) (FOLD_BIAS_WORDS). Built once per
    weight and kept on it."""
    w = getattr(qw, "_fold_words", None)
    if w is None or w.device != qw.scales.device:
        b = (qw.scales.to(torch.int16) + (126 - FOLD_EXP.value)).clamp(1, 254).to(torch.uint8)
        g, n = b.shape
        w = b.view(g // 4, 4, n).transpose(1, 2).contiguous().view(torch.int32).view(g // 4, n)
        qw._fold_words = w
    return w


def scale_words(fmt: dict, fold: bool, grow: int = 0) -> bool:
    """The kernel reads e8m0_words: e8m0 scales, 4 groups per planar block, with FOLD (SCALE_WORDS) or on the
    GROUP_ROWS passes (grow > 0, SCALE_WORDS_GROW)."""
    return ((SCALE_WORDS and fold or SCALE_WORDS_GROW and grow > 0) and fmt["SCALE_KIND"] == 1
            and not fmt["PER_CHANNEL"] and fmt["GROUP_SIZE"] * 4 == fmt["R"] * fmt["EPW"])


def pair_multipliers(cfg) -> bool:
    """FOLD's e2m1 PTX takes each element's own 16-bit multiplier (MUL16): always with num_stages 1, whose
    fields Triton decodes in the word load's blocked layout (a pair = two columns)."""
    return MUL16 or cfg.num_stages == 1


def pair_words_mode(qw, fmt: dict, cfg, asm: bool, dtype: torch.dtype) -> int:
    """PAIRW of mv / mvs for this weight: 0 planar words; pair-order words (QuantizedWeight.pair_words): 2 = the
    pair-order PTX decode where a pack=2 pair is two k of one column (the MMA operand layout Triton decodes in at
    num_stages 2 / 3; offline sm_90a TTGIR, bench/wna16_mv_sass.py --ab) for int4 and bf16 e2m1, else 1 = the
    words back to planar in the kernel (interpreter, num_stages 1, fp16 e2m1)."""
    if not getattr(qw, "pair_words", False):
        return 0
    return 2 if asm and cfg.num_stages > 1 and (fmt["IS_INT"] or dtype == torch.bfloat16) else 1


def num_sms(device: torch.device) -> int:
    """SMs of the GPU (the stream-K grid is sized by them); 4 on the CPU (the interpreter: a few programs, so the
    tests' small shapes cut tiles among programs and give programs several tiles)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@functools.lru_cache(maxsize=1024)
def streamk_plan(tiles: int, blocks: int, programs: int, kb: int = 1) -> tuple[int, int, int]:
    """Stream-K over `tiles` N tiles of `blocks` K blocks each on at most `programs` programs -> (per: blocks per
    program, a multiple of kb; parts: the most programs sharing one tile; programs, each with >= 1 block)."""
    total = tiles * blocks
    per = -(-total // max(1, min(programs, total)))
    per = -(-per // kb) * kb
    # a tile's blocks [t B, (t + 1) B) meet at most ceil((B - 1) / per) + 1 programs' ranges
    return per, -(-(blocks - 1) // per) + 1, -(-total // per)


def gemm_small(x2: torch.Tensor, qw, cfg, fmt: dict) -> torch.Tensor:
    """x2 [M, K] contiguous (act-order already applied) -> y [M, N] in x2's dtype, kernel cfg.kernel in
    ("gemv", "mv", "mvs": mv with W as the MMA A operand). `fmt` is gemm_wna16's format constexpr dict."""
    m, k = x2.shape
    n = qw.shape[0]
    split = cfg.split_k
    y = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    z = qw.zeros if qw.zeros is not None else qw.scales
    gsc = qw.global_scale if qw.global_scale is not None else qw.scales
    even_k = k % (fmt["R"] * fmt["EPW"]) == 0
    on_gpu = x2.device.type == "cuda"
    kb = max(1, cfg.block_k // (fmt["R"] * fmt["EPW"]))  # planar blocks per K step (block_k = K elements)
    is_e2m1 = not fmt["IS_INT"] and fmt["EXP_BITS"] == 2 and fmt["MAN_BITS"] == 1
    if getattr(qw, "pair_words", False) and cfg.kernel == "gemv":
        raise ValueError("pair-order words (QuantizedWeight.pair_words) are read by the mv / mvs kernels only")
    if cfg.kernel == "gemv":
        grid = (triton.cdiv(n, cfg.block_n), m, split)
    else:
        # FOLD (all of a block's groups in one MMA chain, no per-group accumulator work) before GROUP_ROWS; with
        # the manual register prefetch of num_stages 1 only with FOLD_S1 (and MUL16 there): the int32 multiplier
        # form gave rel err 0.2-0.25 on the H200 at s1 (session 10 lead check; cause: see MUL16)
        fold = fold_e8m0(fmt, x2.dtype) and (cfg.num_stages > 1 or FOLD_S1)
        grow = group_rows(fmt, cfg, m) if cfg.kernel == "mv" and not fold else 0
        grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m // max(grow, 1)), split)
    streamk = cfg.kernel != "gemv" and cfg.streamk > 0
    if streamk:  # a persistent grid: split = K blocks per program, parts = the most programs on one tile
        blocks = -(-k // (fmt["R"] * fmt["EPW"]))
        split, parts, programs = streamk_plan(grid[0], blocks, cfg.streamk * num_sms(x2.device), kb)
        ws, cnt = _workspace(x2.device, parts * m * n, grid[0] * grid[1])
        grid = (programs, grid[1], 1)
    elif split > 1:
        ws, cnt = _workspace(x2.device, split * m * n, grid[0] * grid[1])
    else:
        ws, cnt = y, y  # unused
    pdl = use_pdl(x2.device)
    common = dict(SPLIT=split > 1 or streamk, NUM_STAGES=cfg.num_stages, EVEN_K=even_k, BLOCK_N=cfg.block_n,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, PDL=pdl, launch_pdl=pdl, **fmt)
    if cfg.kernel == "gemv":
        _gemv_kernel[grid](x2, qw.qweight, qw.scales, z, gsc, y, ws, cnt, m, n, k, x2.stride(0), y.stride(0),
                           split, KB=kb, **common)
    else:
        common["PDL"] = (2 if PDL_LATE else 1) if pdl else 0
        fold = fold and not grow
        sw = scale_words(fmt, fold, grow)
        mul16 = fold and pair_multipliers(cfg)
        biased = sw and fold and FOLD_BIAS_WORDS
        words = (fold_words(qw) if biased else e8m0_words(qw)) if sw else qw.scales
        asm = on_gpu and _ASM and fmt["BITS"] == 4 and (fmt["IS_INT"] or is_e2m1)
        pairw = pair_words_mode(qw, fmt, cfg, asm, x2.dtype)
        _mv_kernel[grid](x2, qw.qweight, words, z, gsc, y, ws, cnt, m, n, k, x2.stride(0), y.stride(0),
                         split, BLOCK_M=cfg.block_m, SWAP=cfg.kernel == "mvs", DOT_F32=not on_gpu, KB=kb,
                         PF=cfg.prefetch if on_gpu else 0,
                         ASM=asm, PAIRW=pairw, ADJ=pairw > 0 and qw.pair_adjacent,
                         RED_STEP=RED_STEP, FOLD=fold, GROW=grow, SCALE_WORDS=sw, BIASED=biased,
                         XSUM=INT_XSUM and fmt["IS_INT"],
                         PRE_G=prefetch_scales(fmt, cfg, kb, grow) and not fold and not sw,
                         IMAD=E2M1_IMAD if is_e2m1 and fold else 0, MUL16=mul16,
                         PROBE=PROBE if is_e2m1 and on_gpu and x2.dtype == torch.bfloat16 else 0, STREAMK=streamk,
                         **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and on_gpu else {}), **common)
    return y
