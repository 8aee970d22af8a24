"""Tensor-core WNA16 ("tc" kernel) on one GPU: config/variant sweep and side-by-side numbers vs Humming and cuBLAS.

For each (N, K) shape and M: every candidate tc config (--sweep) and kestrel's default choice (tune cache /
heuristic), Humming (same INT4 g128 weights, --humming) and cuBLAS bf16, timed as CUDA graphs of 20 calls rotating
over weight copies (bench/gpu_timing.py). Prints TFLOP/s and ratios; writes JSON lines and a markdown table to --out.

  python bench/wna16_tc_sweep.py --sweep --shapes 8b:o,70b:o --ms 64,4096
  python bench/wna16_tc_sweep.py --humming --ms 32,64,128,256,1024,4096
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
from gpu_timing import graph_us  # noqa: E402
from kestrel.kernels import gemm_wna16_tc as tcmod  # noqa: E402
from kestrel.kernels.configs import ComputeConfig, LayerConfig, TuningConfig, cache_key, m_bucket  # noqa: E402
from kestrel.kernels.gemm_wna16 import _format_args, gemm_wna16  # noqa: E402
from kestrel.kernels.tuning import FORMATS, MODEL_SHAPES, large_m_candidates, tc_configs  # noqa: E402
from kestrel.quant import dequantize, quantize  # noqa: E402

NAMES = ["qkv", "o", "gate_up", "down"]
HUMMING_WCFG = {"int4": {"dtype": "int4", "group_size": 128},
                "mxfp4": {"dtype": "float4e2m1", "group_size": 32, "scale_dtype": "float8e8m0"}}
SHAPES = {f"{m[7:]}:{NAMES[i]}": nk for m in MODEL_SHAPES for i, nk in enumerate(MODEL_SHAPES[m])}


def sweep_configs(m: int, n: int, k: int, variants: bool = False) -> list[tuple[ComputeConfig, dict]]:
    """(config, extra kwargs of gemm_wna16_tc) candidates for this M; split-K where the tiles can't fill 132 SMs.
    variants adds decode comparisons (dec 0: fp32 decode, 1: robust packed asm; default 2: paired packed asm)."""
    # the tuner's tc tiles (128x256 only past M=128 here), plus the dequant_mm path beside them at large M
    base = [c for c in tc_configs(m) if m > 128 or c.block_n < 256]
    if m > 256:
        base.append(ComputeConfig("dequant_mm", 1, 64, 128, 1, 4, 1))
    out = []
    for cfg in base:
        out.append((cfg, {}))
        if cfg.kernel != "tc":
            continue
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        steps = k // max(128, cfg.block_k)
        split = 1
        while tiles * split * 2 <= 132 * 1.3 and split * 2 <= 8 and steps // (split * 2) >= 8:
            split *= 2
        if split > 1:
            out.append((ComputeConfig(**{**cfg.to_dict(), "split_k": split}), {}))
    if variants:
        v = base[0]
        out += [(v, {"dec": 0}), (v, {"dec": 1})]
    return out


def wide_configs(m: int, n: int, k: int, spec) -> list[tuple[ComputeConfig, dict]]:
    """the tuner's large-M grid (tuning.large_m_candidates) plus an unstorable variant: grouped tile order"""
    base = large_m_candidates(LayerConfig(spec, n, k), m)
    out = [(c, {}) for c in base]
    tc = [c for c in base if c.kernel == "tc"]
    if m >= 1024 and tc:
        out += [(tc[0], {"group_m": 4}), (tc[0], {"group_m": 16})]
    return out


OVERRIDES = {"dec", "swap", "layout", "group_m"}  # sweep-entry keys beyond a ComputeConfig


def path_call(x, c, fmt, kw):
    """the callable for one sweep entry (a config, tc kwargs, or a dequant + cuBLAS path)"""
    if kw:
        return lambda q: tcmod.gemm_wna16_tc(x, q, c, fmt, **kw)
    return lambda q: gemm_wna16(x, q, c)


