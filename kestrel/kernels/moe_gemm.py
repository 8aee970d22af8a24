"""Grouped MoE GEMM: all experts in one launch over expert-sorted token blocks (see moe_align), any weight format.

Weight formats (stacked over experts [E, N, K]): bf16; fp8 / int8 per channel (W8A8, with fp8 / int8 activations);
int4 symmetric with group scales (WNA16 with bf16 activations, W4A8 with fp8 activations); mxfp4 / nvfp4 (W4A16,
W4A8, or W4A4 with mxfp4 / nvfp4 activations). The math is lowbit_gemm's kernel with IS_MOE: each program reads its
block's expert id and token rows, and the down projection multiplies by the routing weight in the epilogue.
int4 x bf16 experts in the WNA16 planar layout run their own grouped kernels instead: moe_mv.py (decode-sized expert
blocks, < TC_MIN_BM rows) and moe_tc.py (larger blocks: one K = 128 tensor-core dot per step).
"""
import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import torch
import triton

from kestrel.kernels import act_quant
from kestrel.kernels.gemm_w4a8 import W4Weight, quantize_weight_w4
from kestrel.kernels.lowbit_gemm import (A_BF16, A_FP8, A_INT8, A_MXFP4, A_NVFP4, W_BF16, W_FP8, W_INT8, GemmConfig,
                                         Operand, launch)
from kestrel.kernels.moe_mv import MvConfig, PlanarW4, grouped_gemm_planar, planar_from_nibbles
from kestrel.kernels.moe_tc import TcConfig, grouped_gemm_planar_tc

try:  # the Gluon grouped kernel (moe_tcg.py; GPU only)
    from kestrel.kernels import moe_tcg
    from kestrel.kernels.moe_tcg import TcgConfig
except Exception:  # noqa: BLE001 (a Triton without Gluon: the tc kernel serves)
    moe_tcg = None

    class TcgConfig:  # placeholder: isinstance checks stay valid
        pass

WEIGHT_FORMATS = ("bf16", "fp8", "int8", "int4", "mxfp4", "nvfp4")
ACT_FORMATS = ("bf16", "fp8", "int8", "mxfp4", "nvfp4")


@dataclass
class ExpertWeights:
    """[E, N, K] expert weights in one of WEIGHT_FORMATS (w4 holds the 4-bit layouts)."""
    fmt: str
    data: torch.Tensor | None = None  # bf16 / fp8 / int8 [E, N, K]
    scale: torch.Tensor | None = None  # fp32 [E, N] for fp8 / int8
    w4: W4Weight | None = None
    planar: PlanarW4 | None = None  # int4 in the WNA16 planar layout (moe_mv.py; bf16 activations)

    @property
    def shape(self):
        if self.planar is not None:
            return self.planar.shape
        if self.w4 is not None:
            return (self.w4.packed.shape[0],) + tuple(self.w4.shape)
        return tuple(self.data.shape)

    def operand(self) -> Operand:
        if self.w4 is not None:
            return self.w4.operand()
        if self.fmt == "bf16":
            return Operand(W_BF16, self.data)
        return Operand(W_FP8 if self.fmt == "fp8" else W_INT8, self.data, self.scale)

    def dequantize(self) -> torch.Tensor:
        """CPU reference, fp32 [E, N, K]."""
        if self.planar is not None:
            return self.planar.dequantize()
        if self.w4 is not None:
            return self.w4.dequantize()
        if self.fmt == "bf16":
            return self.data.float()
        return self.data.float() * self.scale.float()[..., None]

    def to(self, device):
        return ExpertWeights(self.fmt, None if self.data is None else self.data.to(device),
                             None if self.scale is None else self.scale.to(device),
                             None if self.w4 is None else self.w4.to(device),
                             None if self.planar is None else self.planar.to(device))


