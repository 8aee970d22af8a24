"""Measure candidate ComputeConfigs on the current GPU and keep the fastest per (layer, M bucket)."""
from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from kestrel.kernels.configs import ComputeConfig, LayerConfig, cache_key, heuristic, m_bucket
from kestrel.kernels.timing import cold_copies, graph_time_us
from kestrel.quant.rtn import quantize
from kestrel.quant.spec import QuantSpec

# named formats for the CLI and the bench
FORMATS = {
    "int4": QuantSpec("int4", group_size=128, scale_dtype="bf16"),
    "uint4-zp": QuantSpec("uint4", group_size=128, has_zero_point=True, scale_dtype="bf16"),
    "int8": QuantSpec("int8", group_size=-1, scale_dtype="bf16"),
    "fp8": QuantSpec("fp8_e4m3", group_size=-1, scale_dtype="fp32"),
    "mxfp4": QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0"),
    "nvfp4": QuantSpec("fp4_e2m1", group_size=16, scale_dtype="fp8_e4m3", global_scale=True),
    "int3": QuantSpec("int3", group_size=128, scale_dtype="bf16"),
    "int2": QuantSpec("int2", group_size=64, scale_dtype="bf16"),
}

MODEL_SHAPES = {  # (N, K) of the linear layers (fused qkv and gate_up)
    "llama3-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "llama3-70b": [(10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)],
}


def candidates(layer: LayerConfig, m: int, gluon: bool = True) -> list[ComputeConfig]:
    """gluon=False leaves out the Gluon "tcg" kernel (e.g. before it has been checked on a new GPU/Triton)."""
    out = small_m_candidates(layer, m) if m <= 16 else large_m_candidates(layer, m, gluon=gluon)
    h = heuristic(layer, m)
    front = wave_candidates(layer, m) if gluon and 64 < m <= 1024 else []
    seen, uniq = set(), []
    for c in [h] + front + out:
        if c not in seen and c.valid_for(layer):
            seen.add(c)
            uniq.append(c)
    # nearest neighbours of the heuristic first, so --max-candidates does a local search around it; the configs of
    # each other kernel come in their own order, half a step apart, so the first of each is among the first few
    rank, seen_k = {}, {}
    for c in uniq:
        if (c.kernel, c.swap) != (h.kernel, h.swap):
            kind = (c.kernel, c.swap)
            rank[c] = seen_k.get(kind, 0)
            seen_k[kind] = rank[c] + 1
    # the wave-quantization picks right after the heuristic: split neighbours by |log2| never reach split 3-4 of a
    # 1.2-wave grid (70B qkv M = 256) within --max-candidates
    pos = {c: i for i, c in enumerate(front)}
    return sorted(uniq, key=lambda c: (c != h, c not in pos, pos.get(c, 0),
                                       config_distance(c, h) + 0.5 * rank.get(c, 0)))


def wave_cost(units: int, split: int, slots: int) -> float:
    """Relative time of `units` CTAs (tiles x split), each 1/split of a tile's K, on `slots` resident CTAs: whole
    waves of 1/split-long CTAs, +5 % per extra split for the partial sums (a guess: the tuner measures)."""
    return math.ceil(units / slots) / split * (1 + 0.05 * (split - 1))


