"""Config sweep of the low-bit dense GEMMs (FP8 / INT8 W8A8, int4-g128 W4A8) on Llama-3 shapes, vs cuBLASLt.

One GPU call: phase 1 compiles every (kernel, config) in parallel worker processes (Triton's disk cache then serves
phase 2), phase 2 times each config on each (shape, M) sequentially: CUDA graph of calls rotating over weight copies
(>= 128 MB, L2 holds none), median of 7 replays. Peers in the same process: torch._scaled_mm (fp8, row-wise scales)
and torch._int_mm + torch scale epilogue (int8). Every config's output is checked against dequantize-then-matmul on
the first shape. Writes sweep.json (all times) and best.json (fastest config per kernel / shape / M) to --out.

  python bench/lowbit_sweep.py --out $OUT/sweep --jobs 12
  python bench/lowbit_sweep.py --to-cache sweep/best.json --gpu "NVIDIA H200"   # winners -> packaged tune cache
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kestrel.kernels import act_quant as aq  # noqa: E402
from kestrel.kernels.gemm_w4a8 import gemm_w4a8, quantize_weight_w4  # noqa: E402
from kestrel.kernels.gemm_w8a8 import gemm_w8a8, quantize_weight_w8a8  # noqa: E402
from kestrel.kernels.lowbit_gemm import A_FP8, A_INT8, GemmConfig, heuristic_config  # noqa: E402
from kestrel.kernels.timing import graph_time_us  # noqa: E402

T0 = time.time()
SHAPES = [(8192, 8192), (28672, 8192), (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (10240, 8192),
          (57344, 8192), (8192, 28672)]
KERNELS = ("w8a8-fp8", "w4a8-int4", "w8a8-int8")


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def m_class(M: int) -> str:
    return "decode" if M <= 16 else "mid" if M <= 256 else "large"


def P(bm, bn, w, st, split=1, bk=128):  # pointer kernel, activation rows = MMA rows
    return GemmConfig(BM=bm, BN=bn, BK=bk, SPLIT_K=split, num_warps=w, num_stages=st)


def S(bn, bm, w, st, split=1):  # pointer kernel, swapped: weight rows = MMA rows
    return GemmConfig(BM=bm, BN=bn, BK=128, SPLIT_K=split, num_warps=w, num_stages=st, SWAP_AB=1)


def T(bm, bn, w, st, persistent=False):  # TMA kernel
    return GemmConfig(BM=bm, BN=bn, BK=128, num_warps=w, num_stages=st, TMA=2 if persistent else 1)


DECODE = [S(64, 16, 4, 4), S(128, 16, 4, 4), S(64, 16, 4, 4, 2), S(128, 16, 4, 4, 2), S(64, 16, 4, 4, 4),
          S(128, 16, 4, 3, 4), S(256, 16, 4, 3)]
CONFIGS = {
    "w8a8": {"decode": DECODE,
             "mid": [P(64, 128, 4, 4), P(128, 128, 8, 4), P(64, 256, 8, 3), S(128, 128, 8, 3), S(64, 128, 4, 4),
                     T(128, 128, 8, 4), T(64, 128, 4, 4), T(128, 64, 4, 4), T(64, 256, 8, 3)],
             "large": [P(128, 256, 8, 3), T(128, 128, 8, 4), T(128, 256, 8, 3), T(128, 128, 8, 4, True),
                       T(128, 256, 8, 3, True), T(256, 128, 8, 3)]},
    "w4a8": {"decode": DECODE,
             "mid": [P(64, 128, 4, 4), P(128, 128, 8, 3), S(128, 128, 8, 3), S(64, 128, 4, 4), S(128, 64, 4, 4),
                     S(256, 64, 8, 3)],
             "large": [P(128, 128, 8, 3), P(128, 256, 8, 3), S(128, 128, 8, 3), S(128, 256, 8, 3), S(256, 128, 8, 3),
                       S(64, 256, 4, 3)]},
}


def configs_for(kernel: str, M: int, N: int, K: int) -> list[GemmConfig]:
    a_fmt = A_INT8 if kernel.endswith("int8") else A_FP8
    h = heuristic_config(M, N, K, a_fmt, a_fmt)
    out = [h] + [c for c in CONFIGS[kernel[:4]][m_class(M)] if c != h]
    return [c for c in out if K % (c.BK * c.SPLIT_K) == 0]


def make(kernel, N, K, copies, device="cuda"):
    Ws = [torch.randn(N, K, device=device) * 0.02 for _ in range(copies)]
    if kernel == "w4a8-int4":
        ws = [quantize_weight_w4(W, "int4", 128) for W in Ws]
        return ws, lambda a, s, w, cfg: gemm_w4a8(a, s, w, config=cfg), lambda a, s, w: aq.dequant_8bit(a, s) @ w.dequantize().t()
    ws = [quantize_weight_w8a8(W, kernel[-4:].lstrip("-")) for W in Ws]
    from kestrel.kernels.gemm_w8a8 import ref_gemm_w8a8
    return ws, lambda a, s, w, cfg: gemm_w8a8(a, s, *w, config=cfg), lambda a, s, w: ref_gemm_w8a8(a, s, *w)


def act(kernel, x):
    return aq.quant_int8(x) if kernel.endswith("int8") else aq.quant_fp8(x)


def graph_us(fns) -> float:
    """median µs per call of a CUDA graph of calls rotating over fns (>= 4 calls, 7 replays)."""
    return graph_time_us(fns, calls=max(4, len(fns)), replays=7)


def compile_part(part: int, jobs: int, ms, shapes):
    """phase 1 (worker): run each (kernel, config, M specialisation) once on a small shape of the same
    specialisation (all dims multiples of 16; M == 1 is its own specialisation)."""
    work = []
    for kernel in KERNELS:
        for M in ms:
            for N, K in shapes:
                for c in configs_for(kernel, M, N, K):
                    work.append((kernel, 1 if M == 1 else 16, c))
    work = list(dict.fromkeys(work))
    work = [("moe", M, swap) for M in MOE_MS for swap in (0, 1)][part::jobs] + work[part::jobs]
    cache = {}
    for kernel, M, c in work:
        if kernel == "moe":
            moe_case(M, c)()
            continue
        if kernel not in cache:
            cache[kernel] = make(kernel, 512, 4096, 1)
        ws, run, _ = cache[kernel]
        a, s = act(kernel, torch.randn(M, 4096, device="cuda").to(torch.bfloat16))
        try:
            run(a, s, ws[0], c)
        except Exception as ex:
            print("compile failed", kernel, c, repr(ex)[:200], flush=True)
    torch.cuda.synchronize()


MOE_MS = (1, 16, 128, 1024)
MOE_SHAPE = (128, 8, 2048, 768)  # Qwen3-30B-A3B: experts, top-k, hidden, moe intermediate


def moe_case(M, swap):
    """FusedMoE fp8 W8A8 forward on Qwen3-30B-A3B shapes with the moe_config block sizes, swapped or not."""
    from kestrel.kernels import moe_layer
    from kestrel.kernels.moe_align import route_topk
    from kestrel.kernels.moe_gemm import moe_config
    E, k, H, I = MOE_SHAPE
    g = torch.Generator(device="cuda").manual_seed(0)
    moe = moe_layer.FusedMoE.from_float(torch.randn(E, H, device="cuda", generator=g),
                                        torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02,
                                        torch.randn(E, H, I, device="cuda", generator=g) * 0.02, k, "fp8", "fp8")
    x = torch.randn(M, H, device="cuda", generator=g).to(torch.bfloat16)
    routing = route_topk(x.float() @ moe.router.float().t(), k)

    def cfg(*a):
        import dataclasses
        return dataclasses.replace(moe_config(*a), SWAP_AB=swap)

    def run():
        moe_layer.moe_config = cfg
        try:
            return moe(x, routing)
        finally:
            moe_layer.moe_config = moe_config
    return run


def peers(kernel, M, ws, a, s, fns_out):
    if kernel == "w8a8-fp8":
        rows = [w[1].view(1, -1).contiguous() for w in ws]
        fns_out["scaled_mm"] = [lambda i=i: torch._scaled_mm(a, ws[i][0].t(), scale_a=s, scale_b=rows[i],
                                                             out_dtype=torch.bfloat16) for i in range(len(ws))]
    elif kernel == "w8a8-int8" and M > 16:
        fns_out["int_mm"] = [lambda i=i: (torch._int_mm(a, ws[i][0].t()).float() * s * ws[i][1]).to(torch.bfloat16)
                             for i in range(len(ws))]


def to_cache(best_path: str, gpu: str, skip: str):
    from kestrel.kernels.configs import m_bucket, shape_key, store_cache
    from kestrel.kernels.lowbit_tune import PACKAGED_CACHE
    skips = dict((k, int(m)) for k, m in (s.split(":") for s in skip.split(",") if s))
    entries = {}
    for key, v in json.load(open(best_path)).items():
        kernel, N, K, M = key.split("|")
        if kernel in skips and int(M) >= skips[kernel]:
            continue
        entries[shape_key(gpu, kernel, int(N), int(K), m_bucket(int(M)))] = {
            "config": v["config"], "us": round(v["us"], 2),
            "heuristic_us": v["heuristic_us"] and round(v["heuristic_us"], 2)}
    store_cache(PACKAGED_CACHE, entries)
    print(f"{len(entries)} entries -> {PACKAGED_CACHE}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default="1,16,128,1024,4096")
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--jobs", type=int, default=8, help="parallel compile workers (0: compile inline)")
    p.add_argument("--compile-part", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--deadline-s", type=float, default=float("inf"))
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--to-cache", default=None, help="write the winners of this best.json into the packaged cache")
    p.add_argument("--gpu", default="NVIDIA H200", help="GPU name of the --to-cache entries")
    p.add_argument("--skip", default="w4a8-int4:257", help="kernel:min_M entries left to the heuristic")
    args = p.parse_args()
    if args.to_cache:
        to_cache(args.to_cache, args.gpu, args.skip)
        return
    ms = [int(v) for v in args.ms.split(",")]
    if args.compile_part >= 0:
        compile_part(args.compile_part, args.jobs, ms,
                     [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")])
        return
    if args.jobs:
        procs = [subprocess.Popen([sys.executable, __file__, "--ms", args.ms, "--jobs", str(args.jobs), "--shapes", args.shapes,
                                   "--compile-part", str(i)]) for i in range(args.jobs)]
        for pr in procs:
            pr.wait()
        log("compile phase done")
    os.makedirs(args.out, exist_ok=True)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows, best = [], {}
    meta = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "torch": torch.__version__, "command": " ".join(sys.argv)}
    moe_rows = []
    for M in MOE_MS:  # MoE grouped GEMM (fp8): swap-AB or not, whole layer incl. align
        try:
            runs = [moe_case(M, sw) for sw in (0, 1)]
            y0, y1 = runs[0]().float(), runs[1]().float()
            moe_rows.append({"M": M, "base_us": graph_us([runs[0]]), "swap_us": graph_us([runs[1]]),
                             "swap_vs_base_err": ((y1 - y0).norm() / y0.norm()).item()})
            log("moe", moe_rows[-1])
        except Exception as ex:
            log("  moe failed", M, repr(ex)[:200])
    meta["moe_qwen3_fp8"] = moe_rows
    for si, (N, K) in enumerate(shapes):
        if time.time() - T0 > args.deadline_s:
            log("deadline: stopping")
            break
        for kernel in args.kernels.split(","):
            wbytes = N * K // (2 if "w4" in kernel else 1)
            copies = max(1, min(4, math.ceil((128 << 20) / wbytes)))
            ws, run, ref = make(kernel, N, K, copies)
            for M in ms:
                x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
                a, s = act(kernel, x)
                r = {"kernel": kernel, "M": M, "N": N, "K": K, "cfg": {}}
                refv = ref(a, s, ws[0]).float() if si == 0 else None
                for c in configs_for(kernel, M, N, K):
                    key = json.dumps(c.as_dict(), sort_keys=True)
                    try:
                        if refv is not None:
                            y = run(a, s, ws[0], c).float()
                            r.setdefault("err", {})[key] = ((y - refv).norm() / refv.norm()).item()
                        r["cfg"][key] = graph_us([lambda i=i, c=c: run(a, s, ws[i], c) for i in range(copies)])
                    except Exception as ex:
                        r["cfg"][key] = None
                        log("  failed", kernel, M, c, repr(ex)[:160])
                        torch.cuda.synchronize()
                pf = {}
                peers(kernel, M, ws, a, s, pf)
                for name, fns in pf.items():
                    try:
                        r[name + "_us"] = graph_us(fns)
                    except Exception as ex:
                        log("  peer failed", name, repr(ex)[:160])
                ok = {k: v for k, v in r["cfg"].items() if v}
                if ok:
                    bk = min(ok, key=ok.get)
                    heur = json.dumps(configs_for(kernel, M, N, K)[0].as_dict(), sort_keys=True)
                    best[f"{kernel}|{N}|{K}|{M}"] = {"config": json.loads(bk), "us": ok[bk],
                                                     "heuristic_us": r["cfg"].get(heur),
                                                     **{k: v for k, v in r.items() if k.endswith("_us")}}
                    b = best[f"{kernel}|{N}|{K}|{M}"]
                    peer = next((v for k, v in r.items() if k.endswith("_us")), None)
                    log(f"{kernel} M={M} {N}x{K}: best {b['us']:.1f} us (heur {b['heuristic_us']}) peer {peer} "
                        f"{ {k: v for k, v in b['config'].items() if k in ('BM', 'BN', 'SPLIT_K', 'num_warps', 'num_stages', 'SWAP_AB', 'TMA')} }")
                if "err" in r:
                    bad = {k: v for k, v in r["err"].items() if v > 1e-2}
                    if bad:
                        log("  WRONG RESULTS", bad)
                rows.append(r)
            del ws
            torch.cuda.empty_cache()
            with open(os.path.join(args.out, "sweep.json"), "w") as f:
                json.dump({"meta": meta, "rows": rows}, f)
            with open(os.path.join(args.out, "best.json"), "w") as f:
                json.dump(best, f, indent=0)
    log("done")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