def quantize_experts(w: torch.Tensor, fmt: str, group: int = 128, kernel_layout: bool = True,
                     planar: bool = False) -> ExpertWeights:
    """RTN-quantize stacked expert weights [E, N, K] into `fmt`. kernel_layout: int4 in the "halves" packing where it
    applies (W4Weight.kernel_layout: no nibble interleave in the kernel). planar: int4 in the WNA16 planar layout
    for the moe_mv kernel (bf16 activations only)."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"MoE weight format must be one of {WEIGHT_FORMATS}, got {fmt!r}")
    if w.dim() != 3:
        raise ValueError(f"expert weights must be [E, N, K], got {tuple(w.shape)}")
    if fmt == "bf16":
        return ExpertWeights("bf16", w.to(torch.bfloat16).contiguous())
    if fmt in ("fp8", "int8"):
        quant = act_quant.ref_quant_fp8 if fmt == "fp8" else act_quant.ref_quant_int8
        parts = [quant(we.float()) for we in w]  # one expert at a time: bounded fp32 temporaries
        return ExpertWeights(fmt, torch.stack([q for q, _ in parts]), torch.stack([s.view(-1) for _, s in parts]))
    w4 = quantize_weight_w4(w, fmt, group)
    if planar:
        if fmt != "int4":
            raise ValueError(f"the planar layout holds int4 weights only, got {fmt!r}")
        return ExpertWeights(fmt, planar=planar_from_nibbles(w4.packed, w4.scale, w4.group))
    return ExpertWeights(fmt, w4=w4.kernel_layout() if kernel_layout else w4)


def check_pair(act: str, w: ExpertWeights):
    ok = {
        "bf16": ("bf16", "int4", "mxfp4", "nvfp4"),
        "fp8": ("fp8", "int4", "mxfp4", "nvfp4"),
        "int8": ("int8", "int4"),
        "mxfp4": ("mxfp4",),
        "nvfp4": ("nvfp4",),
    }
    if act not in ok:
        raise ValueError(f"MoE activation format must be one of {ACT_FORMATS}, got {act!r}")
    if w.fmt not in ok[act]:
        raise ValueError(f"activation {act!r} cannot be paired with {w.fmt!r} weights (allowed: {ok[act]})")
    if w.planar is not None and act != "bf16":
        raise ValueError(f"planar int4 expert weights take bf16 activations, got {act!r}")


def quant_act(x: torch.Tensor, act: str) -> Operand:
    """quantize activations [T, K] for the grouped GEMM."""
    if act == "bf16":
        return Operand(A_BF16, x.contiguous())
    if act == "fp8":
        q, s = act_quant.quant_fp8(x)
        return Operand(A_FP8, q, s)
    if act == "int8":
        q, s = act_quant.quant_int8(x)
        return Operand(A_INT8, q, s)
    if act == "mxfp4":
        q, s = act_quant.quant_mxfp4(x)
        return Operand(A_MXFP4, q, s)
    q, s, gs = act_quant.quant_nvfp4(x)
    return Operand(A_NVFP4, q, s, gs)


def moe_config(num_slots: int, num_experts: int, act: str, planar: bool = False) -> GemmConfig:
    """block_m follows the average rows per expert (decode: 16, so padding waste stays small); up and down
    projections share it (one sort/align serves both). The planar kernel stops at 64 (its 128-row blocks measured
    1.5x slower than 64-row swapped ones on Mixtral at M = 1024, bench/results/moe_h200_run4.md), but for the
    Gluon loops (KESTREL_MOE_TCG_BM, _tcg_bm)."""
    per_expert = num_slots / max(num_experts, 1)
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64 if per_expert <= 96 or planar else 128
    if planar and bm == 64 and per_expert <= 96 and _tcg_bm() == 32:
        bm = 32  # KESTREL_MOE_TCG_BM=32: 32-row blocks for the swapped Gluon kernel (less padding, wgmma N 32)
    if planar and bm == 64 and _tcg_bm() in (80, 96):
        bm = _tcg_bm()  # KESTREL_MOE_TCG_BM=80 / 96: that many rows (64 + 16 / 32) for the WS Gluon loop
    elif planar and bm == 64 and _tcg_bm() == -1:
        bm = ws_block_rows(per_expert)  # the default on Hopper with the WS loop: 64, 80 or 96 rows
    elif planar and bm == 64 and per_expert > 192 and _tcg_bm() == 128:
        # KESTREL_MOE_TCG_BM=128 (session 8; the default off the WS loop): Mixtral-like routing (256 slots per
        # expert at M = 1024) fills 128-row blocks, so each decoded weight tile feeds twice the tokens
        bm = 128
    dq16 = act in ("bf16", "mxfp4", "nvfp4")
    bk = 64 if dq16 else 128
    warps = 8 if bm >= 128 else 4
    return GemmConfig(BM=bm, BN=128 if bm >= 64 else 64, BK=bk, num_warps=warps, num_stages=3 if bm >= 128 else 4)


def moe_configs(num_tokens: int, top_k: int, num_experts: int, act: str, w13: ExpertWeights, w2: ExpertWeights,
                num_sms: int = 132):
    """(up, down) compute configs of one MoE layer call: the tune cache's entry (`kestrel tune --moe`) where one
    exists for this GPU, projection shape and token bucket, else the heuristic. Both share block_m (one sort/align
    serves both projections)."""
    from kestrel.kernels.moe_tune import kernel_name, lookup
    T = num_tokens * top_k
    base = moe_config(T, num_experts, act, planar=w13.planar is not None)
    out = []
    for w in (w13, w2):
        E, N, K = w.shape
        name = kernel_name(w, act)
        tuned = lookup(name, num_tokens, E, top_k, N, K, base.BM) if name and w.shape[0] else None
        out.append(tuned or _projection_config(base, T, num_experts, w, num_sms))
    return tuple(out)


def _projection_config(base: GemmConfig, num_slots: int, num_experts: int, w: ExpertWeights, num_sms: int):
    """the heuristic for one projection; planar int4 from the H200 sweep (bench/results/moe_h200_run4.md)."""
    if w.planar is None:
        return base
    E, N, K = w.shape
    bm = base.BM
    if bm <= 16:
        # decode: a weight stream. K splits while the programs (touched experts x N tiles, at most min(E, slots)
        # experts) stay under ~8 per SM: Qwen3 M=1 (96 programs) split 4, DeepSeek-V3 (256) 2-4, Mixtral (448) 2
        bn = 128 if N >= 1024 else 64
        progs = min(num_experts, num_slots) * triton.cdiv(N, bn)
        split = 1
        while split < 4 and progs * split * 2 <= 8 * num_sms and K // (128 * split * 2) >= 2:
            split *= 2
        return MvConfig(BM=bm, BN=bn, SPLIT_K=split, num_warps=2, num_stages=3)
    # compute bound: one K=128 tensor-core dot per step (moe_tc / moe_tcg). H200, M = 1024 up projection
    # (bench/results/moe_h200_run6.md): Qwen3 225.7 us vs 243.4 for mv, Mixtral 1548 vs 1707
    if bm >= TC_MIN_BM or (bm == 32 and num_slots / max(num_experts, 1) > 32 and _tcg_bm() == 32):
        if USE_TCG and moe_tcg is not None and w.planar.group == 128:  # Gluon: decode overlapped with the wgmma
            # H200, M = 1024 (bench/results/moe_h200_run6.md, session 4 R1): swapped BN 256 204.7 / 132.5 / 1310 us
            # (Qwen3 up / down, Mixtral up) vs tc 225.7 / 147.8 / 1549; the unswapped tcg was slower than tc
            swap = USE_TCG in ("2", "3", "4", "5")
            # session 5 R1: the tcgp loop (SWAP 2, 4-deep ring) 198.3 / 125.6 us on Qwen3 up / down (SWAP 1: 207.4
            # / 133.4, Humming 132.5 / 77.1)
            tcgp = USE_TCG in ("3", "4", "5")  # 4: the tcgp loop persistent, 5: warp-specialised (session 9)
            # session 9 R2 (same process, M = 1024): the warp-specialised loop 195.9 / 121.1 us vs 198.9 / 124.1 on
            # Qwen3 up / down (64-row blocks), but 1283 vs 1254 on Mixtral up with 128-row blocks: =5 takes it
            # for blocks of up to 64 rows only
            ws = USE_TCG == "5" and (bm <= 64 or bm in (80, 96))  # (80 / 96: the WS kernel only)
            # 128-row blocks: BN 128 keeps the fp32 accumulator at 64 registers a thread, as 64 x 256 does
            bn = 256 if swap and (bm <= 64 or ws) else 128
            # (LOOP 2 of the persistent loop: row halves only, BN 256)
            loop = TCG_LOOP if tcgp and (USE_TCG != "4" or bn == 256) else 0
            return TcgConfig(BM=bm, BN=bn, num_warps=8, num_stages=4 if tcgp else 3, GROUP_M=8,
                             SWAP=2 if tcgp else int(swap), PERSIST=int(USE_TCG == "4"), WS=TCG_WS if ws else 0,
                             LOOP=loop)
        return TcConfig(BM=bm, BN=128, num_warps=8, num_stages=3, DEC=2)
    # more rows per expert: swapped operands (the weight tile is the MMA's 128-row side, the block's tokens its N)
    return MvConfig(BM=bm, BN=128, num_warps=4, num_stages=3, SWAP=1 if bm >= 64 else 0)


# planar int4 expert blocks of at least this many rows run the tc kernel (moe_tc.py) by default, smaller ones mv
TC_MIN_BM = 64
# ... the Gluon tcg kernel (moe_tcg.py) instead of tc where it runs (Hopper, g128): KESTREL_MOE_TCG=5 (default,
# session 9: =3 with a warp-specialised loader for blocks of up to 64 rows; H200 R2: Qwen3-30B-A3B M=1024 layer
# 341.2 us, err 5.67e-3 as =3), 3 (W decoded into the wgmma's register operand on the dense swap kernel's loop,
# one wgmma in flight; session 8 H200: Qwen3 layer 350.6 vs 366.1 us for =2, Mixtral 1989 vs 2067), 2 (session 4's
# swapped loop), 4 (=3 persistent: one program per SM; session 9 R1: right, 5-11 % slower per GEMM), 1 (decoded W
# tile in shared memory), 0: off (the Triton tc kernel)
USE_TCG = os.environ.get("KESTREL_MOE_TCG", "5")
USE_TCG = "" if USE_TCG == "0" else USE_TCG


# KESTREL_MOE_TCG_BM: the expert-block rows of the swapped Gluon kernel (see moe_config); a module global so benches
# can flip it between calls. "auto" (default): with the WS loop (KESTREL_MOE_TCG=5) on Hopper ws_block_rows' choice
# of 64 / 80 / 96 rows, otherwise 128 above 192 slots per expert (session 8 H200 Mixtral-8x7B M=1024 layer 1926 us
# vs 1989 with 64-row blocks). 32 / 80 / 96 / 128: those rows (80 / 96 only with the WS loop on Hopper: the Triton
# tc fallback has no such tiles); "" / 0: 64 rows
TCG_BM = os.environ.get("KESTREL_MOE_TCG_BM", "auto")
# KESTREL_MOE_TCG_WS: the WS loop's slot release (TcgConfig.WS): 2 (default, session 10) mbarrier arrive without a
# fence before it, 1 with the fence (session 9). H200 R1 (same process): 194.7 / 121.5 / 1274.4 us vs 195.7 / 121.6
# / 1273.3 on Qwen3 up / down / Mixtral up, err on every slot identical: neutral, one barrier a step less
TCG_WS = int(os.environ.get("KESTREL_MOE_TCG_WS", "2"))
# KESTREL_MOE_TCG_LOOP: the tcgp / WS loops' K loop (TcgConfig.LOOP): 2 = two wgmma a step on the weight tile's row
# (or K) halves, each A register set rewritten only after its wgmma retired (session 11: the one-A loop writes the in-flight wgmma's
# A registers, ~230 SASS writes a loop, offline sm_90a compile; race count 0 with 2, same registers); 0 the one-A
# loop, right so far only by ptxas' schedule. Default 2 since session 15: the GPU tests of both loops pass (H100) and
# the layer bench is faster with 2 (Qwen3-30B-A3B 1.31x vs 1.25x Humming, Mixtral 0.98x vs 0.94x; M = 1024 int4)
TCG_LOOP = int(os.environ.get("KESTREL_MOE_TCG_LOOP", "2"))

# relative cost of one expert block (one weight tile's loads + decode + its rows' x loads + wgmma) of the WS loop by
# rows: H200 session 10 R1, Qwen3-30B-A3B up projection M = 1024 (195.7 / 165.3 / 177.4 us for 64 / 80 / 96 rows
# over ~188 / ~131 / ~128 expected blocks); with the blocks of ws_block_rows it also predicts the down projection
# (121.6 / 105.7 / 112.7 us: 0.87 / 0.93 measured, 0.83 / 0.89 predicted) and Mixtral up (1273 / 1350 / 1176:
# 1.06 / 0.92, predicted 1.05 / 0.89), but not the DeepSeek-V3 layer at M = 4096 (R2 / R3: 80 rows 9321 us vs 64 rows
# 8528, predicted 0.97): hence WS_BLOCK_MARGIN
WS_BLOCK_COST = {64: 1.04, 80: 1.26, 96: 1.39}
WS_BLOCK_MARGIN = 0.92  # 80 / 96 rows only where predicted at least 8 % cheaper than 64 (Qwen3 0.83, Mixtral 0.89)


@functools.lru_cache(maxsize=512)  # (moe_config runs on every layer call)
def ws_block_rows(per_expert: float) -> int:
    """the block rows of WS_BLOCK_COST with the least expected cost, sum over an expert's blocks: its slot count n
    taken as Poisson-like (normal, mean = sd^2 = per_expert), E[ceil(n / bm)] = sum_j P(n > j bm); 64 unless that
    is WS_BLOCK_MARGIN cheaper. Qwen3-30B-A3B M = 1024 (64 per expert): 80 (one block nearly always, where 64 rows
    need 1.5); Mixtral M = 1024 (256): 96; DeepSeek-V3 M = 4096 (128): 64."""
    sd = max(math.sqrt(per_expert), 1e-6)

    def cost(bm):
        return WS_BLOCK_COST[bm] * sum(0.5 * math.erfc((j * bm - per_expert) / (sd * math.sqrt(2)))
                                       for j in range(int((per_expert + 8 * sd) // bm) + 1))
    best = min(WS_BLOCK_COST, key=cost)
    return best if cost(best) < WS_BLOCK_MARGIN * cost(64) else 64


def _ws_hopper() -> bool:
    return (USE_TCG == "5" and moe_tcg is not None and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] == 9)


def _tcg_bm() -> int:
    """the expert-block rows asked for the swapped Gluon kernel: -1 for ws_block_rows' choice, 0 for 64 rows."""
    if USE_TCG not in ("2", "3", "4", "5") or moe_tcg is None:
        return 0
    if TCG_BM == "auto":
        return -1 if _ws_hopper() else 128
    if TCG_BM in ("80", "96"):
        return int(TCG_BM) if _ws_hopper() else 0
    return int(TCG_BM) if TCG_BM in ("32", "128") else 0


