"""Time a few explicit WNA16 compute configs against the dispatch default at given (shape, M), in one process.

Each config is first checked against x @ dequantize(W)^T in fp32 (rel err printed), then timed as a CUDA graph of
20 calls rotating over >= 200 MB of weight copies (L2 cold), median of 20 replays: the same timing as
bench/gemm_wna16.py and `kestrel tune`. For quick GPU-round questions such as "does swap-AB win at M = 64".

  python bench/wna16_config_probe.py --shapes 8192,8192 --ms 64 \
      --configs "tc,64,128,0,4,8,3,swap" "tc,64,128,0,4,8,4,swap"
Config: kernel,block_m,block_n,block_k,split_k,num_warps,num_stages[,swap][,field=N][,acq_rel][,loop=N][@M]:
field=N sets any other ComputeConfig field (chunks, reduce, maxnreg), "acq_rel" runs a tc split-K config with the
old acq_rel atomics (gemm_wna16_tc's atomic_sem, for A/B against the relaxed default), "loop=N" a tcg swap config
with another K loop (gemm_wna16_tcg.SWAP_LOOP: 0 the old racy one, 1 paired K steps), "@M" probes it at that M only.
--ab-default also times the default with loops 0 and 1; --unchecked also probes configs valid_for rejects.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from gpu_timing import graph_us
from kestrel.kernels.configs import ComputeConfig, LayerConfig, TuningConfig
from kestrel.kernels.gemm_wna16 import _format_args, gemm_wna16
from kestrel.kernels import gemm_wna16_tcg as tcg
from kestrel.kernels.gemm_wna16_tc import gemm_wna16_tc
from kestrel.kernels.gemm_wna16_tcg import gemm_wna16_tcg
from kestrel.kernels.tuning import FORMATS, make_weights, warm_compile
from kestrel.quant import dequantize


def parse_config(s: str) -> tuple[ComputeConfig, int | None, dict]:
    s, _, at = s.partition("@")
    f = s.split(",")
    extra = {"swap": "swap" in f[7:]}
    extra.update({k: int(v) for k, v in (t.split("=") for t in f[7:] if "=" in t)})
    kw = {"atomic_sem": "acq_rel"} if "acq_rel" in f[7:] else {}
    if "loop" in extra:
        kw["loop"] = extra.pop("loop")
    return ComputeConfig(f[0], *(int(v) for v in f[1:7]), **extra), int(at) if at else None, kw


def _loop0():
    """warm_compile worker initializers: compile the tcg swap kernels with another K loop."""
    tcg.SWAP_LOOP = 0


def _loop1():
    tcg.SWAP_LOOP = 1


def run(x, w, cfg, kw):
    if "loop" in kw:
        default, tcg.SWAP_LOOP = tcg.SWAP_LOOP, kw["loop"]
        try:
            return gemm_wna16_tcg(x, w, cfg)  # not gemm_wna16: --unchecked configs are refused there
        finally:
            tcg.SWAP_LOOP = default
    if not kw:
        return gemm_wna16_tcg(x, w, cfg) if cfg.kernel == "tcg" and not cfg.valid_for(
            LayerConfig(w.spec, *w.shape)) else gemm_wna16(x, w, cfg)
    return gemm_wna16_tc(x, w, cfg, _format_args(w), **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="int4", choices=sorted(FORMATS))
    ap.add_argument("--shapes", default="8192,8192", help="N,K;N,K list")
    ap.add_argument("--ms", default="64")
    ap.add_argument("--configs", nargs="+", required=True)
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new shapes after this many seconds")
    ap.add_argument("--jobs", type=int, default=0, help="JIT-compile every probed config first in this many worker "
                                                       "processes (kestrel.kernels.tuning.warm_compile)")
    ap.add_argument("--ab-default", action="store_true", help="also the default with the old tcg swap K loop")
    ap.add_argument("--unchecked", action="store_true", help="also configs valid_for rejects (diagnosis only)")
    args = ap.parse_args()
    t0, gpu = time.time(), torch.cuda.get_device_name()
    ok = (lambda c, lay: c.valid_for(lay) or (args.unchecked and c.kernel == "tcg"))
    cfgs = [parse_config(c) for c in args.configs]
    if args.jobs:  # the acq_rel A/B variants compile in the timing process (warm_compile calls gemm_wna16)
        layers = [LayerConfig(FORMATS[args.format], *(int(v) for v in sh.split(","))) for sh in args.shapes.split(";")]
        ms = [int(v) for v in args.ms.split(",")]
        jobs = [(lay, m, c) for lay in layers for m in ms for c, at, kw in cfgs
                if not kw and c.valid_for(lay) and at in (None, m)]
        jobs += [(lay, m, TuningConfig(gpu).lookup(lay, m)) for lay in layers for m in ms]  # the defaults too
        threads = []
        for loop, init in ((0, _loop0), (1, _loop1)):  # the other-loop variants in their own workers, beside
            other = [(lay, m, c) for lay in layers for m in ms for c, at, kw in cfgs if kw.get("loop") == loop
                     and c.valid_for(lay) and at in (None, m)]
            if args.ab_default:
                other += [(lay, m, TuningConfig(gpu).lookup(lay, m)) for lay in layers for m in ms]
            other = [j for j in other if j[2].kernel == "tcg" and j[2].swap]
            if other:
                import threading
                threads.append(threading.Thread(target=warm_compile, args=(other, max(1, args.jobs // 3)),
                                                kwargs={"init": init}, daemon=True))
                threads[-1].start()
        warm_compile(jobs, args.jobs)
        for th in threads:
            th.join()
        # (configs valid_for rejects compile in the timing process: warm_compile goes through gemm_wna16)
    for shape in args.shapes.split(";"):
        if time.time() - t0 > args.budget_s:
            print("budget reached, skipping", shape, flush=True)
            continue
        n, k = (int(v) for v in shape.split(","))
        layer = LayerConfig(FORMATS[args.format], n, k)
        ws = make_weights(layer, "cuda", min_bytes=200 << 20, max_copies=12)
        deq = dequantize(ws[0]).float()
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ deq.t()
            default = TuningConfig(gpu).lookup(layer, m)
            ab = ([("default", default, {"loop": lp}) for lp in (0, 1)]
                  if args.ab_default and default.kernel == "tcg" and default.swap else [])
            for name, cfg, kw in [("default", default, {})] + ab + [("probe", c, kw) for c, at, kw in cfgs
                                                                      if ok(c, layer) and at in (None, m)]:
                row = {"fmt": args.format, "N": n, "K": k, "M": m, "which": name, "config": cfg.to_dict(), **kw}
                try:
                    y = run(x, ws[0], cfg, kw).float()
                    row["err"] = round(((y - ref).norm() / ref.norm()).item(), 5)
                    row["us"] = round(graph_us([lambda w=w: run(x, w, cfg, kw) for w in ws],
                                               20 if m < 1024 else 8), 2)
                except Exception as ex:  # the compiler may reject a tile (shared memory, registers)
                    row["error"] = repr(ex)[:200]
                print("PROBE " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
