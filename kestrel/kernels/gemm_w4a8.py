"""W4A8 GEMM: 4-bit weights (int4 symmetric or fp4 e2m1) x FP8 e4m3 per-token activations.

The 4-bit weight tile is unpacked in registers to fp8 — exact, since every int4 (-8..7) and every e2m1 value is an
e4m3 value — and fed to the fp8 MMA. Weight group scales vary along K, so each K tile's fp8 partial product is
scaled by its group's scale before it is added (BLOCK_K <= group); per-channel scales and the per-token activation
scale go in the epilogue. Weight layout: packed uint8 [N, K // 2] (low nibble = even k), scales [N, K // group].
Supported weight scales: fp32/bf16 (int4 or fp4, group >= 32 or per-channel), e8m0 per 32 (MXFP4), e4m3 per 16 +
fp32 global (NVFP4: its 16-wide blocks are shorter than one fp8 MMA step, so NVFP4 weights take the bf16 MMA with
both operands converted exactly in registers — slower; int4 / MXFP4 are the fast W4A8 formats).
Kernel paths: swapped operands (C^T = W @ A^T: the converted weight tile is the wgmma register operand); with
config TMA=1 and int4, expand to fp8 once per call, then the TMA fp8 kernel (lowbit_tma.py; not faster so far). int4 weights repacked by
W4Weight.kernel_layout() ("halves": each byte holds k and k + 64 of a 128-wide K block) decode with no nibble
interleave — two dots of K/2 per tile instead of a join/reshape shuffle.

Small M (<= BF16_MAX_M tokens, int4 or MXFP4): the product is bound by the weight stream and the decode, not by MMA
throughput, so fp8 MMA buys nothing there; the activations are put on their per-token e4m3 grid (as bf16,
act_quant.fake_quant_fp8: one launch, the cost of the fp8 quant) and the tuned WNA16 kernels (decode / swap-AB
wgmma paths) run on the same 4-bit weight in the planar layout (W4Weight.wna16, made once and cached on the weight:
while both paths run the 4-bit weight is held twice). Numerics: the W4A8 product up to one bf16 rounding of each
activation code * scale and, int4, of each group scale (bf16 in the WNA16 format; MXFP4's e8m0 are exact). Tuning: `kestrel tune --lowbit w4a8-*`
times the fp8 kernels (the path above BF16_MAX_M); below it the WNA16 int4 / mxfp4 tune entries apply.
Hopper, from TCG_MIN_M tokens (int4) / in [FOLD_TCG_MIN_M, FOLD_TCG_MAX_M) (MXFP4 whose group exponents fold
exactly): the Gluon kernels on the same planar twin (gemm_w4a8_tcg.py: two consumer warpgroups, 256-token tiles
decoded once, the two warpgroups' wgmma issues in turn (TCG_PP); MXFP4 with its group exponents folded into the
decoded e4m3 weights), ahead of the small-M path;
their tiles tuned by `kestrel tune --lowbit w4a8tcg-*`. MXFP4 from FOLD_MIN_M otherwise: an fp8 copy of the folded
weight per call + the FP8 kernels.
"""
import os

import torch

from kestrel.kernels import act_quant
from kestrel.kernels.lowbit import pack_nibbles, ref_fp4_decode, unpack_nibbles
from kestrel.kernels.lowbit_gemm import (A_FP8, S_E4M3, S_E8M0, S_FLOAT, S_FOLD, W_FP4, W_FP8, W_INT4,
                                         GemmConfig, Operand, heuristic_config, run_dense)

W4_FORMATS = ("int4", "mxfp4", "nvfp4")


