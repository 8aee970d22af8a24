"""Decode (M <= 8) WNA16 A/B on one GPU, same process: the default config (tune cache) against
  - "mvs8": the same tile as the swapped kernel with x as an 8-wide MMA N side (ComputeConfig("mvs", 8, ...)):
    half the MMAs and half the per-group scale FMAs of the 16-row tile (sm_90 SASS: mxfp4 4.32 -> 3.85-3.94,
    int4 2.50 -> 2.33-2.36 thread-instructions per weight element, bench/wna16_mv_sass.py), at a few splits;
  - MXFP4 only, with --fold: FOLD_E8M0 (the e8m0 group scale as the decode multiplier, no per-group accumulator
    FMAs);
  - with --splits: the default tile at other split-K counts (not only powers of 2: fewer idle SMs in the last wave).
Every config is checked against x @ dequant(W)^T (float32) before timing. Timing: CUDA graph of 20 calls rotating
over >= 200 MB of weight copies (L2 cold), median of 10 replays. Kestrel's kernels compile first in worker processes.
Writes $OUT/wna16_mvs8_sweep.json after every shape.

  python bench/wna16_mvs8_sweep.py --ms 1,4 --formats int4,mxfp4
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_timing import copy_bandwidth, shape_weights  # noqa: E402
from kestrel.kernels.timing import graph_time_us  # noqa: E402


def variants(layer, m, gpu, fmt, opts=None):
    """[(tag, config, mode)] for one point. mode: None = the module defaults; "fold" =
    MXFP4 with FOLD_E8M0 (the e8m0 group scale is the decode multiplier: no per-group FMAs on the accumulator, as
    Humming applies its group scales to the dequantized weights). opts: dict(splits=[extra split_k values for the
    default tile], fold=bool, mvs8=bool)."""
    from kestrel.kernels.configs import TuningConfig
    opts = {"splits": [], "fold": False, "mvs8": True, "maxnreg": 0, "alt_m": [],
            "imad": [], "imad_splits": [], "probe": [], "grow": False, "grow2": False, "stages1": False,
            "tiles": [], "spf": False, "fold_tiles": [], "growsw": [], "nofold": False, "stages": [], "ab": [],
            "ab_tiles": [], **(opts or {})}
    dflt = TuningConfig(gpu).lookup(layer, m)
    base = dflt if dflt.kernel in ("mv", "mvs") else dataclasses.replace(dflt, kernel="mv", block_m=16,
                                                                         num_stages=3)
    fp4 = fmt == "mxfp4"
    out = [("dflt", dflt, None)]  # what gemm_wna16 runs by default (tune cache + module switches)
    for am in opts["alt_m"]:  # the tune cache's config of another M (its kernel pads M anyway: the M = 1 winner
        # may beat the M = 16 one that buckets 2-8 inherited)
        c = TuningConfig(gpu).lookup(layer, am)
        if am != m and c != dflt and (c.kernel != "stream" or m <= 4):
            out.append((f"m{am}cfg {c.kernel}{c.block_m} bn{c.block_n} w{c.num_warps} sk{c.split_k}", c, None))
    if fp4 and opts["fold"]:
        out.append(("dflt-fold" if dflt == base else "mv-fold", base, "fold"))
    if fp4 and opts["nofold"]:  # the defaults without FOLD (session 9's), same tile
        out.append(("dflt-nofold" if dflt == base else "mv-nofold", base, "nofold"))
    for bn, w in opts["fold_tiles"] if fp4 else []:  # FOLD_E8M0 (+ SCALE_WORDS) on other tiles, default split
        if (bn, w) != (base.block_n, base.num_warps):
            out.append((f"{base.kernel}{base.block_m} bn{bn} w{w} sk{base.split_k}-fold",
                        dataclasses.replace(base, block_n=bn, num_warps=w), "fold"))
    if fp4:  # the e2m1 decode's bit moves on the FMA pipe (gemm_wna16_small.E2M1_IMAD), alone and with FOLD
        for j, im in enumerate(opts["imad"]):  # (on the mv tile where the default is another kernel)
            out.append((f"{'dflt' if dflt == base else 'mv'}-{im}", base, im))
            for sk in opts["imad_splits"] if j == 0 else []:  # other splits: the first mode only
                if sk != base.split_k:
                    out.append((f"{base.kernel}{base.block_m} bn{base.block_n} w{base.num_warps} sk{sk}-{im}",
                                dataclasses.replace(base, split_k=sk), im))
    if fp4 and opts["grow"] and m <= 4:  # GROUP_ROWS: the 4 scale groups of a block on the tile's spare rows
        out.append((f"{'dflt' if dflt == base else 'mv'}-grow", base, "grow"))
        for sk in sorted({max(1, base.split_k // 2), base.split_k * 2}):
            out.append((f"{base.kernel}{base.block_m} bn{base.block_n} w{base.num_warps} sk{sk}-grow",
                        dataclasses.replace(base, split_k=sk), "grow"))
        for bn, w in ((64, 1), (128, 2)):
            if (bn, w) != (base.block_n, base.num_warps):
                out.append((f"{base.kernel}{base.block_m} bn{bn} w{w} sk{base.split_k}-grow",
                            dataclasses.replace(base, block_n=bn, num_warps=w), "grow"))
    if fp4 and opts["grow2"] and 4 < m <= 8:  # GROUP_ROWS_PARTIAL: 2 of the 4 groups per pass on the spare rows
        out.append((f"{'dflt' if dflt == base else 'mv'}-grow2", base, "grow2"))
        for sk in sorted({max(1, base.split_k // 2), base.split_k * 2}):
            out.append((f"{base.kernel}{base.block_m} bn{base.block_n} w{base.num_warps} sk{sk}-grow2",
                        dataclasses.replace(base, split_k=sk), "grow2"))
        for bn, w in ((64, 1), (128, 2)):
            if (bn, w) != (base.block_n, base.num_warps):
                out.append((f"{base.kernel}{base.block_m} bn{bn} w{w} sk{base.split_k}-grow2",
                            dataclasses.replace(base, block_n=bn, num_warps=w), "grow2"))
    if fp4 and opts["spf"]:  # SCALE_PREFETCH: next block's 4 scale rows loaded during this block
        out.append((f"{'dflt' if dflt == base else 'mv'}-spf", base, "spf"))
        for bn, w in ((64, 1), (128, 2), (128, 4)):  # other tiles (module defaults otherwise)
            if (bn, w) != (base.block_n, base.num_warps):
                out.append((f"{base.kernel}{base.block_m} bn{bn} w{w} sk{base.split_k}-spf",
                            dataclasses.replace(base, block_n=bn, num_warps=w), "spf"))
    if fp4 and opts["growsw"] and m <= 8:  # SCALE_WORDS_GROW: GROUP_ROWS passes read e8m0_words
        out.append((f"{'dflt' if dflt == base else 'mv'}-growsw", base, "growsw"))
        for bn, w in opts["growsw"]:
            if (bn, w) != (base.block_n, base.num_warps):
                out.append((f"{base.kernel}{base.block_m} bn{bn} w{w} sk{base.split_k}-growsw",
                            dataclasses.replace(base, block_n=bn, num_warps=w), "growsw"))
    for mode in opts["ab"]:  # session 11's opt-in switches (AB_MODES, "+"-joined) on the default and the ab tiles
        if set(mode.split("+")) & {"bias", "mul16", "fold-s1"} and not fp4 or "xsum" in mode and fp4:
            continue
        for bn, w in [(base.block_n, base.num_warps)] + [t for t in opts["ab_tiles"]
                                                         if t != (base.block_n, base.num_warps)]:
            c = dataclasses.replace(base, block_n=bn, num_warps=w, num_stages=1 if "fold-s1" in mode else
                                    base.num_stages)
            dtag = "dflt" if c == dflt else f"{c.kernel}{c.block_m} bn{bn} w{w} sk{c.split_k} s{c.num_stages}"
            if c != dflt and not any(cc == c and f is None for _, cc, f in out):  # the defaults on this tile
                out.append((dtag, c, None))  # (s1: the unfolded path of 0ef148d)
            out.append((f"{dtag}-{mode}", c, mode))
    if opts["stages1"] and base.num_stages != 1:  # register prefetch: x through ld.global (L1) not cp.async (L2)
        c = dataclasses.replace(base, num_stages=1)
        out.append((f"{c.kernel}{c.block_m} bn{c.block_n} w{c.num_warps} sk{c.split_k} s1", c, None))
    for st in opts["stages"]:  # other cp.async pipeline depths on the default tile (more bytes in flight)
        if st != base.num_stages:
            c = dataclasses.replace(base, num_stages=st)
            out.append((f"{c.kernel}{c.block_m} bn{c.block_n} w{c.num_warps} sk{c.split_k} s{st}", c, None))
    for bn, w in opts["tiles"]:  # other tiles at the default split (module defaults)
        if (bn, w) != (base.block_n, base.num_warps):
            c = dataclasses.replace(base, block_n=bn, num_warps=w)
            out.append((f"{c.kernel}{c.block_m} bn{bn} w{w} sk{c.split_k}", c, None))
    if fp4:  # cost probes (gemm_wna16_small.PROBE, timing only: WRONG results on purpose) on the mv tile
        for pb in opts["probe"]:
            out.append((f"{'dflt' if dflt == base else 'mv'}-probe{pb}", base, f"probe{pb}"))
    for sk in opts["splits"]:  # split counts need not be powers of 2: fewer idle SMs in the last wave
        if sk != base.split_k:
            c = dataclasses.replace(base, split_k=sk)
            out.append((f"{c.kernel}{c.block_m} bn{c.block_n} w{c.num_warps} sk{sk}", c, None))
    if opts["maxnreg"]:  # a register cap: more CTAs per SM for some spill
        c = dataclasses.replace(base, maxnreg=opts["maxnreg"])
        out.append((f"{c.kernel}{c.block_m} bn{c.block_n} w{c.num_warps} sk{c.split_k} r{c.maxnreg}", c, None))
    if m <= 8 and opts["mvs8"]:
        for sk in sorted({base.split_k, max(1, base.split_k // 2), base.split_k * 2}):
            c = dataclasses.replace(base, kernel="mvs", block_m=8, split_k=sk)
            out.append((f"mvs8 bn{c.block_n} w{c.num_warps} sk{sk}", c, None))
        for bn, w in ((64, 1), (128, 2)):
            if (bn, w) != (base.block_n, base.num_warps):
                c = dataclasses.replace(base, kernel="mvs", block_m=8, block_n=bn, num_warps=w)
                out.append((f"mvs8 bn{bn} w{w} sk{c.split_k}", c, None))
        if fp4:
            c = dataclasses.replace(base, kernel="mvs", block_m=8)
            if opts["fold"]:
                out.append((f"mvs8 bn{c.block_n} w{c.num_warps} sk{c.split_k}-fold", c, "fold"))
    return [(t, c, f) for t, c, f in out if c.valid_for(layer)]


# session 11's opt-in switches of gemm_wna16_small (all off by default), one per A/B mode: "mul16" = FOLD's 16-bit
# pair multipliers at s2 / s3, "bias" = FOLD_BIAS_WORDS (MXFP4), "xsum" = INT_XSUM (ints), "fold-s1" = FOLD at
# num_stages 1 (with MUL16: the session 10 bug's fix, checked for correctness first)
# num_stages 1 (with MUL16: the session 10 bug's fix, checked for correctness first); "pairw" = the weight repacked in
# the pair word order (quant.weight.with_pair_words: a packing option carried on the weight, no module switch;
# int4 and MXFP4, mv / mvs: offline 642 -> 615 / 900 -> 880 K-loop instructions, 147 -> 128 / 168 -> 128 registers);
# "pairadj" = that order with a pair's two words stored next to each other (with_pair_words(adjacent=True): 64-bit
# LDS; offline 642 -> 591 / 900 -> 864)
AB_MODES = {"mul16": "MUL16", "bias": "FOLD_BIAS_WORDS", "xsum": "INT_XSUM", "fold-s1": "FOLD_S1", "pairw": None,
            "pairadj": None}


def pair_mode(mode) -> str:
    """"" = the planar weights; "pairw" / "pairadj" = the variant runs on the pair-order copy of the weights (A/B
    mode alone or "+"-joined; pairadj: adjacent-pair storage)."""
    parts = mode.split("+") if isinstance(mode, str) else []
    return "pairadj" if "pairadj" in parts else "pairw" if "pairw" in parts else ""
AB0: dict = {}


def set_mode(sm, mode, fold0, grow0):
    """Module switches of gemm_wna16_small for one variant's mode (see variants): None = the defaults; "fold" =
    FOLD_E8M0 (E2M1_IMAD as the default); "nofold" = the defaults without FOLD_E8M0 (session 9's: GROUP_ROWS
    (+ PARTIAL), SCALE_PREFETCH); "grow" / "nogrow" = GROUP_ROWS on / off; "grow2" = GROUP_ROWS +
    GROUP_ROWS_PARTIAL; "spf" = the defaults without FOLD + SCALE_PREFETCH; "imadN[-fold]" = E2M1_IMAD N (with FOLD_E8M0; it
    acts with FOLD only); "probeN" = PROBE N (timing only). grow0 = the module's (GROUP_ROWS, GROUP_ROWS_PARTIAL,
    SCALE_PREFETCH, SCALE_WORDS_GROW, E2M1_IMAD) defaults."""
    sm.E2M1_IMAD, sm.PROBE, sm.FOLD_E8M0, sm.GROUP_ROWS, sm.GROUP_ROWS_PARTIAL = grow0[4], 0, False, False, False
    sm.SCALE_PREFETCH, sm.SCALE_WORDS_GROW = False, False
    for name, v in AB0.items():  # session 11's switches: their module defaults unless the mode sets one
        setattr(sm, name, v)
    if mode is not None and all(v in AB_MODES for v in mode.split("+")):  # the defaults + opt-in switches
        sm.FOLD_E8M0, sm.GROUP_ROWS, sm.GROUP_ROWS_PARTIAL, sm.SCALE_PREFETCH = fold0, grow0[0], grow0[1], grow0[2]
        sm.SCALE_WORDS_GROW = grow0[3]
        for v in mode.split("+"):
            if AB_MODES[v]:  # (pairw: the weight, not a module switch)
                setattr(sm, AB_MODES[v], True)
    elif mode is None:
        sm.FOLD_E8M0, sm.GROUP_ROWS, sm.GROUP_ROWS_PARTIAL, sm.SCALE_PREFETCH = fold0, grow0[0], grow0[1], grow0[2]
        sm.SCALE_WORDS_GROW = grow0[3]
    elif mode == "nofold":
        sm.GROUP_ROWS, sm.GROUP_ROWS_PARTIAL, sm.SCALE_PREFETCH = grow0[0], grow0[1], grow0[2]
        sm.SCALE_WORDS_GROW = grow0[3]
    elif mode == "growsw":  # the module defaults without FOLD + GROUP_ROWS (+ PARTIAL) reading e8m0_words
        sm.GROUP_ROWS, sm.GROUP_ROWS_PARTIAL, sm.SCALE_PREFETCH = True, True, grow0[2]
        sm.SCALE_WORDS_GROW = True
    elif mode == "spf":  # the module defaults without FOLD + SCALE_PREFETCH
        sm.GROUP_ROWS, sm.GROUP_ROWS_PARTIAL, sm.SCALE_PREFETCH = grow0[0], grow0[1], True
    elif mode == "fold":
        sm.FOLD_E8M0 = True
    elif mode == "grow":
        sm.GROUP_ROWS = True
    elif mode == "nogrow":
        pass
    elif mode == "grow2":
        sm.GROUP_ROWS, sm.GROUP_ROWS_PARTIAL = True, True
    elif mode.startswith("probe"):
        sm.PROBE = int(mode[5:])
    elif mode.startswith("imad"):
        sm.E2M1_IMAD = int(mode[4])
        sm.FOLD_E8M0 = mode.endswith("-fold")


def compile_key(fmt, cfg, fold):
    """What Triton specialises on here (N, K, M are runtime values; every Llama N and K is a multiple of 128)."""
    return (fmt, cfg.kernel, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.block_k, cfg.split_k > 1,
            cfg.maxnreg, fold)


def warm_jobs(shapes, fmts, ms, gpu, workers, opts=None):
    """One compile per compile key, spread over `workers` jobs [(fmt, n, k, [(m, config dict, fold)])]."""
    from kestrel.kernels.configs import LayerConfig
    from kestrel.kernels.tuning import FORMATS
    seen, items = set(), []
    for _, (n, k) in shapes:
        for fmt in fmts:
            for m in ms:
                for _, cfg, fold in variants(LayerConfig(FORMATS[fmt], n, k), m, gpu, fmt, opts):
                    key = compile_key(fmt, cfg, fold)
                    if key not in seen:
                        seen.add(key)
                        items.append((fmt, n, k, m, cfg.to_dict(), fold))
    jobs = [[] for _ in range(max(1, workers))]
    for i, it in enumerate(items):
        jobs[i % len(jobs)].append(it)
    return [j for j in jobs if j]


def _warm(items):
    from kestrel.kernels import gemm_wna16_small as sm
    from kestrel.kernels.configs import ComputeConfig
    from kestrel.kernels.gemm_wna16 import gemm_wna16
    from kestrel.kernels.tuning import FORMATS
    from kestrel.quant import quantize
    t0, errs, fold0, qws = time.time(), [], sm.FOLD_E8M0, {}
    grow0 = (sm.GROUP_ROWS, sm.GROUP_ROWS_PARTIAL, sm.SCALE_PREFETCH, sm.SCALE_WORDS_GROW, sm.E2M1_IMAD)
    AB0.update({v: getattr(sm, v) for v in AB_MODES.values() if v})
    from kestrel.quant.weight import with_pair_words
    for fmt, n, k, m, cfg, fold in items:
        # a small stand-in weight: N, K are runtime values (multiples of 16 / 128 like every Llama shape), so the
        # kernels are the same; full-size weights in 12 workers ran the H200 out of memory (session 4 round 2)
        n, k = 256, 1024
        if (fmt, n, k) not in qws:
            qws[(fmt, n, k)] = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, FORMATS[fmt])
        set_mode(sm, fold, fold0, grow0)
        try:
            q = qws[(fmt, n, k)]
            gemm_wna16(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                       with_pair_words(q, pair_mode(fold) == "pairadj") if pair_mode(fold) else q,
                       ComputeConfig.from_dict(cfg))
        except Exception as ex:
            errs.append(f"{fmt} {cfg}: {ex!r}"[:200])
    torch.cuda.synchronize()
    return len(items), time.time() - t0, errs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,4")
    ap.add_argument("--formats", default="int4,mxfp4")
    ap.add_argument("--models", default="llama3-8b,llama3-70b")
    ap.add_argument("--layers", default=None, help="keep only these layers, in this order (e.g. llama3-70b:o)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=60)
    ap.add_argument("--humming", default="", help="also time Humming (same format) at these points, comma list of "
                    "fmt:layer (its first call JIT-compiles for ~10 s)")
    ap.add_argument("--splits", default="", help="extra split_k values for the default tile, e.g. 3,5,6,12")
    ap.add_argument("--fold", action="store_true", help="also MXFP4 with FOLD_E8M0 (default tile, mvs8)")
    ap.add_argument("--fold-tiles", default="", help="MXFP4: also FOLD_E8M0 on these BLOCK_N:warps tiles at the "
                    "default split, e.g. 64:1,128:2,128:4")
    ap.add_argument("--growsw", default="", help="MXFP4, M <= 8: also GROUP_ROWS reading e8m0_words "
                    "(SCALE_WORDS_GROW) on the default tile and these BLOCK_N:warps tiles, e.g. 64:1,128:2")
    ap.add_argument("--stages", default="", help="also the default tile with these num_stages, e.g. 4,5")
    ap.add_argument("--nofold", action="store_true", help="MXFP4: also the default tile without FOLD_E8M0")
    ap.add_argument("--no-mvs8", action="store_true", help="no mvs block_m 8 variants")
    ap.add_argument("--maxnreg", type=int, default=0, help="also the default tile with this register cap")
    ap.add_argument("--alt-m", default="", help="also the tune cache's config for these M (e.g. 1)")
    ap.add_argument("--imad", default="", help="MXFP4: also the default tile with these E2M1_IMAD modes, e.g. "
                    "imad1,imad2,imad2-fold")
    ap.add_argument("--imad-splits", default="", help="... and the first of them with these split_k values")
    ap.add_argument("--grow", action="store_true", help="MXFP4, M <= 4: also GROUP_ROWS on the mv tile (+ splits)")
    ap.add_argument("--grow2", action="store_true", help="MXFP4, 4 < M <= 8: also GROUP_ROWS_PARTIAL (+ splits, "
                    "tiles)")
    ap.add_argument("--spf", action="store_true", help="MXFP4: also SCALE_PREFETCH (default tile + 3 tiles)")
    ap.add_argument("--stages1", action="store_true", help="also the default tile with num_stages=1")
    ap.add_argument("--tiles", default="", help="also the default tile's split with these BLOCK_N:warps, e.g. "
                    "128:2,256:4")
    ap.add_argument("--probe", default="", help="MXFP4: also the mv tile with these gemm_wna16_small.PROBE cost "
                    "probes (timing only, results WRONG on purpose), e.g. 1,2,4,5")
    ap.add_argument("--ab", default="", help="also these opt-in switches (" + ",".join(AB_MODES) + "; '+' joins "
                    "several, e.g. fold-s1+bias) on the default tile (fold-s1: at num_stages 1), each next to the "
                    "defaults on the same tile")
    ap.add_argument("--ab-tiles", default="", help="... and on these BLOCK_N:warps tiles, e.g. 64:1,128:2,128:4")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    from kestrel.kernels import gemm_wna16_small as sm
    from kestrel.kernels.configs import LayerConfig
    from kestrel.kernels.gemm_wna16 import gemm_wna16
    from kestrel.kernels.tuning import FORMATS, MODEL_SHAPES
    gpu = torch.cuda.get_device_name()
    fold0 = sm.FOLD_E8M0
    grow0 = (sm.GROUP_ROWS, sm.GROUP_ROWS_PARTIAL, sm.SCALE_PREFETCH, sm.SCALE_WORDS_GROW, sm.E2M1_IMAD)
    AB0.update({v: getattr(sm, v) for v in AB_MODES.values() if v})
    from kestrel.quant.weight import with_pair_words
    opts = {"splits": [int(v) for v in args.splits.split(",") if v], "fold": args.fold,
            "mvs8": not args.no_mvs8, "maxnreg": args.maxnreg,
            "alt_m": [int(v) for v in args.alt_m.split(",") if v],
            "imad": [v for v in args.imad.split(",") if v],
            "imad_splits": [int(v) for v in args.imad_splits.split(",") if v],
            "probe": [int(v) for v in args.probe.split(",") if v], "grow": args.grow, "grow2": args.grow2,
            "stages1": args.stages1, "spf": args.spf,
            "fold_tiles": [tuple(int(u) for u in v.split(":")) for v in args.fold_tiles.split(",") if v],
            "growsw": [tuple(int(u) for u in v.split(":")) for v in args.growsw.split(",") if v],
            "nofold": args.nofold, "stages": [int(v) for v in args.stages.split(",") if v],
            "tiles": [tuple(int(u) for u in v.split(":")) for v in args.tiles.split(",") if v],
            "ab": [v for v in args.ab.split(",") if v],
            "ab_tiles": [tuple(int(u) for u in v.split(":")) for v in args.ab_tiles.split(",") if v]}
    fmts, ms = args.formats.split(","), [int(v) for v in args.ms.split(",")]
    shapes = [(f"{mo}:{name}", nk) for mo in args.models.split(",")
              for name, nk in zip(("qkv", "o", "gate_up", "down"), MODEL_SHAPES[mo])]
    if args.layers:
        by = dict(shapes)
        shapes = [(s, by[s]) for s in args.layers.split(",") if s in by]
    import multiprocessing as mp
    with mp.get_context("spawn").Pool(args.workers) as pool:
        try:
            for cnt, t, errs in pool.map_async(_warm, warm_jobs(shapes, fmts, ms, gpu, args.workers, opts)).get(
                    timeout=args.budget_s / 2):
                print(f"warm {cnt} kernels: {t:.1f}s {errs if errs else ''}", flush=True)
        except mp.TimeoutError:
            print("warm-up cut at half the budget", flush=True)
    print(f"warm-up {time.time() - t_start:.1f}s", flush=True)
    copy_bw = copy_bandwidth()["rw_TBps"]
    print(f"D2D copy: {copy_bw:.3f} TB/s", flush=True)
    meta = {"gpu": gpu, "copy_TBps": copy_bw, "command": "python " + " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    rows, entries = [], {"dflt": {}, "fold1": {}, "imad2": {}, "grow1": {}, "grow2": {}, "spf": {}, "growsw": {},
                         **{m: {} for m in opts["ab"]}}

    def dump():
        json.dump({**meta, "rows": rows, "wall_s": time.time() - t_start},
                  open(os.path.join(args.out, "wna16_mvs8_sweep.json"), "w"), indent=0)
        # tune-cache entries (bench/merge_tune_cache.py) where a config beat the
        # default by > 2 % at the measured M (its bucket only)
        for tag, ent in entries.items():
            json.dump(ent, open(os.path.join(args.out, f"wna16_mvs8_tune_entries_{tag}.json"), "w"), indent=1)
    for name, (n, k) in shapes:
        for fmt in fmts:
            if rows and time.time() - t_start > args.budget_s:
                print(f"budget reached: skip {fmt} {name}", flush=True)
                continue
            w0, qw0, qws, deq = shape_weights(FORMATS[fmt], n, k)
            pw = {}  # pair-order copies of qw0, qws by A/B storage ("pairw", "pairadj"), built on first use
            layer = LayerConfig(FORMATS[fmt], n, k)
            hum = None
            if f"{fmt}:{name}" in args.humming.split(","):
                try:
                    from gemm_wna16 import build_humming  # bench/gemm_wna16.py: same format spelling
                    t0 = time.time()
                    hum = [build_humming(fmt, w0 * (1 + 1e-3 * i), max(ms))[0] for i in range(len(qws))]
                    hum[0](torch.randn(1, k, device="cuda", dtype=torch.bfloat16))
                    print(f"humming {fmt} {name}: built + first call {time.time() - t0:.1f}s "
                          f"({getattr(hum[0], 'n_kernels', 'all')} M-interval kernels)", flush=True)
                except Exception as ex:
                    print(f"humming {fmt} {name} failed: {ex!r}"[:300], flush=True)
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ deq.t()
                line, d_us = f"{fmt:5s} {name:18s} M={m:<2d}", None
                if hum is not None:
                    try:  # Humming quantizes w0 itself: its error vs the float weight is informative only
                        h_us = graph_time_us([lambda L=L: L(x) for L in hum], calls=20, replays=10)
                        yf = x.float() @ w0.float().t()
                        rows.append(dict(fmt=fmt, layer=name, N=n, K=k, M=m, tag="humming", config=None, fold=None,
                                         us=h_us, err_vs_float=((hum[0](x).float() - yf).norm() / yf.norm()).item(),
                                         err=float("nan"), pct_copy=100 * qw0.nbytes / (h_us * 1e-6) / 1e12 / copy_bw))
                        line += f" | humming {h_us:.2f}"
                    except Exception as ex:
                        print(f"humming call failed: {ex!r}"[:300], flush=True)
                for tag, cfg, fold in variants(layer, m, gpu, fmt, opts):
                    set_mode(sm, fold, fold0, grow0)
                    pk = pair_mode(fold)
                    if pk and pk not in pw:  # the pair-order copies, once per shape and storage (same codes)
                        pw[pk] = [with_pair_words(q, pk == "pairadj") for q in [qw0] + qws]
                    w_one, w_all = (pw[pk][0], pw[pk][1:]) if pk else (qw0, qws)
                    try:
                        y = gemm_wna16(x, w_one, cfg)
                        err = ((y.float() - ref).norm() / ref.norm()).item()
                        us = graph_time_us([lambda q=q: gemm_wna16(x, q, cfg) for q in w_all], calls=20, replays=10)
                    except Exception as ex:
                        print(f"fail {tag} {fmt} {name} M={m}: {ex!r}"[:300], flush=True)
                        continue
                    if not err < 1e-2 and not (isinstance(fold, str) and fold.startswith("probe")):
                        print(f"WRONG RESULT {tag} {fmt} {name} M={m}: rel err {err:.3g}", flush=True)
                    d_us = us if tag == "dflt" else d_us
                    rows.append(dict(fmt=fmt, layer=name, N=n, K=k, M=m, tag=tag, config=cfg.to_dict(),
                                     fold=fold, us=us, err=err, pct_copy=100 * qw0.nbytes / (us * 1e-6) / 1e12 / copy_bw))
                    line += f" | {tag} {us:.2f}" + (f" ({d_us / us:.3f}x)" if tag != "dflt" and d_us else "")
                set_mode(sm, None, fold0, grow0)
                pt = [r for r in rows if (r["fmt"], r["layer"], r["M"]) == (fmt, name, m) and r["err"] < 1e-2
                      and r["tag"] != "humming"]
                dr = [r for r in pt if r["tag"] == "dflt"]
                from kestrel.kernels.configs import cache_key, m_bucket
                for tag_e, modes in (("dflt", (None,)), ("fold1", (None, "fold")),
                                     ("imad2", (None, "imad2")), ("grow1", (None, "grow")),
                                     ("grow2", (None, "grow2")), ("spf", (None, "spf")),
                                     ("growsw", (None, "growsw")),
                                     *((m, (None, m)) for m in opts["ab"] if not pair_mode(m))):
                    # (no entries for pairw / pairadj: a tune-cache config cannot carry the weight's packing)
                    # entries for the module defaults, FOLD_E8M0 / E2M1_IMAD 2 / GROUP_ROWS / + PARTIAL on
                    best = min((r for r in pt if r["fold"] in modes), key=lambda r: r["us"], default=None)
                    if dr and best is not None and best["us"] < 0.98 * dr[0]["us"]:
                        entries[tag_e][cache_key(gpu, layer, m_bucket(m))] = {
                            "config": best["config"], "us": round(best["us"], 3), "previous_us": round(dr[0]["us"], 3),
                            "measured": f"{meta['date']} bench/wna16_mvs8_sweep.py ({best['tag']})"}
                print(line, flush=True)
            del w0, qw0, qws, deq, hum, pw
            torch.cuda.empty_cache()
            dump()
    dump()
    print(f"wall {time.time() - t_start:.1f}s")


if __name__ == "__main__":
    main()