def wave_splits(layer: LayerConfig, m: int, block_m: int, block_n: int, per_sm: int, num_sms: int = 132,
                max_split: int = 8) -> list[int]:
    """Splits over K (each >= 8 K steps of 128, none empty) of the swap kernel's grid, best wave_cost first."""
    tiles = -(-m // block_m) * -(-layer.n // block_n)
    steps = layer.k // 128
    sks = [sk for sk in range(1, max_split + 1)
           if sk == 1 or (steps // sk >= 8 and (sk - 1) * -(-steps // sk) < steps)]
    return sorted(sks, key=lambda sk: wave_cost(tiles * sk, sk, per_sm * num_sms))


def wave_candidates(layer: LayerConfig, m: int, num_sms: int = 132) -> list[ComputeConfig]:
    """64 < M <= 1024: swap-AB tcg configs chosen for wave quantization, measured first by the tuner. The M = 256
    tiles (128x128 s4, 164 KB, and 256x128 s2, 147 KB: one CTA per SM) of 70B qkv (N = 10240) make 160 / 80 CTAs
    on 132 SMs: split 1 runs 1.2 waves, split 4 / 3 fill 4.85 / 1.8; 128x256 s3 (144 KB) halves the x re-reads of
    128x128. H200 session 7 R1 (int4 70B qkv M = 256, us): 128x128 split 1 113.2, split 4 with fp32 atomics 93.5,
    split 4 with the in-kernel reduction 135.4 (its last split sums the 4 partial tiles alone), 128x256 split 3
    reduce 94.5, 256x128 split 3 reduce 120.0: so split > 1 with atomics, the 128x256 tile also with the reduction
    (MXFP4's winner there, 106.6). On multi-wave grids splitting lost (8B gate_up split 2: 142.0 vs 117.0): the
    tuner decides. M = 1024: the 128x256 s3 swap tile (won int4 70B gate_up / down and 8B gate_up) and the
    256-row tile."""
    C = ComputeConfig
    out = []
    if m <= 256:
        for bm, bn, st in ((128, 128, 4), (128, 256, 3), (256, 128, 2)):
            for i, sk in enumerate(wave_splits(layer, m, bm, bn, 1, num_sms)[:1 if bm == 256 else 2]):
                out.append(C("tcg", bm, bn, 0, sk, 8, st, swap=True))
                if sk > 1 and bn == 256 and i == 0:
                    out.append(C("tcg", bm, bn, 0, sk, 8, st, swap=True, reduce=1))
    else:
        for bm, bn, st in ((128, 256, 3), (256, 128, 2), (128, 128, 4)):
            best = wave_splits(layer, m, bm, bn, 1, num_sms, max_split=2)[0]
            for sk in dict.fromkeys((1, best) if bn == 256 else (best,)):  # 128x256: also the session-5 probe's 1
                out.append(C("tcg", bm, bn, 0, sk, 8, st, swap=True, reduce=int(sk > 1)))
    # the stream-K schedule (gemm_wna16_tcg_streamk.py: Humming's way round wave quantization) on the tile of
    # each M's first wave pick (one config: more would push the other kernels out of --max-candidates); 128x128
    # with the ticketed sum at M <= 256 (H200 session 9 R2, int4 70B qkv M = 256: 78-81 us, wrong then through the
    # K loop's register-A race, fixed in session 10; the tuned default 94.2, Humming 66.2); M = 1024 128x256
    # (299.0 vs dequant + cuBLAS 268.0)
    out.append(C("tcg", 128, 128, 0, 1, 8, 4, swap=True, streamk=1) if m <= 256 else
               C("tcg", 128, 256, 0, 1, 8, 3, swap=True, streamk=1))
    # session 11 (compiled offline, not yet GPU-timed; after the session-10 picks so --max-candidates 6 measures
    # what it did before): at M <= 256 the stream-K plan without the fold (streamk 3: only the leftover tiles
    # shared; 70B qkv: 132 data-parallel tiles + 28 in ranges of 14 steps, vs 160 tiles nearly all shared by 2
    # CTAs) where it differs, and where the 128x128 grid is over a wave the 128x256 stream-K tile (half the tiles
    # to share, half the x re-reads); at M = 1024 the loader-warp 128x256 tile (ws 1, race-free since session 11)
    if m <= 256:
        from kestrel.kernels.gemm_wna16_tcg_streamk import plan
        tiles, steps = -(-m // 128) * (layer.n // 128), layer.k // 128
        if tiles and steps and plan(tiles, steps, num_sms) != plan(tiles, steps, num_sms, fold=False):
            out.append(C("tcg", 128, 128, 0, 1, 8, 4, swap=True, streamk=3))
        if tiles > num_sms:
            out.append(C("tcg", 128, 256, 0, 1, 8, 3, swap=True, streamk=1))
    else:
        out.append(C("tcg", 128, 256, 0, 1, 8, 3, swap=True, ws=1))
    return [c for c in out if c.valid_for(layer)]


def config_distance(c: ComputeConfig, h: ComputeConfig) -> float:
    """How far config c is from h for the tuner's local search: split-K counts |log2| of the ratio (split 4 is one
    step from 2 and 8), stages half a step each, another kernel 1.25 (so the other path of the same M, e.g.
    dequant + cuBLAS next to tc at M = 256, stays among the first few), every other differing field 1. With the
    plain count of differing fields, --max-candidates 6 at 8B down M = 256 never reached tc 128x128 split 4 s2, the
    config the H200 probe found fastest (79.7 vs 89.5 us)."""
    if c.kernel != h.kernel or c.swap != h.swap:  # the swap-AB Gluon kernel is another kernel too
        return 1.25
    d = abs(math.log2(c.split_k / h.split_k)) + 0.5 * abs(c.num_stages - h.num_stages)
    a, b = c.to_dict(), h.to_dict()
    return d + sum(a[f] != b[f] for f in a if f not in ("kernel", "split_k", "num_stages"))


def tc_configs(m: int) -> list[ComputeConfig]:
    """tensor-core "tc" tiles tried at this M (> 16), before split-K: the ones that won or came within ~10 % somewhere
    in the H200 round-1 sweep of 2026-12-03 (32-row, 256-row, 256-deep-K tiles and "mv" at M = 64 lost everywhere)."""
    C = ComputeConfig
    if m <= 64:
        # 64x256 (two 128-wide halves sharing each x tile): half the x re-reads from the L2
        return [C("tc", 64, 128, 0, 1, 8, 3), C("tc", 64, 128, 0, 1, 8, 4), C("tc", 64, 64, 0, 1, 4, 4),
                C("tc", 64, 64, 0, 1, 4, 3), C("tc", 64, 256, 0, 1, 8, 3)]
    if m <= 256:
        return [C("tc", 128, 128, 0, 1, 8, 2), C("tc", 128, 128, 0, 1, 8, 3), C("tc", 128, 128, 0, 1, 8, 4),
                C("tc", 64, 128, 0, 1, 8, 3), C("tc", 128, 256, 0, 1, 8, 3)]
    return [C("tc", 128, 128, 0, 1, 8, 2), C("tc", 128, 128, 0, 1, 8, 3), C("tc", 128, 256, 0, 1, 8, 3)]


def tcg_configs(layer: LayerConfig, m: int, num_sms: int = 132) -> list[ComputeConfig]:
    """The Gluon kernel (gemm_wna16_tcg.py, one 8-warp CTA per SM: 112-225 KB of shared memory): 64-row tiles at
    M <= 64, 64-, 128- and 256-row tiles above, each split over K from the smallest split that fills ~half the SMs up
    to ~2 waves. Configs the format or shape cannot take are dropped by valid_for."""
    C = ComputeConfig
    # (block_m, block_n, stages, warps). Each CTA re-reads its x rows from the L2 once per N tile, so x traffic is
    # 4 M / BN times the weight bytes (2x at M = 64 with 128-wide tiles, 8x at M = 256: the H200 probe of
    # 2026-12-03 #3 ran at ~4.4 TB/s of L2 -> SM traffic there): 256-wide tiles halve it; 256-row tiles decode each
    # W tile once for all of M = 256; 16 warps hide more latency (decode) with one CTA per SM
    if m <= 64:
        # (64, 128, 2, 8): 112 KB of shared memory, two CTAs per SM
        tiles = [(64, 128, 4, 8), (64, 256, 2, 8), (64, 256, 3, 16), (64, 128, 4, 16), (64, 128, 3, 8),
                 (64, 256, 3, 8), (64, 128, 2, 8), (64, 256, 2, 16)]
    else:
        tiles = [(128, 128, 3, 8), (128, 256, 2, 16), (256, 128, 2, 16), (128, 256, 2, 8), (256, 128, 2, 8),
                 (128, 128, 3, 16), (64, 128, 4, 8)]
    # swap-AB tiles (W decoded into the wgmma A registers; MXFP4 too): (block_m, block_n, stages, warps, ws). The
    # loader-warp variants (ws 1 / 2) lost on every point of the H200 probe (session 4 round 1, with the K loop's
    # register-A race, and ws 2's wgmma serialised by ptxas): since session 11 ws 1 (and ws 2 at M <= 64; more
    # near the M = 256 heuristic push the other kernels past --max-candidates 17) on the split-step loop, race-free,
    # ws 2 unserialised on 128-wide tiles with gemm_wna16_tcg.ws2_regs (offline compile only)
    if m <= 64:
        swaps = [(64, 128, 4, 8, 0), (64, 128, 3, 8, 0), (64, 256, 4, 8, 0), (64, 64, 4, 4, 0), (64, 128, 4, 8, 1),
                 (64, 128, 4, 8, 2)]
    else:
        # (256, 128, 2): 256 x rows, all of M = 256 per W tile (correct at 2 stages only: configs.valid_for)
        swaps = [(128, 128, 4, 8, 0), (128, 128, 3, 8, 0), (64, 128, 4, 8, 0), (128, 256, 3, 8, 0),
                 (128, 128, 4, 8, 1), (256, 128, 2, 8, 0)]
    out = []
    for bm, bn, st, w, *sw in tiles + swaps:
        n_tiles = -(-m // bm) * -(-layer.n // bn)
        # split 3 (every M): the 80-tile (70B qkv) and 48-tile (8B qkv) grids fill 1.8 / 1.1 waves at 3, 1.2 / 1.45
        # at 2 / 4 (their M = 64 winners, 0.75x / 0.93x Humming in session 4)
        splits = [sk for sk in (1, 2, 3, 4, 8)
                  if sk == 1 or num_sms // 2 <= n_tiles * sk <= 2 * num_sms]
        extra = {"swap": True, "ws": sw[0]} if sw else {}
        # the split nearest one wave first (the first tcg config is the one --max-candidates surely measures);
        # swap tiles split over K also with the in-kernel reduction (one launch), right after the atomic one
        for sk in sorted(splits, key=lambda sk: abs(math.log2(n_tiles * sk / num_sms))):
            out.append(C("tcg", bm, bn, 0, sk, w, st, **extra))
            if sw and not sw[0] and sk > 1:
                out.append(C("tcg", bm, bn, 0, sk, w, st, **extra, reduce=1))
    return out


def large_m_candidates(layer: LayerConfig, m: int, num_sms: int = 132, gluon: bool = True) -> list[ComputeConfig]:
    """M > 16: the tc tiles, each also split over K while the tiles fill fewer than ~3 CTAs per SM and each split
    keeps >= 8 K steps (M <= 256); up to M = 1024 the Gluon tcg tiles; from M = 256 the dequant + cuBLAS path as
    one pass, and from M = 1024 also as 2-8 column blocks overlapped with the matmul (chunks)."""
    C = ComputeConfig
    steps = -(-layer.k // layer.spec.k_multiple)
    out = []
    for c in tc_configs(m):
        out.append(c)
        tiles = -(-m // c.block_m) * -(-layer.n // c.block_n)
        sk = 2
        while m <= 256 and tiles * sk <= 3 * num_sms and steps // sk >= 8 and sk <= 8:
            out.append(C(**{**c.to_dict(), "split_k": sk}))
            # the in-kernel reduction (one launch instead of zeroed fp32 y + atomics + cast); on 128-row 8-warp
            # tiles its epilogue needs 170 registers, so also capped at 128 to keep two CTAs per SM
            out.append(C(**{**c.to_dict(), "split_k": sk, "reduce": 1}))
            if c.block_m >= 128 and c.num_warps == 8:
                out.append(C(**{**c.to_dict(), "split_k": sk, "reduce": 1, "maxnreg": 128}))
            sk *= 2
    if gluon and m <= 1024:
        out += tcg_configs(layer, m, num_sms)
    if m >= 256:
        out += [C("dequant_mm", 1, 64, 128, 1, 4, 1), C("dequant_mm", 1, 128, 128, 1, 8, 1)]
        if m >= 1024:
            out += [C("dequant_mm", 1, 128, 128, 1, 8, 1, chunks=ch) for ch in (2, 4, 8)]
    return out


def small_m_candidates(layer: LayerConfig, m: int) -> list[ComputeConfig]:
    """M <= 16 (gemm_wna16_small.py): the mv tiles that came within 5 % of the best on some (format, shape, M) of the
    H200 `kestrel tune` run of 2026-12-03 session 3 round 1 (int4 g128 and MXFP4, 4 Llama shapes, M = 1 and 16;
    bench/results/gemm_wna16_smallm.md), split-K 1..16 (32 for the narrow tiles), and for M <= 4 the CUDA-core
    stream kernel (gemm_wna16_stream.py). Narrow tiles (64 or fewer columns per warp) put more warps on each SM
    for the same weight bytes: MXFP4 won with them by up to 25 %. Dropped there (never within 5 %): the CUDA-core
    gemv kernel, mvs, 8-warp tiles, num_stages=1 (register prefetch), block_k=256 on 4-warp tiles; earlier the
    L2-prefetch variants (ComputeConfig.prefetch: 4-40 % slower on every point of the session-2 round-1 sweep)."""
    km = layer.spec.k_multiple
    out = stream_candidates(m)
    narrow = (("mv", 128, 2, 0, 3), ("mv", 128, 1, 0, 3), ("mv", 64, 1, 0, 3), ("mv", 64, 2, 0, 3),
              ("mv", 32, 1, 0, 3))
    wide = (("mv", 128, 2, 0, 4), ("mv", 64, 1, 0, 4), ("mv", 64, 2, 0, 4), ("mv", 128, 4, 0, 3), ("mv", 256, 4, 0, 3),
            ("mv", 128, 2, 2 * km, 3), ("mv", 256, 4, 2 * km, 3))
    for (kern, bn, w, bk, st), sk in itertools.product(narrow + wide, (1, 2, 4, 8, 16)):
        out.append(ComputeConfig(kern, 16, bn, bk, sk, w, st))
    out += [ComputeConfig(kern, 16, bn, bk, 32, w, st) for kern, bn, w, bk, st in narrow]
    # stream-K (session 25, not yet GPU-timed): persistent grids of 1-6 programs per SM on the tiles that won the
    # split-K runs (70B qkv M = 1-16: 22-26 µs flat across split-K tiles, vs Humming's stream-K 20.6-22.3)
    for (kern, bn, w, bk, st), s in itertools.product(STREAMK_TILES, (1, 2, 3, 4, 6)):
        out.append(ComputeConfig(kern, 16, bn, bk, 1, w, st, streamk=s))
    # mvs with block_m 8 (x as the MMA's 8-wide N side) was a candidate at M <= 8 in session 4: on the H200
    # (session 5 round 1, bench/results/gemm_wna16_smallm.md) it was 0.37-0.86x of the tuned default on all 8 Llama
    # shapes, int4 and MXFP4, so it is no longer timed (gemm_wna16_small still runs it when a config asks)
    return out


# mv tiles tried with the stream-K grid (ComputeConfig.streamk): the split-K winners of the H100 session-19 tune
STREAMK_TILES = (("mv", 128, 2, 0, 3), ("mv", 64, 2, 0, 3), ("mv", 128, 4, 0, 3), ("mv", 64, 1, 0, 4))

# stream kernel (gemm_wna16_stream.py) tiles tried at M <= 4: (block_n, num_warps, num_stages). The first two were
# the best of the session-1 sweep (bench/results/gemm_wna16_smallm.md) and won 8B o at M = 1 for int4 and MXFP4 in
# the session-3 `kestrel tune` run; the other two swap their register prefetch (num_stages 2 / 1)
STREAM_TILES = ((64, 1, 2), (128, 1, 1), (64, 1, 1), (128, 1, 2))


def stream_candidates(m: int) -> list[ComputeConfig]:
    """CUDA-core "stream" configs for M <= 4 (one program per <= 4 rows of x; beyond that the tensor-core mv
    kernel reads the weights once for all 16 rows)."""
    if m > 4:
        return []
    bm = 1 << (m - 1).bit_length()  # block_m is a power of two: M = 3 runs as 4 with the last row masked
    return [ComputeConfig("stream", b, bn, 0, sk, w, st) for b in sorted({1, bm}) for (bn, w, st) in STREAM_TILES
            for sk in (8, 16, 32)]


def make_weights(layer: LayerConfig, device, min_bytes: int = 256 << 20, max_copies: int = 8):
    """Several copies of a random quantized weight so timing rotates past the L2 (60 MB on an H200)."""
    w = torch.randn(layer.n, layer.k, device=device, dtype=torch.float32) * 0.02
    qw = quantize(w, layer.spec)
    copies = cold_copies(qw.nbytes, min_bytes, max_copies)
    out = [qw]
    for _ in range(copies - 1):
        out.append(type(qw)(**{**qw.__dict__, "qweight": qw.qweight.clone(), "scales": qw.scales.clone(),
                               "zeros": None if qw.zeros is None else qw.zeros.clone()}))
    return out


def time_config_graph(fn_for_copy, n_copies: int, calls: int = 20, replays: int = 10) -> float:
    """Median µs per call inside a CUDA graph of `calls` calls rotating over the weight copies: what the engine
    (graph mode) sees; do_bench would time the Python launch of few-µs kernels, and of the multi-launch
    dequant + cuBLAS paths, instead."""
    return graph_time_us([lambda i=i: fn_for_copy(i) for i in range(n_copies)], calls=calls, replays=replays)


def fastest(configs, measure, progress=None):
    """-> (fastest config or None, its time, every config's time in order); a config whose measure(cfg) raises
    (the compiler rejects it: shared memory, registers; or it computes something else) counts as inf."""
    best, best_t, times = None, float("inf"), []
    for cfg in configs:
        try:
            t = measure(cfg)
        except Exception:
            t = float("inf")
        times.append(t)
        if t < best_t:
            best, best_t = cfg, t
        if progress is not None:
            progress.update(1)
    return best, best_t, times


def compile_key(layer: LayerConfig, m: int, cfg: ComputeConfig) -> tuple:
    """What decides the Triton specialisations a call compiles (config, format, the EVEN_K / EVEN_N / paired-decode
    flags; M, N, K are runtime ints): calls with equal keys share their kernels, so warming one warms all. The split
    count is a runtime argument (only split > 1 is a constexpr), so configs that differ only there compile once."""
    km = layer.spec.k_multiple
    step = max(km, cfg.block_k) if cfg.kernel == "tc" else km
    cfg = dataclasses.replace(cfg, split_k=min(cfg.split_k, 2))
    return (cfg, layer.spec, layer.k % step == 0, layer.n % cfg.block_n == 0, layer.n % 128 == 0, m <= 16)


def layer_candidates(layer: LayerConfig, m: int, max_candidates: int | None = None,
                     gluon: bool = True) -> list[ComputeConfig]:
    cands = candidates(layer, m, gluon)
    return cands[:max_candidates] if max_candidates else cands


def _warm_one(job) -> tuple:
    """Worker: run one (layer, M, config) call once so its kernels land in Triton's on-disk cache."""
    import time
    layer, m, cfg = job
    t0 = time.time()
    try:
        from kestrel.kernels.gemm_wna16 import gemm_wna16
        dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the interpreter (tests)
        w = quantize(torch.randn(layer.n, layer.k, device=dev) * 0.02, layer.spec)
        gemm_wna16(torch.randn(m, layer.k, device=dev, dtype=torch.bfloat16), w, cfg)
        if dev == "cuda":
            torch.cuda.synchronize()
        return cfg, time.time() - t0, None
    except Exception as ex:  # a config the compiler rejects is timed as inf by the tuner anyway
        return cfg, time.time() - t0, repr(ex)[:200]


def warm_compile(jobs: list[tuple], workers: int, log=print, init=None) -> None:
    """JIT-compile the (layer, M, config) calls of `jobs` in `workers` processes (one per distinct compile_key):
    Triton's compiles (5-30 s each on the H200 host) are CPU-bound and single-threaded, so the timing process
    then only loads cubins from the shared cache instead of compiling one candidate after the other. init: a
    picklable worker initializer (a bench's module switch, e.g. the old tcg swap K loop)."""
    import multiprocessing as mp
    import time
    uniq = list({compile_key(*j): j for j in jobs}.values())
    t0 = time.time()
    with mp.get_context("spawn").Pool(max(1, min(workers, len(uniq))), initializer=init) as pool:
        errors = [err for _, _, err in pool.imap_unordered(_warm_one, uniq) if err]
    log(f"warm-up: {len(uniq)} distinct compiles of {len(jobs)} calls in {time.time() - t0:.1f}s"
        f" with {workers} workers, {len(errors)} failed")


def tune_layer(layer: LayerConfig, ms: list[int], gpu: str, device="cuda", progress=None,
               max_candidates: int | None = None, gluon: bool = True, record=None) -> dict:
    """-> {cache_key: {"config": {...}, "us": t, "heuristic_us": t_h, "previous_us": t_p}} for each M bucket;
    the config in use before (TuningConfig.lookup: tune cache or heuristic) is measured too, so a stored winner is
    never slower than what it replaces. record(key, cfg, us), if given, sees every measured candidate (inf:
    rejected or failed)."""
    from kestrel.kernels.configs import TuningConfig
    from kestrel.kernels.gemm_wna16 import gemm_wna16
    weights = make_weights(layer, device)
    results = {}
    for m in ms:
        x = torch.randn(m, layer.k, device=device, dtype=torch.bfloat16)
        prev = TuningConfig(gpu).lookup(layer, m)
        cands = list(dict.fromkeys([prev] + layer_candidates(layer, m, max_candidates, gluon)))
        # reference: dequant + cuBLAS (x @ dequantize(W)^T in bf16), a code path none of the fused candidates share
        ref = gemm_wna16(x, weights[0], ComputeConfig("dequant_mm", 1, 64, 128, 1, 4, 1)).float()

        def measure(cfg):
            y = gemm_wna16(x, weights[0], cfg).float()  # never store a config that computes something else
            if not ((y - ref).norm() <= 1e-2 * ref.norm()):
                raise ValueError(f"{cfg} disagrees with dequant + cuBLAS")
            return time_config_graph(lambda i: gemm_wna16(x, weights[i], cfg), len(weights))
        best, best_t, times = fastest(cands, measure, progress)
        at = lambda want: next((round(t, 3) for c, t in zip(cands, times) if c == want and t < float("inf")), None)
        if record is not None:
            for c, t in zip(cands, times):
                record(cache_key(gpu, layer, m_bucket(m)), c, t)
        if best is not None:
            results[cache_key(gpu, layer, m_bucket(m))] = {"config": best.to_dict(), "us": round(best_t, 3),
                                                          "heuristic_us": at(heuristic(layer, m)),
                                                          "previous_us": at(prev)}
    return results
