"""Large-M WNA16 GEMM, one process: kestrel (current dispatch: tune cache or heuristic) vs Humming (same format) vs
cuBLAS bf16, on named Llama-3 layers, with Humming's JIT kept inside a GPU round.

Why not bench/gemm_wna16.py: Humming's first call on a layer compiles a kernel for EVERY M interval of its heuristic
(prepare_kernels -> compile_many, ~10 s per (format, shape) on the H200 host), which cut both session-4 round-2
tables before their first row. Here Humming runs the config its own heuristic picks for the measured M
(humming.tune.get_heuristics_config(layer, shape_m=M), passed as tuning_config): the same kernel its default call
launches at that M (checked and printed per point: the interval entry holding M has the same config), but only the
kernels of the measured M are compiled, all of them up front in one parallel compile_many, while kestrel's Triton
compiles run in worker processes beside it.

Timing as bench/gemm_wna16.py: each call captured 20x (8x from M = 1024) in a CUDA graph rotating over weight copies
(>= 200 MB, L2 cold), median of 20 replays. Prints a ROW json per point and writes json + markdown to --out.

  python bench/wna16_largem_vs_humming.py --formats int4,mxfp4 --ms 64,256 --layers llama3-70b:qkv,llama3-8b:down
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gpu_timing import copy_bandwidth, graph_us  # noqa: E402
from kestrel.kernels.configs import LayerConfig, TuningConfig  # noqa: E402
from kestrel.kernels.tuning import FORMATS, MODEL_SHAPES, warm_compile  # noqa: E402

LAYER_NAMES = ["qkv", "o", "gate_up", "down"]
HUMMING_CFG = {"int4": {"dtype": "int4", "group_size": 128},
               "mxfp4": {"dtype": "float4e2m1", "group_size": 32, "scale_dtype": "float8e8m0"}}


def layer_shapes(names: str) -> list[tuple[str, tuple[int, int]]]:
    """'llama3-8b:down,llama3-70b:o' -> [(name, (N, K)), ...] in that order."""
    by_name = {f"{m}:{LAYER_NAMES[i]}": nk for m, shapes in MODEL_SHAPES.items() for i, nk in enumerate(shapes)}
    return [(name, by_name[name]) for name in names.split(",")]


def build_humming(fmt: str, w: torch.Tensor):
    from humming.layer import HummingLayer
    layer = HummingLayer(shape_n=w.shape[0], shape_k=w.shape[1], weight_config=dict(HUMMING_CFG[fmt]),
                         torch_dtype=torch.bfloat16).cuda()
    layer.load_from_unquantized(w)
    layer.transform()
    return layer


def humming_config_for(layer, m: int) -> tuple[dict, bool]:
    """-> (Humming's heuristic config at M = m, whether it equals the entry of its default interval list that holds m,
    i.e. what layer(x) would launch)."""
    from humming.tune import get_heuristics_config
    cfg = get_heuristics_config(layer.humming_config, shape_m=m)
    same = None
    for lo, hi, c in get_heuristics_config(layer.humming_config):
        if lo < m <= hi:
            same = json.dumps(c, sort_keys=True, default=str) == json.dumps(cfg, sort_keys=True, default=str)
    return dict(cfg), bool(same)


def humming_precompile(items, log=print) -> float:
    """Compile the Humming kernels of every (layer, config) in one compile_many (its parallel build pool), the
    specs built as HummingKernel.prepare_kernels builds them. Falls back to one first call per item."""
    from humming.kernel.humming import HummingKernel
    t0 = time.time()
    dev = torch.cuda.current_device()
    try:
        specs = []
        for layer, cfg in items:
            lay, comp, tun = HummingKernel._resolve_configs(layer.humming_config.to_str(), None, json.dumps(cfg), dev)
            kc = lay | comp | tun
            kc.pop("num_sms", 0)
            specs.append((HummingKernel, kc))
        uniq = list({json.dumps(kc, sort_keys=True, default=str): (c, kc) for c, kc in specs}.values())
        HummingKernel.compile_many(uniq, dev)
        log(f"humming precompile: {len(uniq)} kernels ({len(items)} points) in {time.time() - t0:.1f}s")
    except Exception as ex:  # internals moved: compile through the public call instead
        log(f"humming compile_many failed ({ex!r:.200}); first calls one by one")
        for layer, cfg in items:
            layer(torch.randn(1, layer.humming_config.shape_k, device="cuda", dtype=torch.bfloat16),
                  tuning_config=cfg)
        log(f"humming precompile (first calls) {time.time() - t0:.1f}s")
    return time.time() - t0


def rel_err(y, ref) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="int4,mxfp4")
    ap.add_argument("--ms", default="64,256", help="M values; ';' separates groups run one after the other "
                                                   "(e.g. '64,256;1024,4096': every format at the first group first)")
    ap.add_argument("--layers", default=",".join(f"{m}:{n}" for m in MODEL_SHAPES for n in LAYER_NAMES))
    ap.add_argument("--jobs", type=int, default=8, help="kestrel compile worker processes")
    ap.add_argument("--no-humming", action="store_true")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new (format, shape) after this many s")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    import triton
    from kestrel.kernels.gemm_wna16 import gemm_wna16
    from kestrel.quant import dequantize, quantize
    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": "python " + " ".join(sys.argv)}
    humming_ok = not args.no_humming
    if humming_ok:
        try:
            import humming
            meta["humming"] = humming.__version__
        except Exception as ex:
            meta["humming_error"] = repr(ex)
            humming_ok = False
    print(meta, flush=True)
    fmts = args.formats.split(",")
    groups = [[int(v) for v in g.split(",")] for g in args.ms.split(";")]
    shapes = layer_shapes(args.layers)
    # kestrel compiles (worker processes) in a thread, beside Humming's compile below
    jobs = [(LayerConfig(FORMATS[f], n, k), m, TuningConfig(gpu).lookup(LayerConfig(FORMATS[f], n, k), m))
            for f in fmts for _, (n, k) in shapes for g in groups for m in g]
    kt = threading.Thread(target=warm_compile, args=(jobs, args.jobs), daemon=True)
    kt.start()
    meta["copy"] = copy_bandwidth()
    copy_bw = meta["copy"]["rw_TBps"]
    print(f"D2D copy 4 GiB: {copy_bw:.3f} TB/s (read+write)", flush=True)
    hum_cfg = {}  # (fmt, name, m) -> (config, same as default)
    probes = {}  # (fmt, name) -> a Humming layer to derive configs from

    def humming_prepare(g):
        """Humming configs + compile of one M group (blocking: a build thread loading modules during a CUDA graph
        capture of the timing loop could break the capture)."""
        torch.manual_seed(1)
        items = []
        for f in fmts:
            for name, (n, k) in shapes:
                if (f, name) not in probes:
                    probes[(f, name)] = build_humming(f, torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
                for m in g:
                    hum_cfg[(f, name, m)] = humming_config_for(probes[(f, name)], m)
                    items.append((probes[(f, name)], hum_cfg[(f, name, m)][0]))
        meta.setdefault("humming_compile_s", []).append(round(humming_precompile(items), 1))

    if humming_ok:
        humming_prepare(groups[0])
    kt.join()  # the workers also run GPU work: done before any timing
    print(f"[{time.time() - t_start:.1f}s] compiles done", flush=True)

    rows = []
    torch.manual_seed(0)
    for gi, g in enumerate(groups):
        if gi and humming_ok:
            if time.time() - t_start > args.budget_s:
                print(f"budget reached, skipping M={g}", flush=True)
                continue
            humming_prepare(g)
        for fmt in fmts:
            spec = FORMATS[fmt]
            for name, (n, k) in shapes:
                if rows and time.time() - t_start > args.budget_s:
                    print(f"budget reached, skipping {fmt} {name} M={g}", flush=True)
                    continue
                ncop = min(12, max(4, -(-200_000_000 // (n * k // 2))))
                ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(ncop)]
                qws = [quantize(w, spec) for w in ws]
                deq0 = dequantize(qws[0])
                hum = None
                if humming_ok:
                    try:
                        hum = [build_humming(fmt, w) for w in ws]
                    except Exception as ex:
                        print(f"humming {fmt} {name} failed: {ex!r}"[:300], flush=True)
                for m in g:
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    reps = 20 if m < 1024 else 8
                    cfg = TuningConfig(gpu).lookup(LayerConfig(spec, n, k), m)
                    row = {"fmt": fmt, "layer": name, "M": m, "N": n, "K": k, "w_bytes": qws[0].nbytes,
                           "kestrel_config": cfg.to_dict()}
                    ref = x.float() @ deq0.t()
                    ref_w = x.float() @ ws[0].float().t()  # the unquantized product: both libraries' total error
                    try:
                        y = gemm_wna16(x, qws[0])
                        row["kestrel_err"] = round(rel_err(y, ref), 5)
                        row["kestrel_err_vs_w"] = round(rel_err(y, ref_w), 5)
                        row["kestrel_us"] = graph_us([lambda q=q: gemm_wna16(x, q) for q in qws], reps)
                    except Exception as ex:
                        row["kestrel_error"] = repr(ex)[:300]
                    if hum is not None:
                        hc, same = hum_cfg[(fmt, name, m)]
                        row["humming_cfg_is_default"] = same
                        try:
                            t0 = time.time()
                            # its own quantization of the same float weight: compare with kestrel_err_vs_w
                            row["humming_err_vs_w"] = round(rel_err(hum[0](x, tuning_config=hc), ref_w), 5)
                            row["humming_first_call_s"] = round(time.time() - t0, 2)
                            row["humming_us"] = graph_us([lambda L=L: L(x, tuning_config=hc) for L in hum], reps)
                        except Exception as ex:
                            row["humming_error"] = repr(ex)[:300]
                    row["cublas_us"] = graph_us([lambda w=w: torch.matmul(x, w.t()) for w in ws], reps)
                    for p in ("humming", "cublas"):
                        if f"{p}_us" in row and "kestrel_us" in row:
                            row[f"x_{p}"] = round(row[f"{p}_us"] / row["kestrel_us"], 4)
                    if "kestrel_us" in row:
                        row["kestrel_TBps"] = round(row["w_bytes"] / (row["kestrel_us"] * 1e-6) / 1e12, 4)
                    rows.append(row)
                    print("ROW " + json.dumps({a: (round(b, 3) if isinstance(b, float) else b)
                                               for a, b in row.items() if a != "kestrel_config"}), flush=True)
                    save(meta, rows, t_start, args.out)
                del ws, qws, deq0, hum
                torch.cuda.empty_cache()
    res = save(meta, rows, t_start, args.out)
    md = markdown(res)
    open(os.path.join(args.out, "largem_vs_humming.md"), "w").write(md)
    print(md, flush=True)


def save(meta, rows, t_start, out) -> dict:
    meta["wall_s"] = round(time.time() - t_start, 1)
    res = {"meta": meta, "rows": rows}
    with open(os.path.join(out, "largem_vs_humming.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def config_str(c: dict) -> str:
    if c["kernel"] == "dequant_mm":
        return "dequant+cuBLAS" + (f" chunks{c['chunks']}" if c.get("chunks", 1) > 1 else "")
    return (f"{c['kernel']}{' swap' if c.get('swap') else ''} {c['block_m']}x{c['block_n']} w{c['num_warps']} "
            f"s{c['num_stages']}" + (f" sk{c['split_k']}" if c["split_k"] > 1 else "") +
            (" red" if c.get("reduce") else "") + (" tail" if c.get("tail") else "") + (f" ws{c['ws']}" if c.get("ws") else ""))


def markdown(res) -> str:
    """Per-point table, then per (format, M) min / median / max of x Humming and the count >= 0.9x."""
    m, rows = res["meta"], res["rows"]
    f = lambda v, p=1: "" if v is None else f"{v:.{p}f}"
    out = [f"GPU {m['gpu']}, torch {m['torch']}, triton {m['triton']}, humming {m.get('humming', '-')}, {m['date']}; "
           f"copy {m['copy']['rw_TBps']:.3f} TB/s", "", f"Command: `{m['command']}`", "",
           "| fmt | layer | M | kestrel µs | Humming µs | cuBLAS µs | x Humming | x cuBLAS | rel err | kestrel config |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append("| " + " | ".join([r["fmt"], r["layer"], str(r["M"]), f(r.get("kestrel_us")), f(r.get("humming_us")),
                                       f(r.get("cublas_us")), f(r.get("x_humming"), 2), f(r.get("x_cublas"), 2),
                                       f(r.get("kestrel_err"), 4), config_str(r["kestrel_config"])]) + " |")
    out += ["", "| fmt | M | x Humming min / median / max | >= 0.9x | x cuBLAS median |", "|---|---|---|---|---|"]
    for fmt in dict.fromkeys(r["fmt"] for r in rows):
        for mm in sorted({r["M"] for r in rows if r["fmt"] == fmt}):
            xs = sorted(r["x_humming"] for r in rows if r["fmt"] == fmt and r["M"] == mm and "x_humming" in r)
            xc = sorted(r["x_cublas"] for r in rows if r["fmt"] == fmt and r["M"] == mm and "x_cublas" in r)
            med = lambda v: v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
            if xs:
                out.append(f"| {fmt} | {mm} | {xs[0]:.2f} / {med(xs):.2f} / {xs[-1]:.2f} | "
                           f"{sum(v >= 0.9 for v in xs)} / {len(xs)} | {f(med(xc), 2) if xc else ''} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
