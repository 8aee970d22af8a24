"""FP8 (or, --w4, int4 W4A8) decode GEMM with fused activation quant (kernels/gemm_w8a8_fused.py): GPU check vs the
float64 reference, then configs timed (CUDA graph, 4 weight copies) beside the separate quant + GEMM path, same
process.

  python bench/w8a8_fused_sweep.py --shape 8192x8192 --ms 1,16
  python bench/w8a8_fused_sweep.py --w4 --quick --ms 1,16
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from gemm_w8a8 import safe_us  # noqa: E402

from kestrel.kernels import act_quant as aq  # noqa: E402
from kestrel.kernels.gemm_w8a8 import gemm_w8a8, quantize_weight_w8a8  # noqa: E402
from kestrel.kernels.gemm_w4a8 import gemm_w4a8, quantize_weight_w4  # noqa: E402
from kestrel.kernels.gemm_w8a8_fused import (FusedConfig, fused_config, gemm_w4a8_fused, gemm_w8a8_fused,  # noqa: E402
                                             ref_act_groups, ref_w8a8_fused)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8192x8192")
    p.add_argument("--ms", default="1,16")
    p.add_argument("--w4", action="store_true", help="W4A8 int4 g128 weights (gemm_w4a8_fused) instead of fp8")
    p.add_argument("--cfgs", default="", help="configs to time beside the default: BN:SPLIT:SWAP:WARPS:STAGES,...")
    p.add_argument("--quick", action="store_true", help="5 configs around the known best instead of 11")
    args = p.parse_args()
    N, K = (int(v) for v in args.shape.split("x"))
    if args.w4:  # int4 g128 in the halves packing: gemm_w4a8_fused, separate = per-token quant + gemm_w4a8
        q = [(quantize_weight_w4(torch.randn(N, K, device="cuda") * 0.02, "int4", 128).kernel_layout(),)
             for _ in range(4)]
        fused, separate = gemm_w4a8_fused, lambda x, w: gemm_w4a8(*aq.quant_fp8(x), w)
    else:
        q = [quantize_weight_w8a8(torch.randn(N, K, device="cuda") * 0.02, "fp8") for _ in range(4)]
        fused, separate = gemm_w8a8_fused, lambda x, w, s: gemm_w8a8(*aq.quant_fp8(x), w, s)
    for M in (int(v) for v in args.ms.split(",")):
        x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
        if args.w4:
            ref = ref_act_groups(x.float()) @ q[0][0].dequantize().double().t()
        else:
            ref = ref_w8a8_fused(x.float(), *q[0])
        r = {"M": M, "N": N, "K": K, "w4": args.w4, "default": fused_config(M, N, K).__dict__}
        r["separate_us"] = safe_us([lambda i=i: separate(x, *q[i]) for i in range(4)])
        bm = 16 if M <= 16 else 32 if M <= 32 else 64
        if args.cfgs:
            cfgs = [None] + [FusedConfig(BM=bm, BN=bn, SPLIT_K=sk, SWAP=sw, num_warps=w, num_stages=st)
                             for bn, sk, sw, w, st in (map(int, c.split(":")) for c in args.cfgs.split(","))]
        elif args.quick:  # around the BN 128 / split 4 winner of the full list (moe_h200_run5_r2.log)
            cfgs = [None] + [FusedConfig(BM=bm, BN=bn, SPLIT_K=sk, SWAP=sw, num_warps=w, num_stages=4)
                             for bn, sk, sw, w in ((128, 2, 1, 4), (128, 8, 1, 4), (128, 4, 0, 4), (128, 4, 1, 8),
                                                   (256, 4, 1, 8))]
        else:
            cfgs = [None] + [FusedConfig(BM=bm, BN=bn, SPLIT_K=sk, SWAP=sw, num_warps=w, num_stages=st)
                             for sw in (1, 0) for bn, sk in ((64, 1), (64, 2), (64, 4), (32, 2), (128, 4))
                             for w, st in ((4, 4),)] + [FusedConfig(BM=bm, BN=64, SPLIT_K=2, SWAP=1, num_warps=4,
                                                                    num_stages=6)]
        for cfg in cfgs:
            tag = "default" if cfg is None else f"bn{cfg.BN}_sk{cfg.SPLIT_K}_sw{cfg.SWAP}_st{cfg.num_stages}" + (
                f"_w{cfg.num_warps}" if cfg.num_warps != 4 else "")
            try:
                y = fused(x, *q[0], config=cfg)
                r[f"{tag}_err"] = ((y.double() - ref).norm() / ref.norm()).item()
                r[f"{tag}_us"] = safe_us([lambda i=i, cfg=cfg: fused(x, *q[i], config=cfg) for i in range(4)])
            except Exception as ex:
                r[f"{tag}_error"] = repr(ex)[:200]
        print("ROW", json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
