"""GPU check of the mv kernel's inline-PTX e2m1 decode: MXFP4 and NVFP4 weights, bf16 and fp16 activations, mv
and mvs (swapped operands), M = 1 / 5 / 16 with split-K, against x @ dequantize(W)^T in float64 (tolerance 1e-2,
as tests/test_gemm_wna16.py). Prints one line per case and exits 1 on any miss.

  python bench/wna16_fp4_decode_check.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kestrel.kernels.configs import ComputeConfig  # noqa: E402
from kestrel.kernels.gemm_wna16 import gemm_wna16  # noqa: E402
from kestrel.kernels.tuning import FORMATS  # noqa: E402
from kestrel.quant import dequantize, quantize  # noqa: E402


def main():
    bad = 0
    g = torch.Generator().manual_seed(0)
    for fmt in ("mxfp4", "nvfp4"):
        qw = quantize(torch.randn(320, 1024, generator=g) * 0.02, FORMATS[fmt]).to("cuda")
        deq = dequantize(qw).double()
        for dt in (torch.bfloat16, torch.float16):
            for m, cfg in ((1, ComputeConfig("mv", 16, 128, 0, 4, 2, 3)), (5, ComputeConfig("mv", 16, 64, 0, 2, 4, 2)),
                           (16, ComputeConfig("mvs", 16, 64, 0, 2, 4, 2))):
                x = torch.randn(m, 1024, generator=g).to(dt).cuda()
                ref = x.double() @ deq.t()
                err = ((gemm_wna16(x, qw, cfg).double() - ref).norm() / ref.norm()).item()
                ok = err < 1e-2
                bad += not ok
                print(f"{fmt} {str(dt)[6:]} M={m} {cfg.kernel}: rel err {err:.3g} {'ok' if ok else 'WRONG'}", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
