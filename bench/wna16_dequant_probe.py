"""Large-M dequant + cuBLAS variants on one GPU: old dequant pass vs dequantize_tc (each word loaded once, packed
decode) vs N-chunked dequant into a reused scratch (bf16 chunk read back from L2), beside cuBLAS bf16.

  python bench/wna16_dequant_probe.py --shapes 70b:o,8b:gate_up,8b:qkv --ms 256,1024
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gpu_timing import graph_us  # noqa: E402
from kestrel.kernels.gemm_wna16 import _format_args, dequantize_gpu  # noqa: E402
from kestrel.kernels.gemm_wna16_tc import dequant_matmul_chunked, dequantize_tc  # noqa: E402
from kestrel.kernels.tuning import FORMATS, MODEL_SHAPES  # noqa: E402
from kestrel.quant import dequantize, quantize  # noqa: E402

NAMES = ["qkv", "o", "gate_up", "down"]
SHAPES = {f"{m[7:]}:{NAMES[i]}": nk for m in MODEL_SHAPES for i, nk in enumerate(MODEL_SHAPES[m])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="70b:o,8b:gate_up,8b:qkv")
    ap.add_argument("--ms", default="256,1024")
    ap.add_argument("--formats", default="int4,mxfp4")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    jl = open(os.path.join(a.out, "dequant_probe.jsonl"), "a")
    for fname in a.formats.split(","):  # correctness first (GPU packed decode paths)
        qw = quantize(torch.randn(1024, 1024, device="cuda") * 0.02, FORMATS[fname])
        ref = dequantize(qw)
        for bn, nw in ((128, 8), (64, 4)):
            w = dequantize_tc(qw, _format_args(qw), torch.bfloat16, bn, nw)
            e = ((w.float() - ref).norm() / ref.norm()).item()
            print(f"CHECK dequantize_tc {fname} bn{bn} w{nw}: {e:.2e} {'OK' if e < 1e-2 else 'FAIL'}", flush=True)
        x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
        r = x.float() @ ref.t()
        y = dequant_matmul_chunked(x, qw, _format_args(qw), 384)
        e = ((y.float() - r).norm() / r.norm()).item()
        print(f"CHECK chunked {fname}: {e:.2e} {'OK' if e < 1e-2 else 'FAIL'}", flush=True)
    spec = FORMATS["int4"]
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        ncop = min(8, max(3, -(-200_000_000 // (n * k // 2))))
        qws = [quantize(torch.randn(n, k, device="cuda") * 0.02, spec) for _ in range(ncop)]
        fmt = _format_args(qws[0])
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(min(ncop, 4))]
        row = {"shape": name, "N": n, "K": k}
        row["deq_old_us"] = graph_us([lambda q=q: dequantize_gpu(q, torch.bfloat16, 64, 128) for q in qws])
        for bn, nw in ((128, 8), (64, 4), (256, 8)):
            try:
                row[f"deq_tc_bn{bn}w{nw}_us"] = graph_us([lambda q=q: dequantize_tc(q, fmt, torch.bfloat16, bn, nw)
                                                          for q in qws])
            except Exception as ex:
                row[f"deq_tc_bn{bn}w{nw}_err"] = repr(ex)[:200]
        row["deq_bytes"] = n * k * 2 + qws[0].nbytes
        print(json.dumps(row), flush=True)
        jl.write(json.dumps(row) + "\n")
        for m in [int(v) for v in a.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            r = {"shape": name, "M": m, "N": n, "K": k}
            r["cublas_us"] = graph_us([lambda w=w: torch.matmul(x, w.t()) for w in wb])
            r["deq_old_mm_us"] = graph_us([lambda q=q: x @ dequantize_gpu(q, torch.bfloat16, 64, 128).t() for q in qws])
            r["deq_tc_mm_us"] = graph_us([lambda q=q: x @ dequantize_tc(q, fmt, torch.bfloat16).t() for q in qws])
            for cn in (8192, 4096, 2048):
                if cn < n:
                    r[f"chunk{cn}_us"] = graph_us([lambda q=q: dequant_matmul_chunked(x, q, fmt, cn) for q in qws])
            print(json.dumps(r), flush=True)
            jl.write(json.dumps(r) + "\n")
        del qws, wb
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
