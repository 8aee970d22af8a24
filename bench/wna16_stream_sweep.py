"""Decode (M <= 16) WNA16 sweep on one GPU: the "stream" kernel's configs vs the current default (tuned/heuristic) and
Humming (same format, same process), Llama-3 8B/70B linear shapes.

Every config is checked against x @ dequant(W)^T (float32) before it is timed. Timing: CUDA graph of 20 calls
rotating over >= 200 MB of weight copies (L2 cold), median of 10 replays (kestrel.kernels.timing). TB/s = packed
weight bytes (codes + scales) / time, against a 4 GiB device copy measured in the same process. Compiles every
stream variant first in parallel worker processes (the timing process then hits Triton's on-disk cache).
Writes $OUT/wna16_stream_sweep.json (every row) and prints per (shape, M) the best stream config and the ratios.

  python bench/wna16_stream_sweep.py --ms 1,2,4 --formats int4
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_timing import copy_bandwidth, shape_weights  # noqa: E402
from kestrel.kernels.timing import graph_time_us  # noqa: E402

# (block_m, block_n, num_warps, num_stages): num_stages 2 = register prefetch of the next block, 1 = none
VARIANTS = [(1, 128, 1, 2), (1, 128, 1, 1), (1, 256, 2, 2), (1, 512, 4, 2), (1, 64, 1, 2), (1, 128, 2, 2),
            (2, 128, 1, 1), (2, 256, 2, 1), (4, 128, 1, 1), (4, 256, 2, 1)]
SPLITS = (1, 2, 4, 8, 16, 32)
HUMMING = {"int4": [{"dtype": "int4", "group_size": 128}],  # spellings tried in order (as bench/gemm_wna16.py)
           "mxfp4": [{"dtype": "float4e2m1", "group_size": 32, "scale_dtype": "float8e8m0"},
                     {"dtype": "float4e2m1", "group_size": 32}]}


def cfg_of(v, split):
    from kestrel.kernels.configs import ComputeConfig
    bm, bn, w, st = v
    return ComputeConfig("stream", bm, bn, 0, split, w, st)


def _warm(job):
    """Worker: compile one (variant, split > 1?, format) on a small shape with the same specialisation."""
    v, split, fmt, pdl = job
    import torch
    from kestrel.kernels import gemm_wna16_small
    from kestrel.kernels.gemm_wna16 import gemm_wna16
    gemm_wna16_small.PDL = pdl
    from kestrel.kernels.tuning import FORMATS
    from kestrel.quant import quantize
    t0 = time.time()
    try:
        qw = quantize(torch.randn(512, 2048, device="cuda") * 0.02, FORMATS[fmt])
        x = torch.randn(v[0], 2048, device="cuda", dtype=torch.bfloat16)
        gemm_wna16(x, qw, cfg_of(v, split))
        torch.cuda.synchronize()
        return job, time.time() - t0, None
    except Exception as ex:
        return job, time.time() - t0, repr(ex)[:300]


def _warm_humming(job):
    """Worker: JIT-compile Humming's kernels for one (format, N, K) and these M (its cubin cache is on disk, so the
    timing process then builds the layer in a fraction of the ~11 s a cold first call takes)."""
    fmt, n, k, ms = job
    import torch
    t0 = time.time()
    try:
        layer = build_humming(fmt, torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        for m in ms:
            layer(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
        return job, time.time() - t0, None
    except Exception as ex:
        return job, time.time() - t0, repr(ex)[:300]


def build_humming(fmt, w):
    from humming.layer import HummingLayer
    last = None
    for cfg in HUMMING[fmt]:
        try:
            layer = HummingLayer(shape_n=w.shape[0], shape_k=w.shape[1], weight_config=dict(cfg),
                                 torch_dtype=torch.bfloat16).cuda()
            layer.load_from_unquantized(w)
            layer.transform()
            return layer
        except Exception as ex:
            last = ex
    raise last


def graph_outputs_err(fn, ref, calls: int = 8) -> float:
    """Worst relative error of `calls` back-to-back calls captured in one CUDA graph and replayed twice: with
    programmatic dependent launch neighbouring calls overlap, so a race on the split-K workspace would show here."""
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        fn()
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [fn() for _ in range(calls)]
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    return max(((y.float() - ref).norm() / ref.norm()).item() for y in outs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,2,4")
    ap.add_argument("--formats", default="int4")
    ap.add_argument("--models", default="llama3-8b,llama3-70b")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--no-humming", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    from kestrel.kernels import gemm_wna16_small
    from kestrel.kernels.configs import ComputeConfig, LayerConfig, TuningConfig
    from kestrel.kernels.gemm_wna16 import gemm_wna16
    from kestrel.kernels.tuning import FORMATS, MODEL_SHAPES

    fmts = args.formats.split(",")
    import multiprocessing as mp
    jobs = [(v, s, f, False) for f in fmts for v in VARIANTS for s in (1, 2)] + [
        (v, 2, f, True) for f in fmts for v in VARIANTS[:4]]
    ms = [int(v) for v in args.ms.split(",")]
    hjobs = [] if args.no_humming else [(f, n, k, ms) for f in fmts if f in HUMMING for mo in args.models.split(",")
                                         for n, k in MODEL_SHAPES[mo]]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        hres = pool.map_async(_warm_humming, hjobs)
        warm = pool.map(_warm, jobs)
        for job, t, err in hres.get():
            print(f"humming warm {job[:3]}: {t:.1f}s {err or ''}", flush=True)
    broken = set()
    for (v, s, f, pdl), t, err in warm:
        if err:
            broken.add((v, s > 1, f, pdl))
            print(f"compile/run failed {f} {v} split={s}: {err}", flush=True)
    print(f"compiled {len(jobs)} kernels in {time.time() - t_start:.1f}s", flush=True)
    copy_bw = copy_bandwidth()["rw_TBps"]
    print(f"D2D copy: {copy_bw:.3f} TB/s", flush=True)
    gpu = torch.cuda.get_device_name()
    res, summary = [], []
    dump = lambda rows: json.dump(
        {"gpu": gpu, "copy_TBps": copy_bw, "torch": torch.__version__, "rows": rows,
         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": "python " + " ".join(sys.argv),
         "wall_s": time.time() - t_start}, open(os.path.join(args.out, "wna16_stream_sweep.json"), "w"), indent=0)
    for fmt in fmts:
        spec = FORMATS[fmt]
        for model in args.models.split(","):
            for n, k in MODEL_SHAPES[model]:
                if res and time.time() - t_start > args.budget_s:
                    print(f"budget reached: skip {fmt} {n}x{k}", flush=True)
                    continue
                w0, qw0, qws, deq = shape_weights(spec, n, k)
                wbytes = qw0.nbytes
                hum = None
                if not args.no_humming and fmt in HUMMING:
                    t0 = time.time()
                    try:
                        hum = [build_humming(fmt, w0)]
                        hum += [build_humming(fmt, w0 * (1 + 1e-3 * i)) for i in range(1, min(len(qws), 8))]
                    except Exception as ex:
                        print(f"humming {fmt} {n}x{k} failed: {ex!r}"[:300], flush=True)
                        hum = None
                    print(f"humming {fmt} {n}x{k}: built in {time.time() - t0:.1f}s", flush=True)
                k_blocks = -(-k // spec.k_multiple)
                layer = LayerConfig(spec, n, k)
                for m in ms:
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    ref = x.float() @ deq.t()
                    rel = lambda y: ((y.float() - ref).norm() / ref.norm()).item()
                    base = dict(fmt=fmt, N=n, K=k, M=m, w_bytes=wbytes)
                    gemm_wna16_small.PDL = False  # the sweep itself without programmatic dependent launch
                    dflt = TuningConfig(gpu).lookup(layer, m)
                    d_err = rel(gemm_wna16(x, qw0))
                    d_us = graph_time_us([lambda q=q: gemm_wna16(x, q) for q in qws], calls=20, replays=10)
                    res.append({**base, "kind": "default", "config": dflt.to_dict(), "us": d_us, "err": d_err})
                    h_us = None
                    if hum is not None:
                        try:
                            h_us = graph_time_us([lambda L=L: L(x) for L in hum], calls=20, replays=10)
                            res.append({**base, "kind": "humming", "us": h_us})
                        except Exception as ex:
                            print(f"humming call failed: {ex!r}"[:300], flush=True)
                    rows = []
                    for v in VARIANTS:
                        if v[0] > m or (m % v[0] and v[0] != 4):
                            continue
                        for split in SPLITS:
                            ctas = -(-n // v[1]) * split * -(-m // v[0])
                            if (k_blocks // split < 2 or (v, split > 1, fmt, False) in broken or ctas < 100
                                    or ctas > 16384):
                                continue
                            cfg = cfg_of(v, split)
                            try:
                                err = rel(gemm_wna16(x, qw0, cfg))
                                us = graph_time_us([lambda q=q: gemm_wna16(x, q, cfg) for q in qws], calls=20,
                                                   replays=10)
                            except Exception as ex:
                                print(f"fail {v} {split} {n}x{k} M={m}: {ex!r}"[:300], flush=True)
                                continue
                            rows.append({**base, "kind": "stream", "config": cfg.to_dict(), "us": us, "err": err})
                    res += rows
                    # programmatic dependent launch on: the default and the best stream config again
                    pdl_line = ""
                    gemm_wna16_small.PDL = True
                    okr = [r for r in rows if r["err"] < 1e-2]
                    for kind, cfg in [("default_pdl", None)] + ([("stream_pdl", ComputeConfig.from_dict(
                            min(okr, key=lambda r: r["us"])["config"]))] if okr else []):
                        try:
                            fn = lambda: gemm_wna16(x, qw0, cfg)
                            err = max(rel(fn()), graph_outputs_err(fn, ref))
                            us = graph_time_us([lambda q=q: gemm_wna16(x, q, cfg) for q in qws], calls=20, replays=10)
                            res.append({**base, "kind": kind, "config": (cfg or dflt).to_dict(), "us": us, "err": err})
                            pdl_line += f" | {kind} {us:7.2f} us err {err:.3g}"
                        except Exception as ex:
                            pdl_line += f" | {kind} failed {ex!r}"[:200]
                    gemm_wna16_small.PDL = False
                    bad = [r for r in rows if not r["err"] < 1e-2]
                    if bad or not d_err < 1e-2:
                        print(f"WRONG RESULTS {fmt} {n}x{k} M={m}: default {d_err:.3g}, "
                              f"{[(r['config']['block_n'], r['config']['split_k'], r['err']) for r in bad][:6]}")
                    ok = [r for r in rows if r["err"] < 1e-2]
                    tb = lambda us: wbytes / (us * 1e-6) / 1e12
                    line = (f"{fmt} {n:6d}x{k:<6d} M={m:<2d} default {dflt.kernel} bn{dflt.block_n} w{dflt.num_warps} "
                            f"sk{dflt.split_k}: {d_us:7.2f} us ({100 * tb(d_us) / copy_bw:3.0f}%)")
                    if ok:
                        b = min(ok, key=lambda r: r["us"])
                        c = b["config"]
                        line += (f" | stream bm{c['block_m']} bn{c['block_n']} w{c['num_warps']} st{c['num_stages']} "
                                 f"sk{c['split_k']}: {b['us']:7.2f} us ({100 * tb(b['us']) / copy_bw:3.0f}%, "
                                 f"x default {d_us / b['us']:.2f})")
                    if h_us:
                        line += f" | humming {h_us:7.2f} us ({100 * tb(h_us) / copy_bw:3.0f}%)"
                        line += f" x hum: default {h_us / d_us:.2f}" + (f" stream {h_us / b['us']:.2f}" if ok else "")
                    line += pdl_line
                    print(line, flush=True)
                    summary.append(line)
                del qws, deq, w0, hum
                torch.cuda.empty_cache()
                print(f"[{time.time() - t_start:.0f}s] done {fmt} {n}x{k}", flush=True)
                dump(res)  # after every shape: a step timeout keeps what was measured
    print("\n".join(["SUMMARY"] + summary))
    dump(res)
    print(f"wall {time.time() - t_start:.1f}s")


if __name__ == "__main__":
    main()