HALF_BLOCK = 128  # K block of the "halves" packing (= the kernels' K tile when they read it)
# W4A8 int4 up to this many tokens runs as fp8-grid activations on the WNA16 kernels (see the module doc); 0 = never.
# 256 from the session-10 H200 table (bench/results/gemm_w8a8_h200_s10r1.json): WNA16 int4 at M = 16 / 64 took
# 18-46 / 22-64 us where the fp8 W4A8 e2e took 22-69 / 44-148; at M = 1024 the two were level (198 vs 208 us)
BF16_MAX_M = int(os.environ.get("KESTREL_W4A8_BF16_MAX_M", "256"))
# from this M on, int4 on a Hopper GPU: the Gluon kernel on the same planar twin (gemm_w4a8_tcg.py: two consumer
# warpgroups, each decode / wgmma / scaled add, interleaved on the SM; 256-token tiles decoded once for two
# 128-token wgmma) instead of the WNA16 / Triton fp8 kernels; 0 = never. H100 session 21
# (bench/results/gemm_w8a8_h100_s21.md), e2e µs default path -> Gluon pick: 8192x28672 M = 256 201 -> 164, 1024
# 751 -> 574; 4096x14336 M = 256 64.3 -> 59.0, 1024 198 -> 151; at M = 64 the WNA16 path stays ahead (77 vs 110)
TCG_MIN_M = int(os.environ.get("KESTREL_W4A8_TCG_MIN_M", "256"))
# from this M on, MXFP4 weights: the group scales folded into an fp8 copy of the weight made per call (the values
# exact: lowbit_tma.mxfp4_fold_to_fp8), then the FP8 W8A8 kernels with per-channel scales, whose wgmma chain no
# K-varying scale breaks; 0 = never. H100 2026-12-07 (bench/results/gemm_w8a8_h100_s19.md): default path / fold =
# 1.84 / 2.01 / 4.37 / 5.76x the time at M = 64 / 256 / 1024 / 4096 (4096x14336), 1.14 / 1.72 / 4.38 / 6.01x
# (8192x28672), the 1.5-byte copy per weight included. Rel. error vs the dequantized product 2.3e-3 / 3.1e-3
# (K = 14336 / 28672) against 1.7e-3: one long fp8 wgmma accumulation chain (as in FP8 W8A8: 3.3e-3 / 4.7e-3)
# instead of a rescale every 32. (At M <= BF16_MAX_M the WNA16 MXFP4 kernels run first.)
FOLD_MIN_M = int(os.environ.get("KESTREL_W4A8_FOLD_MIN_M", "1"))
# MXFP4 weights (where fold_base allows) on a Hopper GPU with FOLD_TCG_MIN_M <= M < FOLD_TCG_MAX_M: the Gluon fold
# kernel (gemm_w4a8_tcg: e2m1 codes decoded straight to e4m3 x 2^-down in registers, one wgmma chain over 256
# tokens, no fp8 copy of the weight); 0 = never. H100 session 21, e2e µs default -> Gluon 256: 8192x28672 M = 256
# 239 -> 165, 1024 606 -> 567, 4096 1825 -> 2332 (the copy + dense FP8 kernel wins there); 4096x14336 M = 256
# 67.9 -> 63.9, 1024 165 -> 160, 4096 480 -> 622
# the Gluon kernels' consumer options (gemm_w4a8_tcg): TCG_PP the two consumer warpgroups' wgmma issues in turn
# (named barriers; the MXFP4 fold kernel with its K-halves loop too), TCG_PK (w4a8_linear, int4) the activations
# quantized with K permuted for the integer-only decode. H100 session 22 (bench/results/gemm_w8a8_h100_s22.md), GEMM
# µs of the 256-token tile, plain / pp / pk / pp + pk: 8192x28672 M = 4096 2140 / 2087 / 2123 / 1927, M = 1024
# 531 / 519 / 511 / 479; 4096x14336 M = 4096 544 / 527 / 533 / 487. TCG_PK on since session 23: the permuted quant
# (a register permute, then contiguous stores) takes 188 us at 4096 x 28672 against the plain 181 (s22's scattered
# byte stores: 616), and the default e2e pp -> pp + pk (H100 s23 R1, bench/results/gemm_w8a8_h100_s23.md) went
# 8192x28672 M = 256 / 1024 / 4096 142.8 / 537.5 / 2250 -> 135.4 / 508.6 / 2114, 4096x14336 50.9 / 138.3 / 608
# -> 48.0 / 131.8 / 550
TCG_PP = os.environ.get("KESTREL_W4A8_TCG_PP", "1") == "1"
TCG_PK = os.environ.get("KESTREL_W4A8_TCG_PK", "1") == "1"
FOLD_TCG_MIN_M = int(os.environ.get("KESTREL_W4A8_FOLD_TCG_MIN_M", "256"))
FOLD_TCG_MAX_M = int(os.environ.get("KESTREL_W4A8_FOLD_TCG_MAX_M", "2048"))
# with FOLD_MIN_M 0 (or below it), MXFP4 weights: 1 = the Triton W4A8 kernels fold the group scales in registers
# (lowbit_gemm.S_FOLD: exact e4m3 weights, one accumulator chain, K tiles of 128 instead of the group's 32); 0 (the
# default) = per-group rescaled partial products. H100 2026-12-07: the in-register fold took 1.14-1.75x the default's
# time at every measured point (M 64..4096, same file)
FOLD_KERNEL = os.environ.get("KESTREL_W4A8_FOLD_KERNEL", "0") == "1"


