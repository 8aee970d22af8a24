"""WNA16 GEMM on one GPU: kestrel vs Humming (same format) vs cuBLAS bf16 (vs gemlite where it runs), one process.

Timing: each call is captured 20x (8x from M = 1024) in a CUDA graph rotating over several weight copies (so the L2 holds none of
them), median of 20 replays; plus triton's do_bench (median, one copy, Python launch included). Effective weight
bandwidth = packed weight bytes / time, against a measured 4 GiB device-to-device copy (read + write).
Writes raw JSON, a markdown table and a PNG plot to --out (default $OUT or bench_out).

  python bench/gemm_wna16.py                                   # everything (Llama-3-8B + 70B, all M, int4 + mxfp4)
  python bench/gemm_wna16.py --models llama3-70b --ms 1,16 --formats int4 --peers humming,cublas
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_timing import copy_bandwidth, graph_us  # noqa: E402
from kestrel.kernels.gemm_wna16 import gemm_wna16  # noqa: E402
from kestrel.kernels.configs import LayerConfig, TuningConfig  # noqa: E402
from kestrel.kernels.tuning import FORMATS, MODEL_SHAPES  # noqa: E402
from kestrel.quant import dequantize, quantize  # noqa: E402

HUMMING_CFG = {"int4": [{"dtype": "int4", "group_size": 128}],
               "mxfp4": [{"dtype": "float4e2m1", "group_size": 32, "scale_dtype": "float8e8m0"},
                         {"dtype": "float4e2m1", "group_size": 32}]}
LAYER_NAMES = ["qkv", "o", "gate_up", "down"]


def bench_us(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def rel_err(y, ref) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def build_humming(fmt, w, max_m=None):
    """(Humming layer for w in format fmt, its weight config). With max_m the layer is called with Humming's own
    heuristic tuning list cut to the intervals that hold some M <= max_m: the same kernels for those M, but its
    first call JIT-compiles only them instead of every M-interval kernel up to M = 8192."""
    from humming.layer import HummingLayer
    from humming_cache import pin_cache_key, small_m_caller  # a carried HUMMING_CACHE_DIR hits on a fresh install
    pin_cache_key()
    last = None
    for cfg in HUMMING_CFG[fmt]:
        try:
            layer = HummingLayer(shape_n=w.shape[0], shape_k=w.shape[1], weight_config=dict(cfg),
                                 torch_dtype=torch.bfloat16).cuda()
            layer.load_from_unquantized(w)
            layer.transform()
            return (layer if max_m is None else small_m_caller(layer, max_m)), cfg
        except Exception as ex:  # try the next spelling of the format
            last = ex
    raise last


def _warm(job):
    """Worker: JIT-compile Humming's kernels (its cubin cache is on disk; a cold first call per shape takes ~11 s)
    and kestrel's default configs for one (format, N, K) and these M, so the timing process finds them cached."""
    fmt, n, k, ms, humming = job
    t0 = time.time()
    try:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        qw = quantize(w, FORMATS[fmt])
        layer = build_humming(fmt, w, max(ms))[0] if humming else None
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            gemm_wna16(x, qw)
            if layer is not None:
                layer(x)
        torch.cuda.synchronize()
        return job[:3], time.time() - t0, None
    except Exception as ex:
        return job[:3], time.time() - t0, repr(ex)[:300]


