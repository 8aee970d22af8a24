"""Small-M WNA16 sweep on one GPU: kernel variants x configs x split-K on the Llama-3 8B/70B linear shapes, one process.

Compiles every variant first in parallel worker processes (Triton's on-disk cache is then warm for the timing
process), then times each (variant, split) with a CUDA graph of 10 calls rotating over >= 200 MB of weight copies.
Prints per (shape, M) the best of each kernel family, TB/s of packed weight bytes, % of the measured copy
bandwidth and the ratio to Humming's time from a previous run (--humming-json, same GPU); writes all timings to
$OUT/gemv_sweep.json.

  python bench/gemv_sweep.py --ms 1,4,16
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_timing import copy_bandwidth, shape_weights  # noqa: E402
from kestrel.kernels.timing import graph_time_us  # noqa: E402

def _variants():
    """(kernel, block_n, warps, stages, block_k) of every small-M tuning candidate (tuning.small_m_candidates)."""
    from kestrel.kernels.configs import LayerConfig
    from kestrel.kernels.tuning import FORMATS, small_m_candidates
    layer = LayerConfig(FORMATS["int4"], 8192, 8192)
    seen = {}
    for m in (1, 16):
        for c in small_m_candidates(layer, m):
            seen[(c.kernel, c.block_n, c.num_warps, c.num_stages, c.block_k)] = None
    return list(seen)


VARIANTS = _variants()
SPLITS = (1, 2, 4, 8, 16, 32)


def cfg_of(v, split):
    from kestrel.kernels.configs import ComputeConfig
    kern, bn, w, st, bk = v
    return ComputeConfig(kern, 1 if kern == "gemv" else 16, bn, bk, split, w, st)


def _warm_humming(shape):
    """Worker: JIT-compile Humming's int4 g128 kernels for one (N, K) (its cubin cache is on disk)."""
    import torch
    t0 = time.time()
    try:
        from humming.layer import HummingLayer
        n, k = shape
        layer = HummingLayer(shape_n=n, shape_k=k, weight_config={"dtype": "int4", "group_size": 128},
                             torch_dtype=torch.bfloat16).cuda()
        layer.load_from_unquantized(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        layer.transform()
        for m in (1, 4, 16):
            layer(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
        return shape, time.time() - t0, None
    except Exception as ex:
        return shape, time.time() - t0, repr(ex)[:300]


def _warm(job):
    """Worker: compile one (variant, split>1) by running it on a small shape with the same specialisation."""
    v, split, fmt = job
    import torch
    from kestrel.kernels.gemm_wna16 import gemm_wna16
    from kestrel.kernels.tuning import FORMATS
    from kestrel.quant import quantize
    t0 = time.time()
    try:
        qw = quantize(torch.randn(512, 2048, device="cuda") * 0.02, FORMATS[fmt])
        x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
        gemm_wna16(x, qw, cfg_of(v, split))
        torch.cuda.synchronize()
        return v, split, time.time() - t0, None
    except Exception as ex:
        return v, split, time.time() - t0, repr(ex)[:300]


def _check(job):
    """Worker: correctness on the GPU (inline-PTX decode, split-K counters) for a format / dtype / kernel."""
    fmt, dtype, kern, split = job
    import torch
    from kestrel.kernels.configs import ComputeConfig
    from kestrel.kernels.gemm_wna16 import gemm_wna16
    from kestrel.kernels.tuning import FORMATS
    from kestrel.quant import dequantize, quantize
    try:
        qw = quantize(torch.randn(1000, 2176, device="cuda") * 0.02, FORMATS[fmt])  # 17 blocks: KB=2 tails
        errs = []
        for m in (1, 5, 16):
            x = torch.randn(m, 2176, device="cuda", dtype=getattr(torch, dtype))
            ref = x.double() @ dequantize(qw).double().t()
            bk = 2 * FORMATS[fmt].k_multiple if kern.endswith("2") else 0
            kern = kern.rstrip("2")
            cfg = ComputeConfig(kern, 1 if kern == "gemv" else 16, 64, bk, split, 4, 3)
            for _ in range(2):  # twice: the split-K counters must be back at zero
                y = gemm_wna16(x, qw, cfg) if (kern != "gemv" or m == 1) else None
            if y is not None:
                errs.append(((y.double() - ref).norm() / ref.norm()).item())
        return job, errs, None
    except Exception as ex:
        return job, None, repr(ex)[:300]


def graph_us(fns) -> float:
    """median µs per call of a CUDA graph of 10 calls rotating over fns, 10 replays."""
    return graph_time_us(fns, calls=10, replays=10)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--format", default="int4")
    ap.add_argument("--models", default="llama3-8b,llama3-70b")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--humming-json", default="bench/results/gemm_wna16_int4.json")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--dry", action="store_true", help="CPU smoke run of the script (TRITON_INTERPRET=1, tiny shape)")
    ap.add_argument("--warm-only", action="store_true",
                    help="only compile the kestrel candidates (and with --humming, Humming's kernels) in parallel")
    ap.add_argument("--humming", action="store_true", help="also JIT-compile Humming for the shapes (warm-only)")
    ap.add_argument("--no-checks", action="store_true", help="skip the GPU correctness checks")
    args = ap.parse_args()
    dev = "cpu" if args.dry else "cuda"
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    from kestrel.kernels.configs import LayerConfig
    from kestrel.kernels.gemm_wna16 import gemm_wna16
    from kestrel.kernels.tuning import FORMATS, MODEL_SHAPES

    # 1. compile everything in parallel (a spawned process per worker; the timing process then hits the cache)
    import multiprocessing as mp
    jobs = [(v, s, args.format) for v in VARIANTS for s in (1, 2)]
    if args.dry:
        warm = []
    else:
        pool = mp.get_context("spawn").Pool(args.workers)
        hum_jobs = ([nk for mm in args.models.split(",") for nk in MODEL_SHAPES[mm]] if args.humming else [])
        hum_res = pool.map_async(_warm_humming, hum_jobs)
        warm = pool.map(_warm, jobs)
        for shape, t, err in hum_res.get():
            print(f"humming warm {shape}: {t:.1f}s {err or ''}", flush=True)
        checks = [] if (args.no_checks or args.warm_only) else [(f, d, kern, sk) for f in ("int4", "uint4-zp", "int8", "mxfp4", "nvfp4", "int2")
                  for d in ("bfloat16", "float16") for kern in ("mv", "mvs", "gemv", "mv2", "gemv2") for sk in (1, 3)
                  if f in ("int4", "uint4-zp") or (d == "bfloat16" and sk == 3)]
        for job, errs, err in pool.map(_check, checks):
            flag = "OK " if errs is not None and max(errs) < 1e-2 else "BAD"
            print(f"check {flag} {job}: rel err {errs} {err or ''}", flush=True)
        pool.close()
        pool.join()
    broken = {(v, s > 1) for v, s, _, err in warm if err}
    for v, s, t, err in warm:
        if err:
            print(f"compile/run failed {v} split={s}: {err}", flush=True)
    print(f"compiled {len(jobs)} kernels in {time.time() - t_start:.1f}s", flush=True)
    if args.warm_only:
        return
    copy_bw = 1.0 if args.dry else copy_bandwidth()["rw_TBps"]
    print(f"D2D copy: {copy_bw:.3f} TB/s", flush=True)

    hum = {}
    try:
        for r in json.load(open(args.humming_json))["rows"]:
            hum[(r["N"], r["K"], r["M"])] = (r.get("humming_us"), r.get("kestrel_us"))
    except OSError:
        pass
    spec = FORMATS[args.format]
    ms = [int(v) for v in args.ms.split(",")]
    shapes = [(64, 1024)] if args.dry else [nk for m in args.models.split(",") for nk in MODEL_SHAPES[m]]
    res = []
    summary = []
    for n, k in shapes:
        if time.time() - t_start > args.budget_s:
            print(f"budget reached: skip {n}x{k}", flush=True)
            continue
        w0, qw0, qws, deq = shape_weights(spec, n, k, dtype=torch.float32, device=dev)
        wbytes = qw0.nbytes
        k_blocks = -(-k // spec.k_multiple)
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ deq.t()
            rows = []
            for v in (VARIANTS[::6] if args.dry else VARIANTS):
                if v[0] == "gemv" and m > 1:
                    continue
                for split in SPLITS:
                    ctas = -(-n // v[1]) * split * (m if v[0] == "gemv" else 1)
                    if k_blocks // split < 2 or (v, split > 1) in broken or ctas < 60 or ctas > 8192:
                        continue
                    cfg = cfg_of(v, split)
                    try:
                        y = gemm_wna16(x, qw0, cfg)
                        err = ((y.float() - ref).norm() / ref.norm()).item()
                        us = 1.0 if args.dry else graph_us([lambda q=q: gemm_wna16(x, q, cfg) for q in qws])
                    except Exception as ex:
                        print(f"fail {v} {split} {n}x{k} M={m}: {ex!r}"[:300], flush=True)
                        continue
                    rows.append(dict(N=n, K=k, M=m, kernel=v[0], bn=v[1], warps=v[2], stages=v[3], block_k=v[4], split=split,
                                     us=round(us, 2), err=err))
            res += rows
            ok = [r for r in rows if r["err"] < 1e-2]
            bad = [r for r in rows if r["err"] >= 1e-2]
            if bad:
                print(f"WRONG RESULTS {n}x{k} M={m}: {[(r['kernel'], r['bn'], r['split'], r['err']) for r in bad][:6]}")
            h_us, old_us = hum.get((n, k, m), (None, None))
            for fam in ("mv", "mvs", "gemv", "all"):
                cand = [r for r in ok if fam == "all" or r["kernel"] == fam]
                if not cand:
                    continue
                b = min(cand, key=lambda r: r["us"])
                tb = wbytes / (b["us"] * 1e-6) / 1e12
                line = (f"{n:6d}x{k:<6d} M={m:<3d} {fam:5s} best {b['kernel']} bn={b['bn']} w={b['warps']} "
                        f"st={b['stages']} bk={b['block_k']} sk={b['split']}: {b['us']:8.2f} us {tb:5.2f} TB/s {100 * tb / copy_bw:4.0f}%"
                        + (f" | humming {h_us:7.2f} x{h_us / b['us']:.2f}" if h_us else "")
                        + (f" | old kestrel {old_us:7.2f} x{old_us / b['us']:.2f}" if old_us else ""))
                print(line, flush=True)
                if fam == "all":
                    summary.append(line)
        del qws, deq, w0
        torch.cuda.empty_cache()
        print(f"[{time.time() - t_start:.0f}s] done {n}x{k}", flush=True)
    print("\n".join(["SUMMARY"] + summary))
    json.dump({"copy_TBps": copy_bw, "rows": res, "warm": [(list(v), s, t, e) for v, s, t, e in warm],
               "wall_s": time.time() - t_start}, open(os.path.join(args.out, "gemv_sweep.json"), "w"), indent=0)
    print(f"wall {time.time() - t_start:.1f}s")


if __name__ == "__main__":
    main()
