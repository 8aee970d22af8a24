"""Offline sm_90a compile of the Gluon W4A8 kernel (gemm_w4a8_tcg._w4a8_tcg_kernel) on a machine without a GPU:
front-end / layout / ptxas errors, registers, spills, shared memory, the K loop's QGMMA count and waits, and
ptxas' wgmma serialisation warnings per tile. Not a correctness check (tests/test_gemm_w4a8_tcg.py on a GPU is).

  PYTHONPATH=/tmp/t36:$PWD python bench/w4a8_tcg_compile.py             # the GPU's Triton 3.6 (pip --target)
  PYTHONPATH=/tmp/t36:$PWD python bench/w4a8_tcg_compile.py 128:128:4:4  # BM:BN:WARPS:STAGES[:atomic][:mhH]
  (mh128 with BM 256: two 128-token halves per decode; fold: the MXFP4 scale-fold kernel; kh: K halves;
  pp: the consumers' wgmma issues in turn; pk: the permuted-K integer decode; reduce: the in-kernel split-K sum)
  (WARPS 4: the warp-specialised launch)
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import wna16_tcg_compile as wc  # noqa: E402  (its Triton 3.6 shims apply here too)
from kestrel.kernels import gemm_w4a8_tcg as w4  # noqa: E402
from wna16_tc_sass import sass_loop  # noqa: E402

# the in-kernel split-K sum's arguments (gemm_w4a8_tcg.REDUCE); unused unless REDUCE
_REDUCE_SIG = {"ws_ptr": "*fp32", "cnt_ptr": "*i32", "n_sub": "i32"}


def compile_w4a8_tcg(bm: int, bn: int, warps: int, stages: int, atomic: bool = False, regs=None, mh: int = 0,
                     kh: bool = False, pp: bool = False, pk: bool = False, reduce: bool = False):
    regs = regs or w4.WS_REGS
    x_desc, q_desc = wc.descriptors(bm, bn // 2, torch.float8_e4m3fn)
    sig = {"x_desc": x_desc.__mangle__(), "q_desc": q_desc.__mangle__(), "s_ptr": "*bf16", "as_ptr": "*fp32",
           "y_ptr": "*fp32" if atomic else "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_ym": "i32",
           "split_k": "i32", **_REDUCE_SIG}
    consts = dict(GSTEPS=1, BLOCK_M=bm, BLOCK_N=bn, ATOMIC=atomic, STAGES=stages, CONSUMER_REGS=regs[0],
                  LOADER_REGS=regs[1], num_warps=warps, MH=mh, KH=kh, PP=pp, PK=pk, REDUCE=reduce)
    return wc.gluon_compile(w4._w4a8_tcg_kernel, sig, consts, warps)


def compile_fold(bm: int, bn: int, stages: int, atomic: bool = False, kh: bool = False, pp: bool = False,
                 reduce: bool = False):
    x_desc, q_desc = wc.descriptors(bm, bn // 2, torch.float8_e4m3fn)
    sig = {"x_desc": x_desc.__mangle__(), "q_desc": q_desc.__mangle__(), "m_ptr": "*i16", "cs_ptr": "*fp32",
           "as_ptr": "*fp32", "y_ptr": "*fp32" if atomic else "*bf16", "M": "i32", "N": "i32", "K": "i32",
           "stride_ym": "i32", "split_k": "i32", **_REDUCE_SIG}
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, ATOMIC=atomic, STAGES=stages, CONSUMER_REGS=w4.WS_REGS[0],
                  LOADER_REGS=w4.WS_REGS[1], num_warps=4, KH=kh, PP=pp, REDUCE=reduce)
    return wc.gluon_compile(w4._w4a8_fold_kernel, sig, consts, 4)


def main():
    cfgs = sys.argv[1:] or ["128:128:4:4", "128:128:4:4:atomic", "64:128:4:4", "128:128:4:6", "256:128:4:3", "256:128:4:4:mh128", "256:128:4:5:mh128"]
    ok = True
    for c in cfgs:
        parts = c.split(":")
        bm, bn, warps, stages = map(int, parts[:4])
        flags = parts[4:]
        mh = next((int(f[2:]) for f in flags if f.startswith("mh")), 0)
        try:
            pp = "pp" in flags
            red = "reduce" in flags
            k = (compile_fold(bm, bn, stages, atomic="atomic" in flags, kh="kh" in flags, pp=pp, reduce=red)
                 if "fold" in flags else
                 compile_w4a8_tcg(bm, bn, warps, stages, atomic="atomic" in flags, mh=mh, kh="kh" in flags, pp=pp,
                                  pk="pk" in flags, reduce=red))
            loop, regs, stack = sass_loop(k)
            waits = [t for t in loop if "WARPGROUP.DEPBAR" in t]
            ser = wc.wgmma_serialised(k)
            print(f"{c}: regs {regs} stack {stack} shared {k.metadata.shared} K-loop SASS {len(loop)} "
                  f"({sum('GMMA' in t for t in loop)} QGMMA, waits {[w.split()[-1] for w in waits]})"
                  f"{', wgmma SERIALISED (' + ser + ')' if ser else ''}", flush=True)
        except Exception as ex:
            ok = False
            print(f"{c}: FAILED {type(ex).__name__}: {str(ex)[:1500]}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