def _tc_fallback(cfg: "TcgConfig") -> TcConfig:
    """the Triton tc config standing in for a tcg one where Gluon cannot run (CPU interpreter, not Hopper)."""
    return TcConfig(BM=cfg.BM, BN=cfg.BN, num_warps=8, num_stages=3, DEC=2)


def grouped_gemm(a: Operand, w: ExpertWeights, align, num_slots: int, a_div: int, out: torch.Tensor,
                 cfg, topk_weights: torch.Tensor | None = None, reduce_k: int = 0) -> torch.Tensor:
    """out[slot] = A[slot // a_div] @ W[expert(slot)]^T (x routing weight) for every valid slot, one launch.
    cfg: a GemmConfig (lowbit_gemm kernel) or, for planar int4 weights, an MvConfig (moe_mv kernel) or a TcConfig
    (moe_tc kernel). reduce_k
    > 0: out [slots // reduce_k, N] fp32 gets each token's sum over its slots (fp32 atomics, no fixed order)."""
    if w.planar is not None:
        if isinstance(cfg, TcgConfig):
            if moe_tcg.supports(a.data, w.planar, cfg):
                return moe_tcg.grouped_gemm_planar_tcg(a.data, w.planar, align, num_slots, a_div, out, cfg,
                                                       topk_weights, reduce_k)
            if cfg.BM & (cfg.BM - 1):  # 80 / 96-row blocks (the WS Gluon loop's): as 16-row blocks, each
                # expert id repeated (the slot list is the same), for the Triton kernel's power-of-two tiles
                align = (align[0], align[1].repeat_interleave(cfg.BM // 16), align[2])
                cfg = dataclasses.replace(cfg, BM=16)
            cfg = _tc_fallback(cfg)
        if isinstance(cfg, TcConfig):
            return grouped_gemm_planar_tc(a.data, w.planar, align, num_slots, a_div, out, cfg, topk_weights, reduce_k)
        return grouped_gemm_planar(a.data, w.planar, align, num_slots, a_div, out, cfg, topk_weights, reduce_k)
    sorted_ids, expert_ids, num_post = align
    E, N, K = w.shape
    moe = dict(sorted_ids=sorted_ids, expert_ids=expert_ids, num_post=num_post, num_valid=num_slots, a_div=a_div,
               topk_weights=topk_weights, reduce_k=reduce_k)
    if reduce_k:  # fp32 atomics of each slot into its token's row (no [slots, N] buffer + sum)
        if out.dtype != torch.float32 or out.shape[0] * reduce_k != num_slots:
            raise ValueError(f"reduce_k={reduce_k}: out must be fp32 [{num_slots // reduce_k}, N]")
        launch(a, w.operand(), out.zero_(), num_slots, N, K, cfg, moe=moe)
        return out
    if cfg.SPLIT_K > 1:  # the K splits add their partials atomically into a zeroed fp32 buffer
        acc = out.zero_() if out.dtype == torch.float32 else torch.zeros(out.shape, dtype=torch.float32,
                                                                          device=out.device)
        launch(a, w.operand(), acc, num_slots, N, K, cfg, moe=moe)
        if acc is not out:
            out.copy_(acc)
        return out
    return launch(a, w.operand(), out, num_slots, N, K, cfg, moe=moe)
