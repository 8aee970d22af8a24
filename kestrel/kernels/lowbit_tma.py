"""Large-M dense W8A8 (fp8 or int8, per-token x per-channel scales): TMA tile loads, optionally persistent CTAs.

Why a second kernel: at M >= 128 the pointer-based kernel in lowbit_gemm spends issue slots on address arithmetic
and cp.async, and lands well short of cuBLASLt's fp8 rate. TMA moves whole [rows, BK] boxes with one instruction
(out-of-range rows / columns read as zero and are clipped on store, so no masks), which is what Hopper GEMMs need to
keep the wgmma pipe fed. Both operands are K-major boxes (W is stored [N, K]), as fp8 / int8 wgmma requires.
Persistent mode: one CTA per SM walks tiles in the grouped (L2-friendly) order. fp8 partial products accumulate in
the wgmma accumulator over all of K (cuBLASLt's "fast accumulation"; the pointer kernel promotes every K tile).

W4A8 int4 (per-channel or group scales >= 128) can run here too (GemmConfig.TMA with gemm_w4a8): the packed weight
is first expanded to fp8 (exact: int4 values are e4m3 values) in one streaming pass, then this kernel scales each K
tile's partial product by its group scale. Measured on the H200 it is no faster than the fused kernel (group scaling
per K tile serialises the wgmma chain: 1164 vs 1124 us at 4096x8192x8192), so it is not the default.
"""
import torch
import triton
import triton.language as tl

from kestrel.kernels.configs import nonempty_split
from kestrel.kernels.gemm_wna16_tc import _epilogue, _split_counters
from kestrel.kernels.lowbit import round_bf16
from kestrel.kernels.lowbit_gemm import fp4_fold_e4m3, int4_to_e4m3


