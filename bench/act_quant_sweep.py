"""Per-token 8-bit activation quant alone on one GPU: kestrel's act_quant under a few launch settings, side by side in
one process, against the bytes it must move (read bf16 + write the codes) at the measured copy bandwidth.

Why: in W8A8 / W4A8 e2e the quant is the part that is not the GEMM, and at M = 256 x K = 28672 it took 25-36 us on
the H100 (session 16) where its bytes take ~7. Variants: BLOCK_MAX (widest single trip: 32768 spills 656 B of stack
per thread offline, 16384 none) and CHUNK_PROGRAMS (how many programs few rows are spread over). Timing: a CUDA
graph of 20 calls on the same x (so x is read from the L2 after the first call, as a layer's output usually is when
its GEMM's quant reads it; the floor column counts HBM bytes, so it is a bound, not a like-for-like peer).

  python bench/act_quant_sweep.py --ms 1,16,64,256,1024 --ks 4096,14336,28672
(perm_quant_us: quant_fp8(perm=True), the permuted-K activations of gemm_w4a8_tcg's PK decode; native_quant_us:
act_quant.NATIVE_CVT, the hardware e4m3 conversion)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from gpu_timing import copy_bandwidth, graph_us  # noqa: E402

from kestrel.kernels import act_quant  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default="1,16,64,256,1024", help="comma list of token counts M")
    p.add_argument("--ks", default="4096,14336,28672", help="comma list of row widths K")
    p.add_argument("--block-max", default="8192,16384,32768", help="comma list of act_quant.BLOCK_MAX values")
    p.add_argument("--chunk-programs", default="264,528", help="comma list of act_quant.CHUNK_PROGRAMS values")
    p.add_argument("--out", default=None, help="JSON file for the raw rows")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("act_quant_sweep needs a CUDA GPU")
    bw = copy_bandwidth()["rw_TBps"]
    print(f"GPU {torch.cuda.get_device_name()}, copy {bw:.3f} TB/s (read + write)")
    rows = []
    for K in map(int, args.ks.split(",")):
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref_q, ref_s = act_quant.ref_quant_fp8(x)
            floor_us = M * K * 3 / (bw * 1e12) * 1e6
            for bm in map(int, args.block_max.split(",")):
                for cp in map(int, args.chunk_programs.split(",")):
                    act_quant.BLOCK_MAX, act_quant.CHUNK_PROGRAMS = bm, cp
                    q, s = act_quant.quant_fp8(x)
                    ok = torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
                    # how far from the torch reference, when not bit-exact: codes that differ, worst scale ratio
                    code_diff = int((q.view(torch.uint8) != ref_q.view(torch.uint8)).sum())
                    scale_rel = float(((s.float() - ref_s.float()).abs() / ref_s.float().abs().clamp_min(1e-30)).max())
                    us = graph_us([lambda: act_quant.quant_fp8(x)])
                    fq = graph_us([lambda: act_quant.fake_quant_fp8(x)])
                    # perm=True (gemm_w4a8_tcg's permuted-K activations): same codes in k_perm128's order
                    pq, ps = act_quant.quant_fp8(x, perm=True)
                    perm_ok = torch.equal(pq.view(torch.uint8), q[:, act_quant.k_perm128(K, x.device)]
                                          .view(torch.uint8)) and torch.equal(ps, s)  # (vs the plain kernel)
                    pus = graph_us([lambda: act_quant.quant_fp8(x, perm=True)])
                    # NATIVE_CVT: the hardware e4m3 conversion instead of round_e4m3 (codes vs the plain kernel's)
                    native_saved, act_quant.NATIVE_CVT = act_quant.NATIVE_CVT, True
                    try:
                        nq, ns = act_quant.quant_fp8(x)
                        native_ok = torch.equal(nq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(ns, s)
                        nus = graph_us([lambda: act_quant.quant_fp8(x)])
                    finally:
                        act_quant.NATIVE_CVT = native_saved
                    row = dict(M=M, K=K, block_max=bm, chunk_programs=cp, quant_us=round(us, 2),
                               perm_quant_us=round(pus, 2), native_quant_us=round(nus, 2), fake_quant_us=round(fq, 2),
                               floor_us=round(floor_us, 2), bit_exact=ok, perm_bit_exact=perm_ok,
                               native_bit_exact=native_ok, code_diff=code_diff, scale_rel_diff=scale_rel)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), copy_rw_TBps=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