def warm_humming_threaded(jobs, threads, timeout_s):
    """Humming compiles each kernel in a compiler subprocess (the GIL is free meanwhile), so threads of this process
    overlap the compiles; its on-disk cubin cache (file-locked per kernel) then serves the timing loop. One M = 1 call
    per (format, shape): later M <= 16 calls of a shape took 0.01 s in earlier runs."""
    from concurrent.futures import ThreadPoolExecutor, wait

    def one(job):
        fmt, (n, k) = job
        t0 = time.time()
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        layer = build_humming(fmt, w)[0]
        layer(torch.randn(1, k, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
        return time.time() - t0

    t0 = time.time()
    pool = ThreadPoolExecutor(threads)
    futs = {pool.submit(one, j): j for j in jobs}

    def finish():
        """Wait (at most timeout_s from the start) and report; returns with unfinished compiles left running."""
        done, pending = wait(futs, timeout=max(0.0, timeout_s - (time.time() - t0)))
        for f in done:
            err = f.exception()
            print(f"humming warm {futs[f]}: {'%.1fs' % f.result() if err is None else repr(err)[:200]}", flush=True)
        if pending:
            print(f"humming warm: {len(pending)} still compiling at the {timeout_s:.0f}s cut", flush=True)
        pool.shutdown(wait=False, cancel_futures=True)
        torch.cuda.empty_cache()
        print(f"humming warm-up ({threads} threads, {len(jobs)} kernels) {time.time() - t0:.1f}s", flush=True)
    return finish


def build_gemlite(fmt, qw):
    from gemlite.helper import A16Wn
    if fmt != "int4":
        raise ValueError("gemlite peer only wired for int4")
    n, k = qw.shape
    from kestrel.quant.packing import unpack_codes
    codes = unpack_codes(qw.qweight, 4, k).to(torch.uint8)  # gemlite takes unsigned codes + zeros
    scales = qw.scales.t().contiguous().to(torch.bfloat16)
    zeros = torch.full_like(scales, float(qw.spec.code_offset))
    return A16Wn(device="cuda", dtype=torch.bfloat16).from_weights(codes, scales, zeros, 4, qw.group_size)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama3-8b,llama3-70b", help="comma list of " + ",".join(MODEL_SHAPES))
    ap.add_argument("--shapes", default=None, help="explicit N,K;N,K list instead of --models")
    ap.add_argument("--ms", default="1,4,16,64,256,1024,4096", help="batch sizes M")
    ap.add_argument("--formats", default="int4,mxfp4", help="comma list of kestrel formats (int4, mxfp4 have peers)")
    ap.add_argument("--peers", default="humming,cublas", help="comma list of humming, cublas, gemlite")
    ap.add_argument("--peer-formats", default="int4,mxfp4", help="formats for which to run Humming")
    ap.add_argument("--copies", type=int, default=4,
                    help="minimum weight copies rotated through in the CUDA graph (more for small layers, >= 200 MB)")
    ap.add_argument("--budget-s", type=float, default=480, help="stop starting new shapes after this many seconds")
    ap.add_argument("--warm-workers", type=int, default=0,
                    help="first JIT-compile Humming and kestrel for every (format, shape) in this many worker processes")
    ap.add_argument("--no-warm-humming", action="store_true",
                    help="the warm-up workers compile only kestrel; Humming JIT-compiles in the timing process (H200, "
                         "2026-12-03: ~5 s per shape there, while 6 parallel workers took 51 s for 2 M each)")
    ap.add_argument("--warm-humming-threads", type=int, default=0,
                    help="before timing, make Humming's first call (its JIT: ~10 s per format and shape, a compiler "
                         "subprocess) for every (format, shape) from this many threads of the timing process")
    ap.add_argument("--layers", default=None,
                    help="keep only these layers, in this order (comma list, e.g. llama3-70b:o)")
    ap.add_argument("--interleave", action="store_true", help="alternate the models' layers and the formats (a budget cut "
                    "then leaves rows of every model and format)")
    ap.add_argument("--no-dobench", action="store_true", help="skip the do_bench column (saves device time)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--from-json", nargs="+", metavar="JSON",
                    help="no GPU: merge these result files (rows of later files win) and rewrite the table + plot")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.from_json:
        return replot(args.from_json, args.out)
    t_start = time.time()
    import triton
    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python " + " ".join(sys.argv)}
    peers = set(args.peers.split(","))
    if "humming" in peers:
        try:
            import humming
            meta["humming"] = humming.__version__
        except Exception as ex:
            meta["humming_error"] = repr(ex)
            peers.discard("humming")
    if "gemlite" in peers:
        try:
            import gemlite
            meta["gemlite"] = getattr(gemlite, "__version__", "?")
        except Exception as ex:
            meta["gemlite_error"] = repr(ex)
            peers.discard("gemlite")
    print(meta, flush=True)
    meta["copy"] = copy_bandwidth()
    copy_bw = meta["copy"]["rw_TBps"]
    print(f"D2D copy 4 GiB: {copy_bw:.3f} TB/s (read+write)", flush=True)
    if args.shapes:
        shapes = [("custom", tuple(int(v) for v in s.split(","))) for s in args.shapes.split(";")]
    else:
        per_model = [[(f"{m}:{LAYER_NAMES[i]}", nk) for i, nk in enumerate(MODEL_SHAPES[m])]
                     for m in args.models.split(",")]
        shapes = ([s for group in zip(*per_model) for s in group] if args.interleave else
                  [s for group in per_model for s in group])
        if args.layers:  # in the order given: a budget cut then drops the last ones
            by_name = dict(shapes)
            shapes = [(name, by_name[name]) for name in args.layers.split(",") if name in by_name]
    ms = [int(v) for v in args.ms.split(",")]
    hum_warm = None  # started before the kestrel warm-up so the two overlap
    if args.warm_humming_threads and "humming" in peers:
        hum_warm = warm_humming_threaded([(f, nk) for f in args.formats.split(",") if f in args.peer_formats.split(",")
                                          for _, nk in shapes], args.warm_humming_threads, args.budget_s / 2)
    if args.warm_workers:
        import multiprocessing as mp
        t0 = time.time()
        jobs = [(fmt, n, k, ms, "humming" in peers and fmt in args.peer_formats.split(",") and not args.no_warm_humming)
                for fmt in args.formats.split(",") for _, (n, k) in shapes]
        # at most half the budget: a warm-up still running when an outer `timeout` kills this process leaves its
        # spawned workers holding the output pipe (seen on the H200: the job printed nothing); leaving the `with`
        # terminates them, and whatever is not compiled yet compiles in the timing loop
        with mp.get_context("spawn").Pool(args.warm_workers) as pool:
            try:
                for job, t, err in pool.map_async(_warm, jobs).get(timeout=args.budget_s / 2):
                    print(f"warm {job}: {t:.1f}s {err or ''}", flush=True)
            except mp.TimeoutError:
                print(f"warm-up cut at {args.budget_s / 2:.0f}s (half of --budget-s)", flush=True)
        print(f"warm-up {time.time() - t0:.1f}s", flush=True)
    if hum_warm is not None:
        hum_warm()
    rows = []
    torch.manual_seed(0)
    fmts = args.formats.split(",")
    # --interleave also alternates the formats per shape, so a budget cut leaves rows of every format
    work = ([(f, s) for s in shapes for f in fmts] if args.interleave else [(f, s) for f in fmts for s in shapes])
    for fmt, (name, (n, k)) in work:
            spec = FORMATS[fmt]
            # the first shape always runs: imports and the copy-bandwidth pass alone can exceed a small budget
            # (a --budget-s 8 gemlite call printed no rows that way)
            if rows and time.time() - t_start > args.budget_s:
                print(f"budget reached, skipping {fmt} {name}", flush=True)
                continue
            # enough copies that the rotation does not fit the 60 MB L2 (small layers need more)
            ncop = min(12, max(args.copies, -(-200_000_000 // (n * k // 2))))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(ncop)]
            qws = [quantize(w, spec) for w in ws]
            wbytes = qws[0].nbytes
            deq0 = dequantize(qws[0])  # fp32 reference weight on the GPU
            hum, hum_cfg, gl = None, None, None
            if "humming" in peers and fmt in args.peer_formats.split(","):
                try:
                    t0 = time.time()
                    built = [build_humming(fmt, w, max(ms)) for w in ws]
                    hum, hum_cfg = [b[0] for b in built], built[0][1]
                    print(f"humming {fmt} {n}x{k} built in {time.time() - t0:.1f}s ({hum_cfg}; "
                          f"{getattr(hum[0], 'n_kernels', 'all')} M-interval kernels)", flush=True)
                except Exception as ex:
                    print(f"humming {fmt} failed: {ex!r}"[:400], flush=True)
            if "gemlite" in peers:
                try:
                    gl = [build_gemlite(fmt, q) for q in qws]
                except Exception as ex:
                    meta.setdefault("gemlite_errors", []).append(f"{fmt} {n}x{k}: {ex!r}"[:300])
                    print(f"gemlite {fmt} failed: {ex!r}"[:400], flush=True)
            for m in ms:
                print(f"[{time.time() - t_start:.1f}s] {fmt} {name} M={m}", flush=True)  # where a killed run was
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                reps = 20 if m < 1024 else 8  # calls per graph: ms-long calls need fewer for a stable median
                row = {"fmt": fmt, "layer": name, "M": m, "N": n, "K": k, "w_bytes": wbytes,
                       "kestrel_config": TuningConfig(gpu).lookup(LayerConfig(spec, n, k), m).to_dict()}
                ref = x.float() @ deq0.t()
                try:
                    row["kestrel_err"] = rel_err(gemm_wna16(x, qws[0]), ref)
                    row["kestrel_us"] = graph_us([lambda q=q: gemm_wna16(x, q) for q in qws], reps)
                    if not args.no_dobench:
                        row["kestrel_us_dobench"] = bench_us(lambda: gemm_wna16(x, qws[0]))
                except Exception as ex:
                    traceback.print_exc()
                    row["kestrel_error"] = repr(ex)[:300]
                if hum is not None:
                    try:
                        t0 = time.time()
                        row["humming_err_vs_own_quant"] = None
                        y = hum[0](x)
                        row["humming_first_call_s"] = round(time.time() - t0, 2)
                        row["humming_us"] = graph_us([lambda L=L: L(x) for L in hum], reps)
                        if not args.no_dobench:
                            row["humming_us_dobench"] = bench_us(lambda: hum[0](x))
                        row["humming_config"] = str(hum_cfg)
                    except Exception as ex:
                        row["humming_error"] = repr(ex)[:300]
                if gl is not None and m <= 256:
                    try:
                        row["gemlite_err"] = rel_err(gl[0](x), ref)
                        row["gemlite_us"] = graph_us([lambda L=L: L(x) for L in gl])
                    except Exception as ex:
                        row["gemlite_error"] = repr(ex)[:300]
                if "cublas" in peers:
                    row["cublas_us"] = graph_us([lambda w=w: torch.matmul(x, w.t()) for w in ws], reps)
                for p in ("kestrel", "humming", "gemlite"):
                    if f"{p}_us" in row:
                        row[f"{p}_TBps"] = wbytes / (row[f"{p}_us"] * 1e-6) / 1e12
                        row[f"{p}_frac_copy"] = row[f"{p}_TBps"] / copy_bw
                if "kestrel_us" in row:
                    for p in ("humming", "cublas", "gemlite"):
                        if f"{p}_us" in row:
                            row[f"speedup_vs_{p}"] = row[f"{p}_us"] / row["kestrel_us"]
                rows.append(row)
                save(meta, rows, t_start, args.out)  # after every row: a killed run keeps what it measured
                print("ROW " + json.dumps({k2: (round(v, 4) if isinstance(v, float) else v) for k2, v in row.items()
                                            if k2 != "kestrel_config"}), flush=True)
            del ws, qws, deq0, hum, gl
            torch.cuda.empty_cache()
            save(meta, rows, t_start, args.out)  # after every shape: a killed run keeps what it measured
    res = save(meta, rows, t_start, args.out)
    write_markdown(res, os.path.join(args.out, "gemm_wna16.md"))
    try:
        plot(res, os.path.join(args.out, "gemm_wna16.png"))
    except Exception as ex:
        print("plot failed:", ex)
    print(open(os.path.join(args.out, "gemm_wna16.md")).read())


def config_str(c) -> str:
    if not c:
        return ""
    if c["kernel"] == "dequant_mm":
        return "dequant+cuBLAS" + (f" {c['chunks']} blocks overlapped" if c.get("chunks", 1) > 1 else "")
    return (f"{c['kernel']} {c['block_m']}x{c['block_n']} w{c['num_warps']} s{c['num_stages']}" +
            (f" sk{c['split_k']}" if c["split_k"] > 1 else "") + (f" bk{c['block_k']}" if c["block_k"] else "") +
            (f" streamk{c['streamk']}" if c.get("streamk") else ""))


def write_markdown(res, path):
    m, rows = res["meta"], res["rows"]
    f = lambda v, p=1: "" if v is None else f"{v:.{p}f}"
    lines = [f"# WNA16 GEMM: kestrel vs Humming vs cuBLAS bf16", "",
             f"GPU {m['gpu']}, torch {m['torch']}, triton {m['triton']}, humming {m.get('humming', '-')}, "
             f"gemlite {m.get('gemlite', m.get('gemlite_error', '-'))}, {m['date']}", "",
             *([f"gemlite failed: {m['gemlite_errors'][0]}", ""] if m.get("gemlite_errors") else []),
             f"Command: `{m['command']}`", "",
             f"Device-to-device copy (4 GiB, read+write): {m['copy']['rw_TBps']:.3f} TB/s. Times are µs per call, "
             "CUDA graph of 20 calls (8 from M = 1024) rotating over weight copies; TB/s = packed weight bytes / time; "
             "x Humming / x cuBLAS = their time / kestrel time (>1 = kestrel faster).", "",
             "| fmt | layer | M | N | K | kestrel µs | Humming µs | cuBLAS µs | gemlite µs | kestrel TB/s | % copy | "
             "Humming TB/s | x Humming | x cuBLAS | kestrel rel err | kestrel config |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| " + " | ".join([r["fmt"], r["layer"], str(r["M"]), str(r["N"]), str(r["K"]),
                                         f(r.get("kestrel_us")), f(r.get("humming_us")), f(r.get("cublas_us")),
                                         f(r.get("gemlite_us")), f(r.get("kestrel_TBps"), 2),
                                         f(100 * r["kestrel_frac_copy"], 0) if "kestrel_frac_copy" in r else "",
                                         f(r.get("humming_TBps"), 2), f(r.get("speedup_vs_humming"), 2),
                                         f(r.get("speedup_vs_cublas"), 2), f(r.get("kestrel_err"), 4),
                                         config_str(r.get("kestrel_config"))]) + " |")
    open(path, "w").write("\n".join(lines) + "\n")


def save(meta, rows, t_start, out) -> dict:
    meta["wall_s"] = round(time.time() - t_start, 1)
    res = {"meta": meta, "rows": rows}
    with open(os.path.join(out, "gemm_wna16.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def replot(paths, out):
    """Merge result files (e.g. the M <= 16 and the M >= 64 runs) into one table and plot, on any machine."""
    merged, metas = {}, []
    for p in paths:
        res = json.load(open(p))
        metas.append(res["meta"])
        for r in res["rows"]:
            merged[(r["fmt"], r["layer"], r["M"])] = r
    meta = dict(metas[-1])
    meta["command"] = " ; ".join(m["command"] for m in metas)
    meta["date"] = " / ".join(m["date"] for m in metas)
    res = {"meta": meta, "rows": sorted(merged.values(), key=lambda r: (r["fmt"], r["layer"], r["M"]))}
    with open(os.path.join(out, "gemm_wna16.json"), "w") as f:
        json.dump(res, f, indent=1)
    write_markdown(res, os.path.join(out, "gemm_wna16.md"))
    plot(res, os.path.join(out, "gemm_wna16.png"))
    print(open(os.path.join(out, "gemm_wna16.md")).read())


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["rows"]
    keys = sorted({(r["fmt"], r["layer"]) for r in rows})
    fmts = sorted({r["fmt"] for r in rows})
    cols = 4
    nrow = -(-len(keys) // cols)
    fig, axes = plt.subplots(nrow + len(fmts), cols, figsize=(4.2 * cols, 3.2 * (nrow + len(fmts))), squeeze=False)
    for i, fmt in enumerate(fmts):  # one row per format: kestrel vs each peer and % of copy BW, all layers
        rs = [r for r in rows if r["fmt"] == fmt]
        for ax, (key, label) in zip(axes[nrow + i], (("speedup_vs_humming", "x Humming (>1: kestrel faster)"),
                                                      ("speedup_vs_cublas", "x cuBLAS bf16"),
                                                      ("kestrel_frac_copy", "kestrel TB/s / copy TB/s"),
                                                      ("humming_frac_copy", "Humming TB/s / copy TB/s"))):
            for layer in sorted({r["layer"] for r in rs}):
                pts = sorted((r["M"], r[key]) for r in rs if r["layer"] == layer and key in r)
                if pts:
                    ax.plot(*zip(*pts), "o-", label=layer, ms=3)
            if key.startswith("speedup"):
                ax.axhline(1.0, color="k", lw=0.8)
                ax.axhline(0.9, color="r", lw=0.6, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{fmt}: {label}", fontsize=8)
            ax.set_xlabel("M")
            ax.legend(fontsize=6)
    for ax, key in zip(axes[:nrow].flat, keys):
        rs = sorted([r for r in rows if (r["fmt"], r["layer"]) == key], key=lambda r: r["M"])
        for p, style in (("kestrel", "o-"), ("humming", "s--"), ("cublas", "^:"), ("gemlite", "x-.")):
            pts = [(r["M"], r[f"{p}_us"]) for r in rs if f"{p}_us" in r]
            if pts:
                ax.plot(*zip(*pts), style, label=p)
        ax.set_xscale("log", base=2); ax.set_yscale("log")
        ax.set_title(f"{key[0]} {key[1]} {rs[0]['N']}x{rs[0]['K']}", fontsize=8)
        ax.set_xlabel("M"); ax.set_ylabel("µs")
        ax.legend(fontsize=7)
    for ax in list(axes[:nrow].flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle(f"WNA16 GEMM on {res['meta']['gpu']} (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
