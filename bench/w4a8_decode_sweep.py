"""W4A8 (int4 g128 x fp8) int4 -> e4m3 decode variants vs Humming W4A8, one process, correctness first.

Variants (kestrel.kernels.lowbit_gemm.DECODE_ASM): 0 = Triton integer / f16 ops per nibble (the previous kernel),
1 / 2 = inline-PTX decode of 4 packed bytes at a time (LOP3 -> f16x2 -> cvt e4m3x2 -> PRMT), the two candidate
byte orders of cvt's packed output. A variant whose output is not the reference's (rel. error vs dequantize-then-
matmul in float64 > 1e-2) is reported and not timed.

  python bench/w4a8_decode_sweep.py --ms 1,16,128,1024,4096 --out $OUT/w4
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from gemm_w8a8 import copies_for, humming_build, humming_layer, log, safe_us  # noqa: E402

from kestrel.kernels import act_quant as aq  # noqa: E402
from kestrel.kernels import lowbit_gemm  # noqa: E402
from kestrel.kernels.gemm_w4a8 import gemm_w4a8, quantize_weight_w4, w4a8_linear  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8192x8192")
    p.add_argument("--ms", default="1,16,128,1024,4096")
    p.add_argument("--variants", default="0,1")
    p.add_argument("--humming", type=int, default=1)
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    N, K = (int(v) for v in args.shape.split("x"))
    ms = [int(v) for v in args.ms.split(",")]
    nc = copies_for(N * K // 2)
    Ws = [torch.randn(N, K, device="cuda") * 0.02 for _ in range(nc)]
    w4 = [quantize_weight_w4(W, "int4", 128).kernel_layout() for W in Ws]
    wdq = w4[0].dequantize().double()
    ok = {}
    for v in (int(x) for x in args.variants.split(",")):
        lowbit_gemm.DECODE_ASM = v
        errs = []
        for M in (3, 64, 300):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            a, s = aq.quant_fp8(x)
            ref = aq.dequant_8bit(a, s).double() @ wdq.t()
            y = gemm_w4a8(a, s, w4[0]).double()
            errs.append(((y - ref).norm() / ref.norm()).item())
        ok[v] = max(errs) < 1e-2
        log(f"variant {v}: rel err vs float64 dequant-matmul {['%.2e' % e for e in errs]} -> {'OK' if ok[v] else 'WRONG'}")
    hum = None
    if args.humming:
        Wb = [W.to(torch.bfloat16) for W in Ws]
        hum = humming_build("w4a8", lambda: [humming_layer(N, K, {"dtype": "int4", "group_size": 128},
                                                           {"dtype": "float8e4m3"}, W) for W in Wb], 1e9)
    rows = []
    for M in ms:
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        a, s = aq.quant_fp8(x)
        r = {"M": M, "N": N, "K": K}
        for v, good in ok.items():
            if not good:
                continue
            lowbit_gemm.DECODE_ASM = v
            r[f"gemm_v{v}_us"] = safe_us([lambda i=i: gemm_w4a8(a, s, w4[i]) for i in range(nc)])
            r[f"e2e_v{v}_us"] = safe_us([lambda i=i: w4a8_linear(x, w4[i]) for i in range(nc)])
        r["act_quant_us"] = safe_us([lambda: aq.quant_fp8(x)])
        if hum is not None:
            r["humming_w4a8_e2e_us"] = safe_us([lambda L=L: L(x) for L in hum])
            for v in ok:
                if r.get(f"e2e_v{v}_us") and r.get("humming_w4a8_e2e_us"):
                    r[f"ratio_v{v}"] = round(r["humming_w4a8_e2e_us"] / r[f"e2e_v{v}_us"], 3)
        rows.append(r)
        log("ROW", json.dumps(r))
    with open(os.path.join(args.out, "w4a8_decode_sweep.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "ok": ok, "rows": rows, "time": time.ctime()}, f, indent=1)


if __name__ == "__main__":
    main()