def to_halves(packed: torch.Tensor) -> torch.Tensor:
    """[..., K // 2] with k pairs (2j, 2j+1) per byte -> per 128-wide K block, byte j holds k = j (low nibble) and
    k = j + 64 (high): the kernel then gets two contiguous K halves from one load, with no nibble interleave."""
    codes = unpack_nibbles(packed)
    c = codes.reshape(*codes.shape[:-1], -1, 2, HALF_BLOCK // 2)
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(packed.shape)


def from_halves(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0xF, packed >> 4
    shp = (*packed.shape[:-1], -1, HALF_BLOCK // 2)
    codes = torch.stack([lo.reshape(shp), hi.reshape(shp)], dim=-2).reshape(*packed.shape[:-1], -1)
    return pack_nibbles(codes)


class W4Weight:
    """A 4-bit weight: packed [N, K//2] uint8, scale [N, K//group], optional global scale. layout "pairs" (the
    interchange packing, low nibble = even k) or "halves" (to_halves; made by kernel_layout(), int4 only)."""

    def __init__(self, fmt: str, packed: torch.Tensor, scale: torch.Tensor, group: int,
                 global_scale: torch.Tensor | None = None, layout: str = "pairs"):
        if fmt not in W4_FORMATS:
            raise ValueError(f"4-bit weight format must be one of {W4_FORMATS}, got {fmt!r}")
        self.fmt, self.packed, self.scale, self.group, self.global_scale = fmt, packed, scale, group, global_scale
        self.layout = layout
        self._wna16 = None  # wna16(): the planar twin, made on first use
        self._fold = None  # fold_base(): the MXFP4 scale fold's (down exponents, channel scales), made on first use
        self._fold_mult = None  # fold_mult(): the Gluon fold kernel's multipliers, made on first use

    def halves_ok(self) -> bool:
        K = self.shape[1]
        return self.fmt == "int4" and K % HALF_BLOCK == 0 and (self.group in (-1, K) or self.group % HALF_BLOCK == 0)

    def kernel_layout(self) -> "W4Weight":
        """the same weight repacked for the GEMM kernels (like Humming's transform()): "halves" where it applies
        (int4, K and group multiples of 128), else unchanged. Decode in registers then needs no nibble shuffles."""
        if self.layout == "halves" or not self.halves_ok():
            return self
        return W4Weight(self.fmt, to_halves(self.packed), self.scale, self.group, self.global_scale, "halves")

    def wna16_ok(self) -> bool:
        """int4 (K and group multiples of 128) or MXFP4 (K a multiple of 128), 2-D."""
        if self.packed.dim() != 2:
            return False
        if self.fmt == "mxfp4":
            return self.layout == "pairs" and self.shape[1] % HALF_BLOCK == 0
        return self.halves_ok()

    def wna16(self):
        """The same weight as a WNA16 QuantizedWeight, made on first use and cached (the small-M path of gemm_w4a8 /
        w4a8_linear). int4: planar codes c = q + 8, bf16 group scales [G, N] (rounded from fp32); MXFP4: the e2m1
        codes and e8m0 scale codes as they are (exact)."""
        if self._wna16 is None:
            if not self.wna16_ok():
                raise ValueError(f"no WNA16 form for a {self.fmt} weight of shape {tuple(self.packed.shape)}, group "
                                 f"{self.group} (int4 or mxfp4, 2-D, K and group multiples of {HALF_BLOCK})")
            from kestrel.quant import QuantSpec, QuantizedWeight
            from kestrel.quant.packing import pack_codes
            N, K = self.shape
            if self.fmt == "mxfp4":
                spec = QuantSpec("fp4_e2m1", "bf16", 32, False, "e8m0")
                codes = unpack_nibbles(self.packed).to(torch.int32)
                scales = self.scale.reshape(N, -1).view(torch.uint8).t().contiguous()
                self._wna16 = QuantizedWeight(spec, (N, K), pack_codes(codes, 4), scales)
                return self._wna16
            per_channel = self.group in (-1, K)
            spec = QuantSpec("int4", "bf16", -1 if per_channel else self.group, False, "bf16")
            codes = unpack_nibbles(self.pairs_packed()).to(torch.int32) ^ 8  # two's complement q -> q + 8
            scales = self.scale.reshape(N, -1).t().to(torch.bfloat16).contiguous()
            self._wna16 = QuantizedWeight(spec, (N, K), pack_codes(codes, 4), scales)
        return self._wna16

    def fold_base(self):
        """MXFP4 only: (down [N, K // 32], channel scales [N]) of lowbit_tma.mxfp4_fold_base, or None where a group
        lies more than FOLD_SPAN binades under its channel's largest (the fold would not be exact). Checked once (one
        host sync) and cached."""
        if self._fold is None:
            from kestrel.kernels.lowbit_tma import mxfp4_fold_base
            ok = self.fmt == "mxfp4" and self.packed.dim() == 2 and self.layout == "pairs"
            self._fold = (mxfp4_fold_base(self.scale) if ok else None) or False
        return self._fold or None

    def fold_mult(self):
        """MXFP4 where fold_base() allows: (f16 multiplier bits [K // 32, N] of gemm_w4a8_tcg.fold_multipliers,
        channel scales [N]) for the Gluon fold kernel, cached; None otherwise."""
        if self._fold_mult is None and self.fold_base() is not None:
            from kestrel.kernels.gemm_w4a8_tcg import fold_multipliers
            down, chan = self.fold_base()
            self._fold_mult = (fold_multipliers(down), chan)
        return self._fold_mult

    def pairs_packed(self) -> torch.Tensor:
        return from_halves(self.packed) if self.layout == "halves" else self.packed

    @property
    def shape(self):
        return self.packed.shape[-2], self.packed.shape[-1] * 2

    def operand(self, fold: bool = False) -> Operand:
        """The kernels' view. fold (MXFP4 where fold_base() allows): the scale-fold form (lowbit_gemm.S_FOLD)."""
        N, K = self.shape
        if fold:
            down, chan = self.fold_base()
            return Operand(W_FP4, self.packed, down, chan, group=self.group, scale_kind=S_FOLD)
        kind = {"int4": S_FLOAT, "mxfp4": S_E8M0, "nvfp4": S_E4M3}[self.fmt]
        group = 0 if self.group in (-1, K) and self.fmt == "int4" else self.group
        scale = self.scale.reshape(self.scale.shape[:-1]) if group == 0 else self.scale
        if kind == S_FLOAT:
            scale = scale.float()
        elif kind == S_E8M0:
            scale = scale.view(torch.uint8)
        return Operand(W_INT4 if self.fmt == "int4" else W_FP4, self.packed, scale.contiguous(),
                       self.global_scale, group=group, scale_kind=kind, halves=self.layout == "halves")

    def to(self, device):
        gs = None if self.global_scale is None else self.global_scale.to(device)
        return W4Weight(self.fmt, self.packed.to(device), self.scale.to(device), self.group, gs, self.layout)

    def dequantize(self) -> torch.Tensor:
        """CPU reference: fp32 [..., N, K]."""
        codes = unpack_nibbles(self.pairs_packed())
        if self.fmt == "int4":
            v = ((codes.to(torch.int32) ^ 8) - 8).float()
        else:
            v = ref_fp4_decode(codes)
        if self.fmt == "mxfp4":
            s = torch.pow(2.0, self.scale.float() - 127)
        else:
            s = self.scale.float()
        g = v.shape[-1] // s.shape[-1]
        w = v * s.repeat_interleave(g, -1)
        if self.global_scale is not None:
            w = w * self.global_scale.float().reshape(*([-1] + [1] * (w.dim() - 1)) if w.dim() == 3 else [1])
        return w


def quantize_weight_w4(w: torch.Tensor, fmt: str = "int4", group: int = 128) -> W4Weight:
    """RTN 4-bit quantization of [N, K] (or [E, N, K]) along K. int4: symmetric, scale = amax / 7, group = `group`
    (-1 per channel); mxfp4: e8m0 per 32; nvfp4: e4m3 per 16 with a per-tensor (per-expert) global scale."""
    if w.dim() == 3:
        parts = [quantize_weight_w4(we, fmt, group) for we in w]
        gs = None if parts[0].global_scale is None else torch.cat([p.global_scale for p in parts])
        return W4Weight(fmt, torch.stack([p.packed for p in parts]), torch.stack([p.scale for p in parts]),
                        parts[0].group, gs)
    w = w.float()
    N, K = w.shape
    if fmt == "mxfp4":
        q, s = act_quant.ref_quant_mxfp4(w)
        return W4Weight(fmt, q, s, 32)
    if fmt == "nvfp4":
        q, s, gs = act_quant.ref_quant_nvfp4(w)
        return W4Weight(fmt, q, s, 16, gs)
    if fmt != "int4":
        raise ValueError(f"4-bit weight format must be one of {W4_FORMATS}, got {fmt!r}")
    g = K if group == -1 else group
    if K % g:
        raise ValueError(f"K={K} is not a multiple of group {g}")
    wg = w.view(N, K // g, g)
    scale = wg.abs().amax(-1).clamp_min(1e-10) / 7.0
    q = torch.round(wg / scale[..., None]).clamp(-8, 7).to(torch.int32).view(N, K)
    return W4Weight("int4", pack_nibbles(q & 0xF), scale, g)


def gemm_w4a8(a_q: torch.Tensor, a_scale: torch.Tensor, w: W4Weight, out_dtype=torch.bfloat16,
              config: GemmConfig | None = None, bf16_max_m: int | None = None, tcg: bool | None = None
              ) -> torch.Tensor:
    """fp8 a_q [M, K] with per-token a_scale [M, 1] x 4-bit W [N, K] -> [M, N]. bf16_max_m / tcg: BF16_MAX_M's /
    TCG_MIN_M's override (a `config` always means the Triton fp8 kernels)."""
    N, K = w.shape
    if a_q.dim() != 2 or a_q.shape[1] != K or a_q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"gemm_w4a8: expected float8_e4m3fn activations [M, {K}], got {a_q.dtype} {tuple(a_q.shape)}")
    M = a_q.shape[0]
    if not act_quant.use_triton(a_q):
        return (act_quant.dequant_8bit(a_q, a_scale.float().reshape(M, -1)) @ w.dequantize().t()).to(out_dtype)
    # the Gluon kernels (gemm_w4a8_tcg.py) from their M on, ahead of the small-M WNA16 path
    route = None if config is not None else _tcg_route(a_q, w, tcg)
    if route is not None:
        return _run_tcg(route, a_q.contiguous(), a_scale, w, out_dtype)
    if config is None and use_wna16(M, w, bf16_max_m):  # small M: the WNA16 kernels on the fp8 values (module doc)
        from kestrel.kernels.gemm_wna16 import gemm_wna16
        x = act_quant.dequant_8bit(a_q, a_scale.float().reshape(M, 1)).to(torch.bfloat16)
        return gemm_wna16(x, w.wna16()).to(out_dtype)
    a_op = Operand(A_FP8, a_q.contiguous(), a_scale.float().reshape(M, 1).contiguous())
    if config is None and 0 < FOLD_MIN_M <= M and w.fold_base() is not None:
        from kestrel.kernels.gemm_w8a8 import tuned_config
        from kestrel.kernels.lowbit_tma import mxfp4_fold_to_fp8
        down, chan = w.fold_base()
        w8 = Operand(W_FP8, mxfp4_fold_to_fp8(w.packed, down), chan)
        return run_dense(a_op, w8, M, N, K, out_dtype, tuned_config(M, N, K, A_FP8))
    from kestrel.kernels.lowbit_tune import lookup
    cfg = config or lookup("w4a8-" + w.fmt, M, N, K) or heuristic_config(M, N, K, A_FP8, W_INT4)
    w_op = w.operand(fold=FOLD_KERNEL and w.fold_base() is not None)
    if cfg.TMA and w.fmt == "int4" and (w_op.group == 0 or w_op.group % 128 == 0) and M > 0:
        # expand to fp8 once per call, then the TMA fp8 kernel (lowbit_tma.py)
        from kestrel.kernels.lowbit_tma import int4_to_fp8, launch_tma, tma_ok
        w8 = int4_to_fp8(w.packed, halves=w.layout == "halves")
        out = torch.empty((M, N), dtype=out_dtype, device=a_q.device)
        if tma_ok(a_op.data, w8, out):
            return launch_tma(a_op.data, a_op.scale.reshape(-1), w8, w_op.scale, out, cfg, group=w_op.group)
    return run_dense(a_op, w_op, M, N, K, out_dtype, cfg)


def _tcg_route(a: torch.Tensor, w: W4Weight, tcg: bool | None) -> str | None:
    """"int4" / "fold" where the Gluon kernels (gemm_w4a8_tcg) take these activations (a: fp8 codes, or the bf16 x
    they will be quantized from, contiguously) and w: their M range (tcg overrides it), a Hopper GPU, the planar
    twin's shapes; else None."""
    M, (N, K) = a.shape[0], w.shape
    on = 0 < TCG_MIN_M <= M if w.fmt == "int4" else 0 < FOLD_TCG_MIN_M <= M < FOLD_TCG_MAX_M
    if not ((on if tcg is None else tcg) and w.wna16_ok()):
        return None
    from kestrel.kernels import gemm_w4a8_tcg
    if not gemm_w4a8_tcg.supported(a if a.dtype == torch.float8_e4m3fn else None, N, K, device=a.device):
        return None
    if w.fmt == "int4":
        return "int4"
    return "fold" if w.fold_mult() is not None else None  # (MXFP4: wna16_ok admits int4 and MXFP4 only)


def _run_tcg(route: str, a_q: torch.Tensor, a_scale: torch.Tensor, w: W4Weight, out_dtype,
             a_perm: bool = False) -> torch.Tensor:
    """The Gluon kernel _tcg_route chose, with the consumer options (TCG_PP; a_perm: a_q from quant_fp8(perm=True))."""
    from kestrel.kernels.gemm_w4a8_tcg import gemm_w4a8_fold_tcg, gemm_w4a8_tcg
    if route == "int4":
        return gemm_w4a8_tcg(a_q, a_scale, w.wna16(), out_dtype, pp=TCG_PP, a_perm=a_perm)
    return gemm_w4a8_fold_tcg(a_q, a_scale, w.wna16(), *w.fold_mult(), out_dtype, kh=TCG_PP, pp=TCG_PP)


def use_wna16(M: int, w: W4Weight, max_m: int | None = None) -> bool:
    return M <= (BF16_MAX_M if max_m is None else max_m) and w.wna16_ok()


def w4a8_linear(x: torch.Tensor, w: W4Weight, out_dtype=None, bf16_max_m: int | None = None,
                tcg: bool | None = None) -> torch.Tensor:
    """bf16 x [..., K] -> fp8 activations -> W4A8 GEMM. First the Gluon route (_tcg_route; tcg: TCG_MIN_M's
    override; TCG_PK: the permuted quant). Else up to BF16_MAX_M tokens (bf16_max_m overrides it) with int4:
    the fp8-grid activations on the WNA16 kernels (module doc). Else decode sizes
    (<= FUSED_MAX_M tokens) with int4 in the halves packing: one launch that quantizes per (token, 128) group itself
    (gemm_w8a8_fused.gemm_w4a8_fused); else a per-token quant launch, then gemm_w4a8."""
    from kestrel.kernels.gemm_w8a8 import FUSED_MAX_M
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    # the Gluon route first, as in gemm_w4a8 (at M = 256 = BF16_MAX_M the WNA16 path took 202 us where the Gluon
    # kernel's e2e took 155, H100 session 22, 8192x28672)
    gpu = act_quant.use_triton(x2)
    route = _tcg_route(x2, w, tcg) if gpu else None
    if route is not None:  # (TCG_PK, int4: the activations quantized with K permuted for the integer-only decode)
        perm = TCG_PK and route == "int4"
        a_q, a_s = act_quant.quant_fp8(x2, perm=perm)
        return _run_tcg(route, a_q, a_s, w, out_dtype or x.dtype, a_perm=perm).reshape(*lead, -1)
    if gpu and use_wna16(x2.shape[0], w, bf16_max_m) and x.dtype in (torch.bfloat16, torch.float16):
        from kestrel.kernels.gemm_wna16 import gemm_wna16
        y = gemm_wna16(act_quant.fake_quant_fp8(x2), w.wna16())
        return y.to(out_dtype or x.dtype).reshape(*lead, -1)
    if gpu and x2.shape[0] <= FUSED_MAX_M and w.layout == "halves" and w.halves_ok():
        from kestrel.kernels.gemm_w8a8_fused import gemm_w4a8_fused
        return gemm_w4a8_fused(x2, w, out_dtype or x.dtype).reshape(*lead, -1)
    a_q, a_s = act_quant.quant_fp8(x2)
    return gemm_w4a8(a_q, a_s, w, out_dtype or x.dtype, bf16_max_m=bf16_max_m, tcg=tcg).reshape(*lead, -1)
