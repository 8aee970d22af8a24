"""GPU diagnostic for tcg tiles that valid_for excludes (the swap kernel with 256 x rows gave NaN on the H200, session 4
round 1): runs gemm_wna16_tcg directly, bypassing the dispatch's checks, and prints per config the rel err vs
x @ dequantize(W)^T, where the NaNs are (per 64-row block of M x 64-column block of N: '#' all NaN, '+' some, '.'
none) and the compiled kernel's registers / spills / shared memory, so a smem-size, register or tile-position cause
can be told apart.

  python bench/wna16_tcg_diag.py --shape 8192,8192 --m 256 --configs tcg,256,128,0,1,8,3,swap tcg,256,128,0,1,8,2,swap
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from wna16_config_probe import parse_config  # noqa: E402
from kestrel.kernels.tuning import FORMATS  # noqa: E402
from kestrel.quant import dequantize, quantize  # noqa: E402


def kernel_info(kern) -> list[dict]:
    """registers / spills / shared bytes of every specialisation of a Gluon/Triton JIT function compiled so far."""
    out = []
    try:
        for cache in kern.device_caches.values():
            cache = cache[0] if isinstance(cache, tuple) else cache
            for ck in cache.values():
                out.append({"regs": getattr(ck, "n_regs", None), "spills": getattr(ck, "n_spills", None),
                            "shared": getattr(getattr(ck, "metadata", None), "shared", None),
                            "consts": str(getattr(getattr(ck, "src", None), "constants", ""))[:160]})
    except Exception as ex:
        out.append({"error": repr(ex)[:200]})
    return out


def nan_map(y: torch.Tensor, blk: int = 64) -> list[str]:
    m, n = y.shape
    bad = ~torch.isfinite(y)
    rows = []
    for i in range(0, m, blk):
        s = ""
        for j in range(0, n, blk):
            b = bad[i:i + blk, j:j + blk]
            s += "#" if b.all() else "+" if b.any() else "."
        rows.append(s)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="int4", choices=sorted(FORMATS))
    ap.add_argument("--shape", default="8192,8192")
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--configs", nargs="+", required=True)
    args = ap.parse_args()
    from kestrel.kernels import gemm_wna16_tcg as tcg
    n, k = (int(v) for v in args.shape.split(","))
    torch.manual_seed(0)
    qw = quantize(torch.randn(n, k, device="cuda") * 0.02, FORMATS[args.format])
    x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ dequantize(qw).float().t()
    for s in args.configs:
        cfg = parse_config(s)[0]
        t0 = time.time()
        row = {"config": s}
        try:
            y = tcg.gemm_wna16_tcg(x, qw, cfg).float()
            torch.cuda.synchronize()
            fin = torch.isfinite(y)
            row["nan_frac"] = round(1 - fin.float().mean().item(), 4)
            row["err_finite"] = round(((y - ref)[fin].norm() / ref[fin].norm()).item(), 5) if fin.any() else None
            row["nan_map_64"] = nan_map(y)[:8]
        except Exception as ex:
            row["error"] = repr(ex)[:300]
        row["s"] = round(time.time() - t0, 1)
        kern = tcg._tcgs_kernel if cfg.swap and cfg.ws != 2 else tcg._tcgs2_kernel if cfg.swap else tcg._tcg_kernel
        row["compiled"] = kernel_info(kern)[-1:]
        print("DIAG " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
