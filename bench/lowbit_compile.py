"""Offline sm_90a compile of the low-bit dense GEMMs on a machine without a GPU: the W4A8 kernel
(lowbit_gemm._qgemm_kernel: int4 g128 weights x fp8 per-token activations, swapped operands) or, --tma, the FP8
W8A8 TMA kernel (lowbit_tma._w8a8_tma_kernel, incl. its in-kernel split-K): registers, spills, shared memory, CTAs
per SM, the longest MMA loop's and the inner K step's SASS per tile config — here the M = 64 options for the
under-filled grid (K split, narrower tiles). Run with the H200's Triton for its numbers; not a correctness check
(the CPU interpreter tests are: tests/test_gemm_w4a.py, tests/test_gemm_w8a8.py).

  PYTHONPATH=/tmp/t36:$PWD python bench/lowbit_compile.py                 # W4A8: 64:64:1 64:64:2 64:64:4 ...
  PYTHONPATH=/tmp/t36:$PWD python bench/lowbit_compile.py 64:64:4:4:4     # BM:BN:SPLIT[:WARPS[:STAGES]]
  PYTHONPATH=/tmp/t36:$PWD python bench/lowbit_compile.py --tma           # FP8 TMA: 64:64:1:4:6 64:64:2:4:6 ...
  PYTHONPATH=/tmp/t36:$PWD python bench/lowbit_compile.py --fmt mxfp4-fold --no-swap 128:128:1:8:3  # the scale fold
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from moe_tcg_compile import inflight_a_writes_on, k_step, sass_text  # noqa: E402
from wna16_tc_sass import analyse, sass_loop  # noqa: E402

from kestrel.kernels import lowbit_gemm as lg  # noqa: E402
from kestrel.kernels import lowbit_tma as lt  # noqa: E402

PTRS = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "ags_ptr": "*fp32", "w_ptr": "*u8", "ws_ptr": "*fp32",
        "wgs_ptr": "*fp32", "topk_w_ptr": "*fp32", "sorted_ptr": "*i32", "expert_ptr": "*i32", "npost_ptr": "*i32"}
INTS = ("M", "N", "K", "num_valid", "a_div", "out_div", "stride_am", "stride_asm", "stride_we", "stride_wn",
        "stride_wse", "stride_wsn", "stride_cm")
DEFAULT = ("64:64:1", "64:64:2", "64:64:4", "32:64:1", "32:64:2", "32:64:4", "64:128:2", "64:128:4")
DEFAULT_TMA = ("64:64:1:4:6", "64:64:2:4:6", "64:64:4:4:6", "64:32:1:4:6", "64:128:1:4:6", "64:128:2:4:6")


# --fmt: the weight format's constexprs (W_FMT, W_SCALE, WG, the K tile, the scale pointer's type)
FMTS = {"int4": (lg.W_INT4, lg.S_FLOAT, 128, 128, "*fp32"),
        "mxfp4": (lg.W_FP4, lg.S_E8M0, 32, 32, "*u8"),  # today: the e8m0 group bounds the K tile (BK <= 32)
        "mxfp4-fold": (lg.W_FP4, lg.S_FOLD, 32, 128, "*u8")}  # the in-register scale fold (one accumulator chain)


def compile_w4a8(bm: int, bn: int, split: int, warps: int = 4, stages: int = 4, halves: bool = True,
                 fmt: str = "int4", swap: bool = True):
    fn = lg._qgemm_kernel
    names = fn.arg_names
    w_fmt, w_scale, wg, bk, ws_type = FMTS[fmt]
    sig = dict(PTRS, ws_ptr=ws_type, c_ptr="*fp32" if split > 1 else "*bf16", **{n: "i32" for n in INTS})
    const = dict(A_FMT=lg.A_FP8, A_G=0, W_FMT=w_fmt, W_SCALE=w_scale, WG=wg, WGN=1, HAS_WGS=False,
                 IS_MOE=False, MUL_ROUTED=False, SPLIT_K=split, REDUCE=False, BM=bm, BN=bn, BK=bk, GROUP_M=8,
                 DOT_F32=False, MMA8=True, OUT_BF16=split == 1, SWAP=swap, HALVES=halves and fmt == "int4",
                 ASM=lg.DECODE_ASM)
    sig = {n: sig.get(n, "constexpr") for n in names}
    div = [n for n in (*PTRS, "c_ptr", "K", "stride_am", "stride_wn", "stride_cm")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def compile_tma(bm: int, bn: int, split: int, warps: int = 4, stages: int = 6, lines: int = 0):
    """the fp8 TMA kernel (per-token x per-channel scales, bf16 out), split > 1 with its in-kernel reduction."""
    from triton.runtime.jit import mangle_type
    from triton.tools.tensor_descriptor import TensorDescriptor
    fn = lt._w8a8_tma_kernel
    names = fn.arg_names
    desc = lambda rows, cols, dt: mangle_type(TensorDescriptor.from_tensor(torch.empty(256, 1024, dtype=dt),
                                                                            [rows, cols]))
    sig = {"a_desc": desc(bm, 128, torch.float8_e4m3fn), "w_desc": desc(bn, 128, torch.float8_e4m3fn),
           "c_desc": desc(bm, bn, torch.bfloat16), "as_ptr": "*fp32", "ws_ptr": "*fp32", "w_ptr": "*fp8e4nv",
           "M": "i32", "N": "i32", "K": "i32", "num_progs": "i32", "stride_wsn": "i32", "stride_w": "i32"}
    const = dict(INT8=False, WG=0, BM=bm, BN=bn, BK=128, GROUP_M=8, OUT_DT=0, PDL_LINES=lines, SPLIT=split)
    if split > 1:
        sig.update(part_ptr="*fp32", cnt_ptr="*i32", c_ptr="*bf16", stride_cm="i32")
    else:
        const.update(part_ptr=None, cnt_ptr=None, c_ptr=None, stride_cm=0)
    sig = {n: sig.get(n, "constexpr") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="*", help="BM:BN:SPLIT[:WARPS[:STAGES]]")
    p.add_argument("--pairs", action="store_true", help="W4A8: the interchange pairs packing instead of halves")
    p.add_argument("--tma", action="store_true", help="the FP8 W8A8 TMA kernel instead of W4A8")
    p.add_argument("--fmt", choices=list(FMTS), default="int4", help="W4A8 weight format (default: %(default)s)")
    p.add_argument("--no-swap", action="store_true", help="W4A8: activation rows on the MMA's M side (large M)")
    args = p.parse_args()
    args.configs = args.configs or list(DEFAULT_TMA if args.tma else DEFAULT)
    ok = True
    for c in args.configs:
        v = [int(t) for t in c.split(":")]
        bm, bn, split, warps, stages = (v + ([4, 6] if args.tma else [4, 4])[len(v) - 3:])[:5]
        layout = "pairs" if args.pairs or args.fmt != "int4" else "halves"
        name = "fp8 tma" if args.tma else f"w4a8 {args.fmt} {layout}{' unswapped' if args.no_swap else ''}"
        try:
            k = (compile_tma(bm, bn, split, warps, stages) if args.tma else
                 compile_w4a8(bm, bn, split, warps, stages, not args.pairs, args.fmt, not args.no_swap))
            a = analyse(k, warps)
            a["QGMMA"] = sum("QGMMA" in t for t in sass_loop(k)[0])  # (fp8 wgmma: QGMMA in SASS)
            # writes to the A registers of an in-flight fp8 wgmma (the count reads HGMMA lines: renamed)
            a["inflight_A_writes"] = ("n/a: A from shared memory" if args.tma else
                                      inflight_a_writes_on(k, sass_text(k).replace("QGMMA", "HGMMA")))
            print(f"{name} BM {bm} BN {bn} split {split} w{warps} s{stages}: "
                  + json.dumps({k: a[k] for k in ("regs", "spill_bytes", "smem_KB", "ctas_per_sm", "loop_instrs",
                                                  "QGMMA", "MMA_waits", "inflight_A_writes")})
                  + f", inner {k_step(k)}", flush=True)
        except Exception as ex:  # every config reported, fail at the end
            ok = False
            print(f"{name} BM {bm} BN {bn} split {split}: FAILED {type(ex).__name__}: {str(ex)[:1200]}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
