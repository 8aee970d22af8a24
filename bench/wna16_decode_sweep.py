"""Decode (M <= 16) WNA16 on one GPU, same process: kestrel's default config (tune cache / heuristic) and its
L2-prefetch (ComputeConfig.prefetch) variants, each with programmatic dependent launch off and on, vs Humming (same
format) and cuBLAS bf16, Llama-3 8B/70B linear shapes; at M = 1 also the CUDA-core "stream" kernel's best round-1
tiles.

Every config is checked against x @ dequant(W)^T (float32), eagerly and from a replayed CUDA graph of back-to-back
calls (PDL lets neighbouring calls overlap), before it is timed. Timing: CUDA graph of 20 calls rotating over
>= 200 MB of weight copies (L2 cold), median of 10 replays. % copy = packed weight bytes / time against a 4 GiB
device copy in the same process. Humming's and kestrel's kernels are JIT-compiled first in worker processes.
Writes $OUT/wna16_decode_sweep.json after every shape.

  python bench/wna16_decode_sweep.py --ms 1,4,16 --formats int4,mxfp4
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_timing import copy_bandwidth, shape_weights  # noqa: E402
from kestrel.kernels.timing import graph_time_us  # noqa: E402
from wna16_stream_sweep import HUMMING, build_humming, graph_outputs_err  # noqa: E402

PREFETCH = (0, 4, 8)


def candidates(layer, m, gpu):
    """The default config, the mv heuristic if the default is another kernel, and their prefetch variants."""
    from kestrel.kernels.configs import TuningConfig, heuristic
    dflt = TuningConfig(gpu).lookup(layer, m)
    base = dflt if dflt.kernel in ("mv", "mvs") else heuristic(layer, m)
    out = [dflt] + [dataclasses.replace(base, prefetch=p) for p in PREFETCH]
    # with blocks prefetched, fewer / more K splits may pay: the default's split halved and doubled
    out += [dataclasses.replace(base, prefetch=4, split_k=sk) for sk in (base.split_k // 2, base.split_k * 2)
            if sk >= 1]
    # more bytes in flight per SM: deeper pipelines, wider tiles with more warps
    out += [dataclasses.replace(base, num_stages=st) for st in (4, 6)]
    out += [dataclasses.replace(base, block_n=256, num_warps=4, split_k=min(16, base.split_k * 2))]
    if m == 1:  # the CUDA-core stream kernel's two best tiles of the round-1 sweep (bench/wna16_stream_sweep.py)
        from kestrel.kernels.configs import ComputeConfig
        out += [ComputeConfig("stream", 1, 64, 0, 16, 1, 2)]
    return dflt, list(dict.fromkeys(c for c in out if c.valid_for(layer)))


def _warm(job):
    """Worker: compile kestrel's candidates (PDL off and on) and Humming's kernels for one (format, N, K)."""
    fmt, n, k, ms, gpu, humming, pdls, only_default, red_steps = job
    import torch
    from kestrel.kernels import gemm_wna16_small
    from kestrel.kernels.configs import LayerConfig
    from kestrel.kernels.gemm_wna16 import gemm_wna16
    from kestrel.kernels.tuning import FORMATS
    from kestrel.quant import quantize
    t0 = time.time()
    errs = []
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    qw = quantize(w, FORMATS[fmt])
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        dflt, cands = candidates(LayerConfig(FORMATS[fmt], n, k), m, gpu)
        for cfg in [dflt] if only_default else cands:
            for rs, pdl in itertools.product(red_steps, pdls):
                gemm_wna16_small.set_pdl(pdl)
                gemm_wna16_small.RED_STEP = rs
                try:
                    gemm_wna16(x, qw, cfg)
                except Exception as ex:
                    errs.append(f"{cfg} pdl={pdl} red_step={rs}: {ex!r}"[:200])
    if humming:
        try:
            layer = build_humming(fmt, w)
            for m in ms:
                layer(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        except Exception as ex:
            errs.append(f"humming: {ex!r}"[:200])
    torch.cuda.synchronize()
    return job[:3], time.time() - t0, errs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--formats", default="int4,mxfp4")
    ap.add_argument("--models", default="llama3-8b,llama3-70b")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--layers", default=None, help="keep only these layers (comma list, e.g. llama3-70b:o)")
    ap.add_argument("--pdl", default="0,1", help="PDL settings to time (comma list of 0, 1, late: see KESTREL_PDL)")
    ap.add_argument("--red-steps", default="2", help="split-K partials summed per step (gemm_wna16_small.RED_STEP) "
                    "to time, comma list of 1/2")
    ap.add_argument("--only-default", action="store_true", help="time only the default config (with each --pdl)")
    ap.add_argument("--no-humming", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    from kestrel.kernels import gemm_wna16_small
    from kestrel.kernels.configs import LayerConfig
    from kestrel.kernels.gemm_wna16 import gemm_wna16
    from kestrel.kernels.tuning import FORMATS, MODEL_SHAPES

    gpu = torch.cuda.get_device_name()
    fmts = args.formats.split(",")
    ms = [int(v) for v in args.ms.split(",")]
    shapes = [(f"{mo}:{name}", nk) for mo in args.models.split(",")
              for name, nk in zip(("qkv", "o", "gate_up", "down"), MODEL_SHAPES[mo])]
    if args.layers:
        shapes = [s for s in shapes if s[0] in args.layers.split(",")]
    pdls = args.pdl.split(",")
    for v in pdls:  # fail before the warm-up on a bad mode
        gemm_wna16_small.set_pdl(v)
    pdl_default = os.environ.get("KESTREL_PDL", "0")
    gemm_wna16_small.set_pdl(pdl_default)
    import multiprocessing as mp
    red_steps = [int(v) for v in args.red_steps.split(",")]
    jobs = [(f, n, k, ms, gpu, f in HUMMING and not args.no_humming, pdls, args.only_default, red_steps)
            for f in fmts for _, (n, k) in shapes]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        for job, t, errs in pool.map(_warm, jobs):
            print(f"warm {job}: {t:.1f}s {errs if errs else ''}", flush=True)
    print(f"warm-up {time.time() - t_start:.1f}s", flush=True)
    copy_bw = copy_bandwidth()["rw_TBps"]
    print(f"D2D copy: {copy_bw:.3f} TB/s", flush=True)
    res, summary = [], []
    meta = {"gpu": gpu, "copy_TBps": copy_bw, "torch": torch.__version__, "command": "python " + " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    def dump():
        json.dump({**meta, "rows": res, "wall_s": time.time() - t_start},
                  open(os.path.join(args.out, "wna16_decode_sweep.json"), "w"), indent=0)

    for fmt in fmts:
        spec = FORMATS[fmt]
        for name, (n, k) in shapes:
            if res and time.time() - t_start > args.budget_s:
                print(f"budget reached: skip {fmt} {name}", flush=True)
                continue
            w0, qw0, qws, deq = shape_weights(spec, n, k)
            wbytes = qw0.nbytes
            bf = [w0] + [w0.clone() for _ in range(max(1, min(len(qws), -(-200_000_000 // w0.nbytes)) - 1))]
            hum = None
            if fmt in HUMMING and not args.no_humming:
                try:
                    hum = [build_humming(fmt, w0 * (1 + 1e-3 * i)) for i in range(min(len(qws), 8))]
                except Exception as ex:
                    print(f"humming {fmt} {n}x{k} failed: {ex!r}"[:300], flush=True)
            layer = LayerConfig(spec, n, k)
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ deq.t()
                rel = lambda y: ((y.float() - ref).norm() / ref.norm()).item()
                base = dict(fmt=fmt, layer=name, N=n, K=k, M=m, w_bytes=wbytes)
                tb = lambda us: 100 * wbytes / (us * 1e-6) / 1e12 / copy_bw
                h_us = c_us = None
                if hum is not None:
                    try:
                        h_us = graph_time_us([lambda L=L: L(x) for L in hum], calls=20, replays=10)
                        res.append({**base, "kind": "humming", "us": h_us})
                    except Exception as ex:
                        print(f"humming call failed: {ex!r}"[:300], flush=True)
                c_us = graph_time_us([lambda w=w: torch.matmul(x, w.t()) for w in bf], calls=20, replays=10)
                res.append({**base, "kind": "cublas", "us": c_us})
                dflt, cands = candidates(layer, m, gpu)
                if args.only_default:
                    cands = [dflt]
                line = f"{fmt} {name:18s} M={m:<2d} humming {h_us or 0:7.2f} cublas {c_us:7.2f} |"
                best = None
                for cfg in cands:
                    for rs, pdl in itertools.product(red_steps, pdls):
                        gemm_wna16_small.set_pdl(pdl)
                        gemm_wna16_small.RED_STEP = rs
                        try:
                            fn = lambda: gemm_wna16(x, qw0, cfg)
                            err = max(rel(fn()), graph_outputs_err(fn, ref))
                            us = graph_time_us([lambda q=q: gemm_wna16(x, q, cfg) for q in qws], calls=20, replays=10)
                        except Exception as ex:
                            print(f"fail {cfg} pdl={pdl} red_step={rs} {name} M={m}: {ex!r}"[:300], flush=True)
                            continue
                        row = {**base, "kind": "kestrel", "default": cfg == dflt, "pdl": pdl, "red_step": rs,
                               "config": cfg.to_dict(),
                               "us": us, "err": err}
                        res.append(row)
                        if not err < 1e-2:
                            print(f"WRONG RESULT {cfg} pdl={pdl} red_step={rs} {name} M={m}: rel err {err:.3g}",
                                  flush=True)
                        elif best is None or us < best["us"]:
                            best = row
                        tag = ("dflt" if cfg == dflt else f"st{cfg.block_n}/{cfg.split_k}" if cfg.kernel == "stream"
                               else f"pf{cfg.prefetch}")
                        line += f" {tag}{'' if pdl == '0' else '+pdl' + pdl}{'' if rs == 2 else '+r1'} {us:6.2f}"
                gemm_wna16_small.set_pdl(pdl_default)
                gemm_wna16_small.RED_STEP = 2
                if best:
                    c = best["config"]
                    line += (f" || best {c['kernel']} bn{c['block_n']} w{c['num_warps']} sk{c['split_k']} "
                             f"pf{c['prefetch']} pdl={best['pdl']}: {best['us']:6.2f} us {tb(best['us']):3.0f}%"
                             + (f" x hum {h_us / best['us']:.2f}" if h_us else "")
                             + f" x cublas {c_us / best['us']:.2f}")
                print(line, flush=True)
                summary.append(line)
            del qws, deq, w0, hum, bf
            torch.cuda.empty_cache()
            print(f"[{time.time() - t_start:.0f}s] done {fmt} {name}", flush=True)
            dump()
    print("\n".join(["SUMMARY"] + summary))
    dump()
    print(f"wall {time.time() - t_start:.1f}s")


if __name__ == "__main__":
    main()
