"""One launch each of the Gluon W4A8 kernels (int4 256-token halves, MXFP4 fold) on a Llama-70B down shape, for a
profiler to capture (ncu; the kernels warm up first, so `--launch-skip 2 --launch-count 1` per kernel name takes a
steady launch). Without a profiler it prints each kernel's time (CUDA events, 20 launches).

  ncu --kernel-name regex:_w4a8 --launch-skip 2 --launch-count 2 --section SpeedOfLight --section WarpStateStats \
      python bench/w4a8_tcg_profile.py --m 4096
"""
from __future__ import annotations

import argparse

import torch

from kestrel.kernels import act_quant as aq
from kestrel.kernels.gemm_w4a8 import quantize_weight_w4
from kestrel.kernels.gemm_w4a8_tcg import gemm_w4a8_fold_tcg, gemm_w4a8_tcg


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, default=4096, help="tokens")
    p.add_argument("--n", type=int, default=8192, help="output features")
    p.add_argument("--k", type=int, default=28672, help="input features")
    p.add_argument("--iters", type=int, default=20, help="timed launches per kernel (after 2 warm-up)")
    a = p.parse_args()
    W = torch.randn(a.n, a.k, device="cuda") * 0.02
    x = torch.randn(a.m, a.k, device="cuda").to(torch.bfloat16)
    q, s = aq.quant_fp8(x)
    w4 = quantize_weight_w4(W, "int4", 128).kernel_layout()
    mx = quantize_weight_w4(W, "mxfp4")
    t4, tm, fm = w4.wna16(), mx.wna16(), mx.fold_mult()
    for name, fn in (("int4 halves", lambda: gemm_w4a8_tcg(q, s, t4)),
                     ("mxfp4 fold", lambda: gemm_w4a8_fold_tcg(q, s, tm, *fm))):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(a.iters):
            fn()
        e1.record()
        torch.cuda.synchronize()
        us = e0.elapsed_time(e1) * 1e3 / a.iters
        print(f"{name}: {us:.1f} us/launch, {2 * a.m * a.n * a.k / us / 1e6:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
