"""Issue #3, session 25: the mv kernel's stream-K grid (ComputeConfig.streamk) against the config each layer runs
today (its tune-cache entry, else the heuristic), in one process, on the Llama-3 shapes at small M, int4 g128 and
MXFP4. Every config is checked against dequant + cuBLAS (x @ dequantize(W)^T) before it is timed; times are µs per
call in a CUDA graph rotating over L2-cold weight copies (kestrel.kernels.tuning.time_config_graph, as `kestrel
tune`). Writes the table (stream_k.md), every timing (stream_k.json) and, as tune-cache entries, the stream-K
configs that beat today's (stream_k_tune.json, for bench/merge_tune_cache.py --gpu "...").

  python bench/wna16_streamk_sweep.py --out /tmp/sk                       # 8 shapes x M 1, 4, 16 x 2 formats
  python bench/wna16_streamk_sweep.py --formats int4 --models llama3-70b --ms 16 --streamk 2,3
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kestrel.kernels.configs import ComputeConfig, LayerConfig, TuningConfig, cache_key, m_bucket
from kestrel.kernels.gemm_wna16 import gemm_wna16
from kestrel.kernels.tuning import FORMATS, MODEL_SHAPES, STREAMK_TILES, make_weights, time_config_graph

REF = ComputeConfig("dequant_mm", 1, 64, 128, 1, 4, 1)  # x @ dequantize(W)^T in bf16: shares no code with mv


def desc(c: ComputeConfig) -> str:
    return (f"{c.kernel} {c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages}"
            + (f" sk{c.split_k}" if c.split_k > 1 else "") + (f" bk{c.block_k}" if c.block_k else "")
            + (f" streamk{c.streamk}" if c.streamk else ""))


def sweep(fmt: str, model: str, N: int, K: int, ms: list[int], streamks: list[int], gpu: str,
          device="cuda") -> list[dict]:
    layer = LayerConfig(FORMATS[fmt], N, K)
    weights = make_weights(layer, device)
    rows = []
    for m in ms:
        x = torch.randn(m, K, device=device, dtype=torch.bfloat16)
        ref = gemm_wna16(x, weights[0], REF).float()
        cur = TuningConfig(gpu).lookup(layer, m)
        cands = [cur] + [ComputeConfig(k, 16, bn, bk, 1, w, st, streamk=s) for k, bn, w, bk, st in STREAMK_TILES
                         for s in streamks]
        times = {}
        for c in dict.fromkeys(c for c in cands if c.valid_for(layer)):
            try:
                err = ((gemm_wna16(x, weights[0], c).float() - ref).norm() / ref.norm()).item()
                timed = err < 1e-2  # never time (or store) a config that computes something else
                us = time_config_graph(lambda i, c=c: gemm_wna16(x, weights[i], c), len(weights)) if timed else None
            except Exception as ex:  # a compile failure (registers, shared memory) is a row, not the end
                err, us = repr(ex)[:120], None
            times[c] = us
            rows.append(dict(format=fmt, layer=f"{model}:{N}x{K}", M=m, config=c.to_dict(), desc=desc(c), err=err,
                             us=us, current=c == cur))
        sk = {c: t for c, t in times.items() if c.streamk and t is not None}
        if sk and times.get(cur):
            best = min(sk, key=sk.get)
            rows.append(dict(format=fmt, layer=f"{model}:{N}x{K}", M=m, summary=True, current_desc=desc(cur),
                             current_us=times[cur], best_desc=desc(best), best_us=sk[best],
                             ratio=times[cur] / sk[best], key=cache_key(gpu, layer, m_bucket(m)),
                             best_config=best.to_dict()))
        print(f"{fmt} {model} {N}x{K} M={m}: current {desc(cur)} {times.get(cur)} us; "
              + (f"best stream-K {desc(best)} {sk[best]:.2f} us" if sk else "no stream-K config ran"), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="int4,mxfp4", help="comma list of tuning.FORMATS names")
    ap.add_argument("--models", default="llama3-70b,llama3-8b", help="comma list of tuning.MODEL_SHAPES names")
    ap.add_argument("--ms", default="1,4,16", help="comma list of M (tokens), each <= 16")
    ap.add_argument("--streamk", default="1,2,3,4,6", help="programs per SM to try (ComputeConfig.streamk)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new shapes after this many seconds")
    ap.add_argument("--out", default="bench_out/streamk", help="output folder")
    a = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    ms, sks = [int(v) for v in a.ms.split(",")], [int(v) for v in a.streamk.split(",")]
    t0, rows = time.time(), []
    for fmt in a.formats.split(","):
        for model in a.models.split(","):
            for N, K in MODEL_SHAPES[model]:
                if time.time() - t0 > a.budget_s:
                    print(f"budget: {fmt} {model} {N}x{K} not run")
                    continue
                rows += sweep(fmt, model, N, K, ms, sks, gpu)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "stream_k.json"), "w") as f:
        json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows}, f, indent=1)
    sums = [r for r in rows if r.get("summary")]
    wins = {r["key"]: {"config": r["best_config"], "us": round(r["best_us"], 3),
                       "previous_us": round(r["current_us"], 3)} for r in sums if r["ratio"] > 1.0}
    json.dump(wins, open(os.path.join(a.out, "stream_k_tune.json"), "w"), indent=1)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [f"# mv stream-K vs the config in use — {gpu} — {when}", "",
             "| format | layer | M | in use | µs | best stream-K | µs | in use / stream-K |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['format']} | {r['layer']} | {r['M']} | {r['current_desc']} | {r['current_us']:.2f} | "
              f"{r['best_desc']} | {r['best_us']:.2f} | {r['ratio']:.3f} |" for r in sums]
    open(os.path.join(a.out, "stream_k.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"{len(wins)} of {len(sums)} points faster with stream-K -> {a.out}/stream_k_tune.json")


if __name__ == "__main__":
    main()
