"""Offline sm_90 compile of the swap-AB Gluon kernel (gemm_wna16_tcg._tcgs_kernel) on a machine without a GPU:
catches Gluon front-end / layout / ptxas errors of a change before a GPU round, and prints registers, spills and
shared memory per variant. Not a correctness check (Gluon kernels run only on a Hopper GPU).

  python bench/wna16_tcg_compile.py          # int4 + MXFP4 x (plain, split atomics, reduce, tail, streamk)
"""
from __future__ import annotations

import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kestrel.kernels import gemm_wna16_tcg as tcg  # noqa: E402
from wna16_tc_sass import sass_loop  # noqa: E402

if tuple(int(v) for v in triton.__version__.split(".")[:2]) > (3, 6):  # newer local Triton: the GPU's 3.6 name
    tcg.tma.async_copy_global_to_shared = tcg.tma.async_load  # is a stub that raises
    if not hasattr(gl, "thread_barrier"):
        gl.thread_barrier = gl.barrier


def compile_tcgs(bm: int, bn: int, stages: int, warps: int, fp4: bool, **const):
    lay = gl.NVMMASharedLayout.get_default_for
    x_desc = TensorDescriptor.from_tensor(torch.empty(256, 512, dtype=torch.bfloat16), [bm, 128],
                                          lay([bm, 128], gl.bfloat16))
    q_desc = TensorDescriptor.from_tensor(torch.empty(64, 512, dtype=torch.int32), [16, bn], lay([16, bn], gl.int32))
    fn = tcg._tcgs_kernel
    names = fn.arg_names
    sig = {"x_desc": x_desc.__mangle__(), "q_desc": q_desc.__mangle__(), "s_ptr": "*u8" if fp4 else "*bf16",
           "y_ptr": "*fp32" if const.get("ATOMIC") else "*bf16", "M": "i32", "N": "i32", "K": "i32",
           "stride_ym": "i32", "split_k": "i32", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "n_full": "i32",
           "n_tiles": "i32"}
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, ATOMIC=False, STAGES=stages, CODE_OFFSET=0 if fp4 else 8, WS=False,
                  FP4=fp4, num_warps=warps, REDUCE=False, TAIL=False, PAIRED=True)
    consts.update(const)
    if not consts["REDUCE"]:
        consts.update(ws_ptr=None, cnt_ptr=None)
    if not consts["TAIL"]:
        consts.update(n_full=0, n_tiles=0)
    signature = {n: sig.get(n, "constexpr") for n in names}
    for n, v in consts.items():
        if v is None:
            signature[n] = "constexpr"
    src = GluonASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def compile_tcgsk(bm: int, bn: int, stages: int, warps: int, fp4: bool, atomic: bool = False, PAIRED=True):
    """The stream-K persistent kernel (gemm_wna16_tcg_streamk._tcgsk_kernel)."""
    from kestrel.kernels import gemm_wna16_tcg_streamk as sk
    lay = gl.NVMMASharedLayout.get_default_for
    x_desc = TensorDescriptor.from_tensor(torch.empty(256, 512, dtype=torch.bfloat16), [bm, 128],
                                          lay([bm, 128], gl.bfloat16))
    q_desc = TensorDescriptor.from_tensor(torch.empty(64, 512, dtype=torch.int32), [16, bn], lay([16, bn], gl.int32))
    fn = sk._tcgsk_kernel
    names = fn.arg_names
    sig = {"x_desc": x_desc.__mangle__(), "q_desc": q_desc.__mangle__(), "s_ptr": "*u8" if fp4 else "*bf16",
           "y_ptr": "*fp32" if atomic else "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_ym": "i32",
           "n_dp": "i32", "per": "i32",
           "ws_ptr": "*fp32", "cnt_ptr": "*i32", "max_parts": "i32"}
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, CODE_OFFSET=0 if fp4 else 8, FP4=fp4, num_warps=warps,
                  ATOMIC=atomic, PAIRED=PAIRED)
    signature = {n: sig.get(n, "constexpr") for n in names}
    src = GluonASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def main():
    variants = {"plain": {}, "atomic": dict(ATOMIC=True), "reduce": dict(REDUCE=True),
                "tail": dict(REDUCE=True, TAIL=True), "streamk": None}
    ok = True
    for fp4 in (False, True):
        for (bm, bn, st) in ((128, 128, 4), (128, 256, 3)):
            for name, c in variants.items():
                try:
                    k = (compile_tcgsk(bm, bn, st, 8, fp4) if c is None else
                         compile_tcgs(bm, bn, st, 8, fp4, **c))
                    loop, regs, stack = sass_loop(k)
                    print(f"{'mxfp4' if fp4 else 'int4'} {bm}x{bn} s{st} {name}: regs {regs} stack {stack} shared "
                          f"{k.metadata.shared} K-loop SASS {len(loop)} ({sum('GMMA' in t for t in loop)} HGMMA)",
                          flush=True)
                except Exception as ex:  # report every variant, fail at the end
                    ok = False
                    print(f"{'mxfp4' if fp4 else 'int4'} {bm}x{bn} s{st} {name}: FAILED {type(ex).__name__}: "
                          f"{str(ex)[:1500]}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