def gpu_check(dev: str = "cuda", k: int = 1024):
    """Every packed-asm decode path (int4 / fp4, paired or robust, swapped or not, bf16/fp16) vs dequant-matmul."""
    C = ComputeConfig
    for fmt in ("int4", "mxfp4", "nvfp4", "uint4-zp"):
        for n, cfg, kw, dt in ((k, C("tc", 64, 128, 0, 1, 8, 3), {}, torch.bfloat16),
                               (k, C("tc", 128, 128, 0, 2, 8, 2), {"swap": True}, torch.bfloat16),
                               (k - 24, C("tc", 32, 128, 0, 1, 8, 3), {}, torch.bfloat16),
                               (k, C("tc", 64, 64, 0, 1, 4, 3), {"swap": False}, torch.float16)):
            try:
                qw = quantize(torch.randn(n, k, device=dev) * 0.02, FORMATS[fmt])
                x = torch.randn(77, k, device=dev, dtype=dt)
                ref = x.float() @ dequantize(qw).t()
                y = tcmod.gemm_wna16_tc(x, qw, cfg, _format_args(qw), **kw)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                print(f"CHECK {fmt} n={n} {dt} {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} sk{cfg.split_k} {kw}: "
                      f"rel err {err:.2e} {'OK' if err < 1e-2 else 'FAIL'}", flush=True)
            except Exception as ex:
                print(f"CHECK {fmt} n={n} {cfg} {kw}: ERROR {ex!r}"[:300], flush=True)


