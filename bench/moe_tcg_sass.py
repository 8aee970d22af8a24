"""Static check of the grouped Gluon int4 MoE kernels (moe_tcg.py: SWAP 0 / 1 / 2, PERSIST) for Hopper without a GPU: compile
it for sm_90a with this machine's Triton and report registers, spills, shared memory and CTAs per SM, and the
instruction mix of the K loop, per config. Catches Gluon compile errors and register blow-ups before GPU time.

The CPU machine's Triton (3.9) renamed a few Gluon builtins the H200's Triton 3.6 still has (TMA / cp.async loads,
the CTA barrier): they are aliased here, so the numbers are of a newer compiler than the GPU runs (close, not equal).

  python bench/moe_tcg_sass.py 64:256:8:4:8:2 64:256:8:4:8:2:0:0:1 128:128:8:4:8:2 --reduce
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

for mod, old, new in ((tma, "async_copy_global_to_shared", "async_load"),
                      (async_copy, "async_copy_global_to_shared", "async_load"), (gl, "thread_barrier", "barrier")):
    if hasattr(mod, new):
        setattr(mod, old, getattr(mod, new))

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kestrel.kernels import moe_tcg  # noqa: E402
from kestrel.kernels.moe_tcg import TcgConfig  # noqa: E402

from wna16_tc_sass import sass_loop  # noqa: E402  (cuobjdump + K-loop extraction, shared with the WNA16 tools)
PTRS = {"x_ptr": "*bf16", "s_ptr": "*fp32", "y_ptr": "*bf16", "topk_w_ptr": "*fp32", "sorted_ptr": "*i32",
        "expert_ptr": "*i32", "npost_ptr": "*i32"}
INTS = ("num_valid", "a_div", "out_div", "N", "K", "stride_xm", "stride_ym", "num_m_blocks")


def compile_tcgp(cfg: TcgConfig, reduce: bool):
    fn = (moe_tcg._moe_tcgw_kernel if cfg.WS else moe_tcg._moe_tcgq_kernel if cfg.PERSIST else moe_tcg._moe_tcgp_kernel if cfg.SWAP == 2
          else moe_tcg._moe_tcgs_kernel if cfg.SWAP == 1 else moe_tcg._moe_tcg_kernel)
    names = fn.arg_names
    lay = gl.NVMMASharedLayout.get_default_for([16, cfg.BN], gl.int32)
    slay = gl.NVMMASharedLayout.get_default_for([1, cfg.BN], gl.float32)
    sig = dict(PTRS, q_desc=f"tensordesc<i32[16,{cfg.BN}],{lay!r}>", s_desc=f"tensordesc<fp32[1,{cfg.BN}],{slay!r}>",
               **{n: "i32" for n in INTS})
    if reduce:
        sig["y_ptr"] = "*fp32"
    const = dict(BLOCK_M=cfg.BM, BLOCK_N=cfg.BN, STAGES=cfg.num_stages, GROUP_M=cfg.GROUP_M, MUL_ROUTED=reduce,
                 REDUCE=reduce, PROBE=cfg.PROBE, EARLY_REFILL=bool(cfg.REFILL), RELEASE=cfg.WS, LOOP=cfg.LOOP,
                 NESTED=int(cfg.PERSIST == 2),
                 num_warps=cfg.num_warps)
    extra = {n: "constexpr" for n in names if n not in sig}
    sig = {n: {**sig, **extra}[n] for n in names}
    div = [n for n in PTRS if n in names] + ["N", "K", "stride_xm", "stride_ym"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div}
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items() if k in names},
                         attrs=attrs)
    opts = {"num_warps": cfg.num_warps}
    if cfg.MAXNREG:
        opts["maxnreg"] = cfg.MAXNREG
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def analyse(kern) -> dict:
    loop, regs, stack = sass_loop(kern)
    mix = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in loop)
    smem = kern.metadata.shared
    ctas = min(65536 // (regs * 32 * kern.metadata.num_warps), 232448 // max(smem, 1))
    return {"regs": regs, "stack": stack, "smem": smem, "ctas_per_sm": ctas,
            "loop_instr": len(loop), "mix": dict(mix.most_common(14))}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="+", help="BM:BN:warps:stages:GROUP_M:SWAP[:REFILL[:MAXNREG[:PROBE[:PERSIST]]]] (SWAP 2)")
    p.add_argument("--reduce", action="store_true", help="also the down projection's routed fp32-atomic epilogue")
    args = p.parse_args()
    for c in args.configs:
        cfg = TcgConfig(*(int(v) for v in c.split(":")))
        for red in (False, True) if args.reduce else (False,):
            try:
                print(c, "reduce" if red else "store", analyse(compile_tcgp(cfg, red)), flush=True)
            except Exception as ex:  # noqa: BLE001
                print(c, "reduce" if red else "store", "FAILED", repr(ex)[:600], flush=True)


if __name__ == "__main__":
    main()
