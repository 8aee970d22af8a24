"""Offline sm_90a compile of the W4A8 GEMM (lowbit_gemm._qgemm_kernel: int4 g128 weights x fp8 per-token
activations, swapped operands) on a machine without a GPU: registers, spills, shared memory, CTAs per SM and the
K loop's SASS per tile config — here the M = 64 options for the under-filled grid (K split, 32-row tiles). Run with
the H200's Triton for its numbers; not a correctness check (the CPU interpreter tests are: tests/test_gemm_w4a.py).

  PYTHONPATH=/tmp/t36:$PWD python bench/w4a8_compile.py                  # 64:64:1 64:64:2 64:64:4 32:64:1 ...
  PYTHONPATH=/tmp/t36:$PWD python bench/w4a8_compile.py 64:64:4:4:4    # BM:BN:SPLIT[:WARPS[:STAGES]]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from wna16_tc_sass import analyse, sass_loop  # noqa: E402

from kestrel.kernels import lowbit_gemm as lg  # noqa: E402

PTRS = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "ags_ptr": "*fp32", "w_ptr": "*u8", "ws_ptr": "*fp32",
        "wgs_ptr": "*fp32", "topk_w_ptr": "*fp32", "sorted_ptr": "*i32", "expert_ptr": "*i32", "npost_ptr": "*i32"}
INTS = ("M", "N", "K", "num_valid", "a_div", "out_div", "stride_am", "stride_asm", "stride_we", "stride_wn",
        "stride_wse", "stride_wsn", "stride_cm")
DEFAULT = ("64:64:1", "64:64:2", "64:64:4", "32:64:1", "32:64:2", "32:64:4", "64:128:2", "64:128:4")


def compile_w4a8(bm: int, bn: int, split: int, warps: int = 4, stages: int = 4, halves: bool = True):
    fn = lg._qgemm_kernel
    names = fn.arg_names
    sig = dict(PTRS, c_ptr="*fp32" if split > 1 else "*bf16", **{n: "i32" for n in INTS})
    const = dict(A_FMT=lg.A_FP8, A_G=0, W_FMT=lg.W_INT4, W_SCALE=lg.S_FLOAT, WG=128, WGN=1, HAS_WGS=False,
                 IS_MOE=False, MUL_ROUTED=False, SPLIT_K=split, REDUCE=False, BM=bm, BN=bn, BK=128, GROUP_M=8,
                 DOT_F32=False, MMA8=True, OUT_BF16=split == 1, SWAP=True, HALVES=halves, ASM=lg.DECODE_ASM)
    sig = {n: sig.get(n, "constexpr") for n in names}
    div = [n for n in (*PTRS, "c_ptr", "K", "stride_am", "stride_wn", "stride_cm")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="*", default=list(DEFAULT), help="BM:BN:SPLIT[:WARPS[:STAGES]]")
    p.add_argument("--pairs", action="store_true", help="the interchange pairs packing instead of halves")
    args = p.parse_args()
    ok = True
    for c in args.configs:
        v = [int(t) for t in c.split(":")]
        bm, bn, split, warps, stages = (v + [4, 4][len(v) - 3:])[:5] if len(v) < 5 else v
        try:
            k = compile_w4a8(bm, bn, split, warps, stages, not args.pairs)
            a = analyse(k, warps)
            a["QGMMA"] = sum("QGMMA" in t for t in sass_loop(k)[0])  # (fp8 wgmma: QGMMA in SASS)
            print(f"w4a8 {'pairs' if args.pairs else 'halves'} BM {bm} BN {bn} split {split} w{warps} s{stages}: "
                  + json.dumps({k: a[k] for k in ("regs", "spill_bytes", "smem_KB", "ctas_per_sm", "loop_instrs",
                                                  "QGMMA", "MMA_waits")}), flush=True)
        except Exception as ex:  # every config reported, fail at the end
            ok = False
            print(f"w4a8 BM {bm} BN {bn} split {split}: FAILED {type(ex).__name__}: {str(ex)[:1200]}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