@triton.jit
def _prefetch_l2(ptrs):
    """prefetch.global.L2 of each pointer (side effect only; the result is a dummy)."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


_SEM = tl.constexpr("relaxed")  # (_epilogue's atomic order argument: unused by its in-kernel reduction)


@triton.jit
def _w8a8_tma_kernel(a_desc, w_desc, c_desc, as_ptr, ws_ptr, w_ptr, M, N, K, num_progs, stride_wsn, stride_w,
                     INT8: tl.constexpr, WG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     GROUP_M: tl.constexpr, OUT_DT: tl.constexpr, PDL_LINES: tl.constexpr, SPLIT: tl.constexpr = 1,
                     part_ptr=None, cnt_ptr=None, c_ptr=None, stride_cm=0):
    """SPLIT > 1 (launch_tma's split_k, non-persistent grid (tiles, SPLIT)): program (tile, p) runs K part p and
    the tile's last part to finish sums the fp32 partials (part_ptr slabs, cnt_ptr tickets: gemm_wna16_tc's
    in-kernel reduction) into c_ptr - one launch, no zeroed fp32 output, no cast (small-M grids under one wave)."""
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BK)
    if PDL_LINES > 0:
        # launched as a programmatic dependent of the activation quant: while it runs, pull the first PDL_LINES
        # 128-byte lines of each weight row of this CTA's first tile into the L2 (the weights do not depend on
        # it), then wait for the quant grid (its a / a_scale) before any load of them
        t0 = tl.program_id(0)
        pm, pn = tl.swizzle2d(t0 // num_pid_n, t0 % num_pid_n, num_pid_m, num_pid_n, GROUP_M)
        prow = pn * BN + tl.arange(0, BN)
        pcol = tl.arange(0, PDL_LINES) * 128
        pp = w_ptr + prow[:, None].to(tl.int64) * stride_w + pcol[None, :]
        _prefetch_l2(tl.where((prow < N)[:, None] & (pcol < K)[None, :], pp, w_ptr))
        tl.extra.cuda.gdc_wait()
    for tile in range(tl.program_id(0), num_tiles, num_progs):
        pid_m, pid_n = tl.swizzle2d(tile // num_pid_n, tile % num_pid_n, num_pid_m, num_pid_n, GROUP_M)
        om = pid_m * BM
        on = pid_n * BN
        rm = om + tl.arange(0, BM)
        rn = on + tl.arange(0, BN)
        if INT8:
            acc = tl.zeros((BM, BN), tl.int32)
        else:
            acc = tl.zeros((BM, BN), tl.float32)
        k_lo = 0
        k_hi = k_tiles
        if SPLIT > 1:  # this program's K part
            per = tl.cdiv(k_tiles, SPLIT)
            k_lo = tl.program_id(1) * per
            k_hi = tl.minimum(k_lo + per, k_tiles)
        for ki in range(k_lo, k_hi):
            a = a_desc.load([om, ki * BK])
            w = w_desc.load([on, ki * BK])
            if WG > 0:  # weight group scales along K (W4A8 int4 g128): scale each K tile's partial product
                ws = tl.load(ws_ptr + rn * stride_wsn + (ki * BK) // WG, mask=rn < N, other=0.0)
                acc += tl.dot(a, w.T) * ws[None, :]
            elif INT8:
                acc = tl.dot(a, w.T, acc, out_dtype=tl.int32)
            else:
                acc = tl.dot(a, w.T, acc)
        out = acc.to(tl.float32) * tl.load(as_ptr + rm, mask=rm < M, other=0.0)[:, None]
        if WG == 0:
            out = out * tl.load(ws_ptr + rn, mask=rn < N, other=0.0)[None, :]
        if SPLIT > 1:  # (the scales are linear: each part is scaled before the sum)
            _epilogue(out, c_ptr, as_ptr, as_ptr, rm, rn, rn, M, N, stride_cm, True, 0, False, False, 0, True, 1,
                      part_ptr, cnt_ptr, tile, num_tiles, tl.program_id(1), _SEM, SPLIT)
        elif OUT_DT == 0:
            c_desc.store([om, on], round_bf16(out).to(tl.bfloat16))
        elif OUT_DT == 1:
            c_desc.store([om, on], out.to(tl.float16))
        else:
            c_desc.store([om, on], out)


@triton.jit
def _int4_to_fp8_kernel(src, dst, n_bytes, BLOCK: tl.constexpr, HALVES: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    p = tl.load(src + offs, mask=offs < n_bytes, other=0)
    lo = int4_to_e4m3(p & 0xF).to(tl.uint8, bitcast=True)
    hi = int4_to_e4m3(p >> 4).to(tl.uint8, bitcast=True)
    if HALVES:  # byte j of each 64-byte block -> k = j and k = j + 64 of its 128-wide K block
        o = (offs // 64) * 128 + offs % 64
        tl.store(dst + o, lo, mask=offs < n_bytes)
        tl.store(dst + o + 64, hi, mask=offs < n_bytes)
    else:
        o = tl.program_id(0) * 2 * BLOCK + tl.arange(0, 2 * BLOCK)
        tl.store(dst + o, tl.reshape(tl.join(lo, hi), (2 * BLOCK,)), mask=o < 2 * n_bytes)


def int4_to_fp8(packed: torch.Tensor, halves: bool = False) -> torch.Tensor:
    """packed int4 [N, K // 2] ("pairs": low nibble = even k; or gemm_w4a8's "halves") -> float8_e4m3fn [N, K]
    holding the same integers (exact)."""
    N, Kh = packed.shape
    out = torch.empty((N, 2 * Kh), dtype=torch.uint8, device=packed.device)
    n = packed.numel()
    _int4_to_fp8_kernel[(triton.cdiv(n, 4096),)](packed.contiguous(), out, n, BLOCK=4096, HALVES=halves)
    return out.view(torch.float8_e4m3fn)


FOLD_SPAN = 8  # MXFP4 fold: groups at most this many binades below their channel's largest stay exact in e4m3


@triton.jit
def _mxfp4_fold_kernel(src, down_ptr, dst, n_bytes, Kh, stride_dn, BLOCK: tl.constexpr):
    """pairs-packed e2m1 bytes -> e4m3 bytes of code x 2^-down (exact: see mxfp4_fold_to_fp8)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_bytes
    p = tl.load(src + offs, mask=ok, other=0)
    k = 2 * (offs % Kh)  # the even k of the byte's pair: both nibbles share its 32-wide group
    down = tl.load(down_ptr + (offs // Kh) * stride_dn + k // 32, mask=ok, other=0)
    lo = fp4_fold_e4m3(p & 0xF, down).to(tl.uint8, bitcast=True)
    hi = fp4_fold_e4m3(p >> 4, down).to(tl.uint8, bitcast=True)
    o = tl.program_id(0) * 2 * BLOCK + tl.arange(0, 2 * BLOCK)
    tl.store(dst + o, tl.reshape(tl.join(lo, hi), (2 * BLOCK,)), mask=o < 2 * n_bytes)


def mxfp4_fold_base(scale_e8m0: torch.Tensor):
    """e8m0 group scales [N, K // 32] -> (down uint8 [N, K // 32] = the channel's largest exponent minus the group's,
    channel scales fp32 [N] = 2^(largest - 127)) when every down is <= FOLD_SPAN (checked once per weight: a host
    sync), else None."""
    s = scale_e8m0.view(torch.uint8).to(torch.int32)
    base = s.amax(-1)
    down = base[:, None] - s
    if int(down.amax()) > FOLD_SPAN:
        return None
    return down.to(torch.uint8).contiguous(), torch.pow(2.0, (base - 127).float()).contiguous()


def mxfp4_fold_to_fp8(packed: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """MXFP4 weight (pairs-packed [N, K // 2]) with mxfp4_fold_base's `down` -> float8_e4m3fn [N, K] with the group
    scales folded in relative to the channel's: w = fold * channel scale exactly. Why exact: an e2m1 value times a
    power of two 2^-8 .. 1 is an e4m3 number (0.5 x 2^-8 = 2^-9 is e4m3's smallest subnormal, 6 is normal). Why: a
    K-varying scale multiplies each K tile's partial product and breaks the wgmma accumulator chain (W4A8 at large
    M far under the fp8 MMA bound); folded, the FP8 TMA kernel runs with per-channel scales only."""
    N, Kh = packed.shape
    out = torch.empty((N, 2 * Kh), dtype=torch.uint8, device=packed.device)
    n = packed.numel()
    _mxfp4_fold_kernel[(triton.cdiv(n, 4096),)](packed.contiguous(), down, out, n, Kh, down.stride(0), BLOCK=4096)
    return out.view(torch.float8_e4m3fn)


_OUT_DT = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
# weight bytes per row that a programmatic dependent launch prefetches before waiting for the activation quant
# (a 64-wide tile of an 8192-deep fp8 weight: 64 rows x 2 KB = 128 KB per CTA, ~16 MB over 128 CTAs: ~4 us of HBM)
PDL_PREFETCH_BYTES = 2048


def tma_ok(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> bool:
    """TMA boxes need contiguous rows with 16-byte aligned strides and base pointers."""
    return out.dtype in _OUT_DT and all(t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in (a, w, out))


def num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def split_parts(cfg, K: int, bk: int) -> int:
    """K parts of a TMA launch: cfg.SPLIT_K on the non-persistent grid (TMA 1), none persistent (TMA 2); fewer
    where K has fewer K tiles than that (no empty part)."""
    if cfg.TMA != 1 or cfg.SPLIT_K <= 1:
        return 1
    return nonempty_split(cfg.SPLIT_K, triton.cdiv(K, bk))


def launch_tma(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor,
               cfg, group: int = 0, pdl: bool = False) -> torch.Tensor:
    """out[M, N] = (a * a_scale[M]) @ (w * w_scale)^T; a, w both fp8 or both int8 (K contiguous); w_scale [N]
    per channel, or [N, K // group] group scales (group a multiple of the K tile). pdl: launched as a
    programmatic dependent launch of the kernel before it (the activation quant, which triggers it early): the
    CTAs prefetch their first weight lines into the L2 while that kernel runs (PDL_PREFETCH_BYTES per row)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    M, K = a.shape
    N = w.shape[0]
    bk = min(cfg.BK, group) if group else cfg.BK
    if group and group % bk:
        raise ValueError(f"weight group {group} must be a multiple of the K tile {bk}")
    a_desc = TensorDescriptor.from_tensor(a, [cfg.BM, bk])
    w_desc = TensorDescriptor.from_tensor(w, [cfg.BN, bk])
    c_desc = TensorDescriptor.from_tensor(out, [cfg.BM, cfg.BN])
    tiles = triton.cdiv(M, cfg.BM) * triton.cdiv(N, cfg.BN)
    progs = min(tiles, num_sms(a.device)) if cfg.TMA == 2 else tiles
    lines = min(PDL_PREFETCH_BYTES, triton.next_power_of_2(K * w.element_size())) // 128 if pdl else 0
    extra = {"launch_pdl": True} if pdl else {}
    split = split_parts(cfg, K, bk)
    if split > 1:  # K parts summed in the kernel: a slab per (part, tile) + a ticket counter per tile
        extra.update(SPLIT=split, part_ptr=torch.empty(split * tiles * cfg.BM * cfg.BN, device=a.device,
                                                        dtype=torch.float32),
                     cnt_ptr=_split_counters(a.device, tiles), c_ptr=out, stride_cm=out.stride(0))
    _w8a8_tma_kernel[(progs, split)](a_desc, w_desc, c_desc, a_scale, w_scale, w, M, N, K, progs,
                               w_scale.stride(0) if group else 1, w.stride(0), INT8=a.dtype == torch.int8, WG=group,
                               BM=cfg.BM, BN=cfg.BN, BK=bk, GROUP_M=cfg.GROUP_M,
                               OUT_DT=_OUT_DT[out.dtype], PDL_LINES=lines, num_warps=cfg.num_warps,
                               num_stages=cfg.num_stages, **extra)
    return out
