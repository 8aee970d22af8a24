"""One launch each of kestrel's grouped int4 MoE GEMM (moe_tcg, or a --tcg config) and Humming's indexed grouped GEMM
on one expert shape, between cudaProfilerStart / Stop: run it under `ncu --profile-from-start off` to see where the
two kernels spend their time (tensor pipe use, stall reasons, occupancy). Prints Humming's heuristic config and the
checked error of ours; the launches are warmed (JIT) before the profiled region.

  ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats python bench/moe_profile.py
  python bench/moe_profile.py --shape qwen3-30b-a3b-down --tcg 64:256:8:3:8:1
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from moe_sweep import SHAPES, humming_call, humming_up, random_planar, ref_rows_planar, routing  # noqa: E402

from kestrel.kernels import moe_align as ma  # noqa: E402
from kestrel.kernels.moe_tcg import TcgConfig, grouped_gemm_planar_tcg, supports  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b", help=f"one of {','.join(SHAPES)}")
    p.add_argument("--M", type=int, default=1024, help="tokens (slots = M x top-k)")
    p.add_argument("--tcg", default="64:256:8:3:8:1", help="kestrel config BM:BN:warps:stages:GROUP_M:SWAP")
    p.add_argument("--humming", type=int, default=1, help="0: kestrel only")
    args = p.parse_args()
    E, k, N, K = SHAPES[args.shape]
    M, T = args.M, args.M * k
    cfg = TcgConfig(*(int(v) for v in args.tcg.split(":")))
    P = random_planar(E, N, K)
    ids = routing(M, E, k, 0)
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    al = ma.moe_align(ids, E, cfg.BM)
    out = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
    print("supported", supports(x, P, cfg), cfg, flush=True)
    run = lambda: grouped_gemm_planar_tcg(x, P, al, T, k, out, cfg)
    run()
    slots = torch.randperm(T)[:16].tolist()
    want = ref_rows_planar(x, P, ids, slots, k)
    print("kestrel err", ((out[slots].float() - want).norm() / want.norm()).item(), flush=True)
    hum = None
    if args.humming:
        hum = humming_call(humming_up(E, N, K), x, ids, E, k)
        print("humming cfg", hum.cfg, flush=True)
        hum()
    for f in (run, hum):  # event times of one warm launch (L2 warm: the profiler's view, not the bench's)
        if f is None:
            continue
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        f(); s.record(); f(); e.record(); e.synchronize()
        print("warm launch us", "kestrel" if f is run else "humming", s.elapsed_time(e) * 1e3, flush=True)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    if hum is not None:
        hum()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