def _wall_us(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e6


def last_humming():
    """Humming µs per (layer, M) from last session's table (bench/results/gemm_wna16.md), for runs without it."""
    out = {}
    try:
        for line in open(os.path.join(os.path.dirname(__file__), "results", "gemm_wna16.md")):
            c = [t.strip() for t in line.split("|")]
            if len(c) > 8 and c[1] == "int4":
                out[(c[2].replace("llama3-", ""), int(c[3]))] = float(c[8])
    except OSError:
        pass
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ",".join(SHAPES) + " or NxK")
    ap.add_argument("--device", default="cuda", help="cpu: smoke-test this script under TRITON_INTERPRET=1")
    ap.add_argument("--ms", default="32,64,128,256,1024,4096")
    ap.add_argument("--format", default="int4", choices=sorted(FORMATS))
    ap.add_argument("--sweep", action="store_true", help="time every candidate tc config, not only the default")
    ap.add_argument("--wide", action="store_true", help="with --sweep: the large-M grid (wide_configs)")
    ap.add_argument("--humming", action="store_true", help="run Humming live (else last session's numbers)")
    ap.add_argument("--check", action="store_true", help="first: GPU correctness of the packed-asm decodes")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new shapes after this many seconds")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    import triton
    dev = args.device
    gpu = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    if dev != "cuda":  # interpreter smoke test: one timed call instead of CUDA graphs, no Humming
        args.humming = False
        globals()["graph_us"] = lambda fns, reps=1: _wall_us(fns[0])
    meta = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": "python " + " ".join(sys.argv)}
    if args.humming:
        try:
            import humming
            from humming.layer import HummingLayer
            meta["humming"] = humming.__version__
        except Exception as ex:
            meta["humming_error"] = repr(ex)
            args.humming = False
    print(meta, flush=True)
    if args.check:
        gpu_check(dev, 1024 if dev == "cuda" else 256)
    old_hum = last_humming()
    spec = FORMATS[args.format]
    ms = [int(v) for v in args.ms.split(",")]
    jl = open(os.path.join(args.out, "wna16_tc.jsonl"), "a")
    rows = []
    torch.manual_seed(0)
    first_shape = args.shapes.split(",")[0]
    for name in args.shapes.split(","):
        if time.time() - t0 > args.budget_s:
            print(f"budget reached, skipping {name}", flush=True)
            continue
        n, k = SHAPES[name] if name in SHAPES else (int(v) for v in name.split("x"))
        ncop = min(12, max(3, -(-200_000_000 // (n * k // 2))))
        if dev != "cuda":
            ncop = 1
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(ncop)]
        qws = [quantize(w, spec) for w in ws]
        deq0 = dequantize(qws[0])
        fmt = _format_args(qws[0])
        hum = None
        if args.humming and args.format in HUMMING_WCFG:
            try:
                tb = time.time()
                hum = []
                for w in ws[:4]:  # <= 4 copies: the JIT and transform cost dominate this bench's wall time
                    L = HummingLayer(shape_n=n, shape_k=k, weight_config=dict(HUMMING_WCFG[args.format]),
                                     torch_dtype=torch.bfloat16).cuda()
                    L.load_from_unquantized(w)
                    L.transform()
                    hum.append(L)
                print(f"humming {name} built in {time.time() - tb:.1f}s", flush=True)
            except Exception as ex:
                print(f"humming failed: {ex!r}"[:300], flush=True)
                hum = None
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ deq0.t()
            flop = 2.0 * m * n * k
            row = {"shape": name, "M": m, "N": n, "K": k}
            row["cublas_us"] = graph_us([lambda w=w: torch.matmul(x, w.t()) for w in ws])
            if hum is not None:
                try:
                    hum[0](x)
                    row["humming_us"] = graph_us([lambda L=L: L(x) for L in hum])
                except Exception as ex:
                    row["humming_error"] = repr(ex)[:200]
            elif (name, m) in old_hum:
                row["humming_us_last_session"] = old_hum[(name, m)]
            cfg = TuningConfig(gpu).lookup(LayerConfig(spec, n, k), m)
            row["default_config"] = cfg.to_dict()
            try:
                row["default_err"] = ((gemm_wna16(x, qws[0]).float() - ref).norm() / ref.norm()).item()
                row["default_us"] = graph_us([lambda q=q: gemm_wna16(x, q) for q in qws])
            except Exception as ex:
                traceback.print_exc()
                row["default_error"] = repr(ex)[:300]
            if args.sweep:
                row["sweep"] = []
                cands = (wide_configs(m, n, k, spec) if args.wide else
                         sweep_configs(m, n, k, variants=(name == first_shape)))
                for c, kw in cands:
                    if not c.valid_for(LayerConfig(spec, n, k)):
                        continue
                    e = {"config": c.to_dict(), **kw}
                    call = path_call(x, c, fmt, kw)
                    try:
                        tc = time.time()
                        tcmod.LAST_LAUNCH.clear()
                        y = call(qws[0])
                        if dev == "cuda":
                            torch.cuda.synchronize()
                        e["first_call_s"] = round(time.time() - tc, 2)
                        e["err"] = ((y.float() - ref).norm() / ref.norm()).item()
                        kern = tcmod.LAST_LAUNCH.get("kernel")
                        if kern is not None:
                            e["regs"], e["spills"] = getattr(kern, "n_regs", None), getattr(kern, "n_spills", None)
                        e["us"] = graph_us([lambda q=q: call(q) for q in qws])
                        e["tflops"] = flop / e["us"] / 1e6
                    except Exception as ex:
                        e["error"] = repr(ex)[:300]
                    row["sweep"].append(e)
                    print("  ", json.dumps({a: (round(b, 4) if isinstance(b, float) else b) for a, b in e.items()}),
                          flush=True)
                # the tune cache can only store plain configs (no decode / path / group_m overrides)
                ok = [e for e in row["sweep"] if "us" in e and e["err"] < 0.02 and not set(e) & OVERRIDES]
                plain = [e for e in row["sweep"] if "us" in e and e["err"] < 0.02]
                if plain:
                    row["best_any"] = min(plain, key=lambda e: e["us"])
                if ok:
                    best = min(ok, key=lambda e: e["us"])
                    row["best_sweep"] = best
            hum_us = row.get("humming_us", row.get("humming_us_last_session"))
            for p in ("default", "cublas", "humming"):
                us = row.get(f"{p}_us") if p != "humming" else hum_us
                if us:
                    row[f"{p}_tflops"] = flop / us / 1e6
            if "default_us" in row:
                if hum_us:
                    row["default_x_humming"] = hum_us / row["default_us"]
                row["default_x_cublas"] = row["cublas_us"] / row["default_us"]
            if "best_sweep" in row and hum_us:
                row["best_x_humming"] = hum_us / row["best_sweep"]["us"]
            rows.append(row)
            jl.write(json.dumps(row) + "\n")
            jl.flush()
            b = row.get("best_sweep", {})
            print(f"ROW {name} M={m}: default {row.get('default_us', float('nan')):.1f}us "
                  f"({row['default_config']['kernel']}, x hum {row.get('default_x_humming', 0):.2f}, "
                  f"x cublas {row.get('default_x_cublas', 0):.2f}) | best sweep {b.get('us', float('nan')):.1f}us "
                  f"x hum {row.get('best_x_humming', 0):.2f} {b.get('config') and _cfg_str(b['config'])} "
                  f"| cublas {row['cublas_us']:.1f} hum {hum_us}", flush=True)
            ba = row.get("best_any")
            if ba:
                print(f"BEST_ANY {name} M={m}: {ba['us']:.1f}us {_cfg_str(ba['config'])} "
                      f"{ {a: ba[a] for a in OVERRIDES if a in ba} } x hum {hum_us and hum_us / ba['us']}", flush=True)
        del ws, qws, deq0, hum
        if dev == "cuda":
            torch.cuda.empty_cache()
    meta["wall_s"] = round(time.time() - t0, 1)
    cache = {}
    for r in rows:  # the fastest measured config per (shape, M bucket), in kestrel's tune-cache format
        b = r.get("best_sweep")
        if b:
            lay = LayerConfig(spec, r["N"], r["K"])
            h_us = r.get("default_us") and round(r["default_us"], 3)
            cache[cache_key(gpu, lay, m_bucket(r["M"]))] = {"config": b["config"], "us": round(b["us"], 3),
                                                           "heuristic_us": h_us}
    with open(os.path.join(args.out, "tune_tc.json"), "w") as f:
        json.dump(cache, f, indent=1, sort_keys=True)
    write_markdown(meta, rows, os.path.join(args.out, "wna16_tc.md"))
    print(open(os.path.join(args.out, "wna16_tc.md")).read())


def _cfg_str(c: dict) -> str:
    if c["kernel"] == "dequant_mm":
        return f"dequant_mm bn{c['block_n']} w{c['num_warps']}" + (f" ch{c['chunks']}" if c.get("chunks", 1) > 1 else "")
    if c["kernel"] != "tc":
        return c["kernel"] + f" {c['block_m']}x{c['block_n']} w{c['num_warps']} sk{c['split_k']}"
    return (f"tc {c['block_m']}x{c['block_n']}" + (f" bk{c['block_k']}" if c["block_k"] else "") +
            f" w{c['num_warps']} s{c['num_stages']}" + (f" sk{c['split_k']}" if c["split_k"] > 1 else "") +
            (" swap" if c.get("swap") or c["block_m"] < 64 else ""))


def write_markdown(meta, rows, path):
    f = lambda v, p=1: "" if v is None else f"{v:.{p}f}"
    lines = [f"GPU {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, humming {meta.get('humming', '-')}, "
             f"{meta['date']}, wall {meta['wall_s']} s", "", f"Command: `{meta['command']}`", "",
             "kestrel = fastest measured config (what the tune cache stores); default = heuristic before tuning. "
             "x = peer µs / kestrel µs (> 1: kestrel faster).", "",
             "| shape | M | N | K | kestrel config | kestrel µs | Humming µs | cuBLAS µs | kestrel TFLOP/s | "
             "Humming TFLOP/s | cuBLAS TFLOP/s | x Humming | x cuBLAS | rel err | default µs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        hum = r.get("humming_us", r.get("humming_us_last_session"))
        b = r.get("best_sweep") or {}
        us = b.get("us", r.get("default_us"))
        flop = 2.0 * r["M"] * r["N"] * r["K"]
        lines.append("| " + " | ".join([
            r["shape"], str(r["M"]), str(r["N"]), str(r["K"]), _cfg_str(b.get("config", r["default_config"])),
            f(us), f(hum) + ("" if "humming_us" in r or hum is None else " (last)"), f(r["cublas_us"]),
            f(us and flop / us / 1e6, 0), f(hum and flop / hum / 1e6, 0), f(flop / r["cublas_us"] / 1e6, 0),
            f(hum and us and hum / us, 2), f(us and r["cublas_us"] / us, 2), f(b.get("err", r.get("default_err")), 4),
            f(r.get("default_us"))]) + " |")
    open(path, "w").write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
