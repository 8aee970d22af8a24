"""Offline sm_90 compile of the swap-AB Gluon kernel (gemm_wna16_tcg._tcgs_kernel) on a machine without a GPU:
catches Gluon front-end / layout / ptxas errors of a change before a GPU round, and prints registers, spills and
shared memory per variant. Not a correctness check (Gluon kernels run only on a Hopper GPU).

  python bench/wna16_tcg_compile.py          # int4 + MXFP4 x (plain, atomics, reduce, tail, streamk, loops, ws, -own)
  PYTHONPATH=<triton 3.6 install> python bench/wna16_tcg_compile.py   # with the GPU's Triton (pip --target)
  python bench/wna16_tcg_compile.py 'int4 128x256.*ws'   # only the variants whose label matches the regex
Also counts the K loops' writes to registers an in-flight wgmma may still read (session 10's race: must be 0), and
prints a hash of the whole SASS (same hash before / after a refactor: the same machine code).
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kestrel.kernels import gemm_wna16_tcg as tcg  # noqa: E402
from wna16_tc_sass import BIN, sass_loop  # noqa: E402

if not hasattr(TensorDescriptor, "__mangle__"):  # Triton 3.6 (the GPU's): the signature string from mangle_type
    from triton.runtime.jit import mangle_type
    TensorDescriptor.__mangle__ = lambda self: mangle_type(self)
if tuple(int(v) for v in triton.__version__.split(".")[:2]) > (3, 6):  # newer local Triton: the GPU's 3.6 name
    tcg.tma.async_copy_global_to_shared = tcg.tma.async_load  # is a stub that raises
    if not hasattr(gl, "thread_barrier"):
        gl.thread_barrier = gl.barrier


_NO_DEST = ("ST", "BRA", "BAR", "ISETP", "SYNCS", "UTMA", "WARPGROUP", "MEMBAR", "FENCE", "RED", "ELECT", "VOTEU",
            "UISETP", "PLOP3", "FSETP", "BSSY", "BSYNC", "EXIT", "DEPBAR", "R2UR", "WARPSYNC", "CCTL", "ERRBAR",
            "CGAERRBAR", "NOP")


def inflight_a_writes(kern) -> int:
    """Instructions in the K loops that write a register of the A operand of a wgmma group still in flight (issued,
    not yet retired by a WARPGROUP.DEPBAR): PTX leaves that undefined, the async wgmma may still read it. The loop
    bodies are replayed three times to catch writes in the next iteration."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kern.asm["cubin"])
        f.flush()
        sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    bad = set()
    for addr, text in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if not (m and int(m.group(1), 16) < addr):
            continue
        body = [(a, t) for a, t in ins if int(m.group(1), 16) <= a <= addr]
        if not any("HGMMA" in t for _, t in body):
            continue
        inflight, cur = [], set()
        for rep in range(3):
            for a, t in body:
                op, _, rest = re.sub(r"^@!?U?P\w+\s+", "", t).partition(" ")
                if op.startswith("HGMMA"):
                    r = int(re.search(r"R\d+, R(\d+),", t).group(1))
                    cur |= set(range(r, r + 4))
                    if "gsb0" in t:
                        inflight, cur = inflight + [cur], set()
                elif op.startswith("WARPGROUP.DEPBAR"):
                    n = int(re.search(r"0x(\d+)", rest).group(1))
                    inflight = inflight[len(inflight) - n:] if n else []
                elif rep and not op.startswith(_NO_DEST):
                    d = re.match(r"\s*R(\d+)\b", rest)
                    w = 4 if ".128" in op else 2 if (".64" in op or op.startswith(("CS2R", "IMAD.WIDE"))) else 1
                    if d and any(set(range(int(d.group(1)), int(d.group(1)) + w)) & g for g in inflight):
                        bad.add(a)
    return len(bad)


def sass_hash(kern) -> str:
    """First 12 hex digits of the sha1 of the kernel's whole SASS listing (cuobjdump -sass): the machine code."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kern.asm["cubin"])
        f.flush()
        sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    body = re.sub(r"^.*Function : ", "", sass, count=1, flags=re.S)  # drop the header naming the temp file
    return hashlib.sha1(body.encode()).hexdigest()[:12]


def wgmma_serialised(kern) -> str:
    """ptxas' wgmma serialisation warnings (C7511: for want of registers; C7515: a non-wgmma instruction defines an
    accumulator inside the pipeline stage; C75xx: any other), each meaning one wgmma at a time, no decode / MMA
    overlap, on the kernel's PTX re-assembled with Triton's bundled ptxas (Triton does not show its warnings).
    '' when none."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        open(src, "w").write(kern.asm["ptx"])
        res = subprocess.run([f"{BIN}/ptxas", "-arch=sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    return " ".join(sorted(set(re.findall(r"\((C75\d\d)\)[^\n]*serializ", res.stdout + res.stderr))))


def descriptors(bm: int, q_cols: int, x_dtype=torch.bfloat16):
    """The TMA descriptors of an x tile [bm, 128] (x_dtype) and a word tile [16, q_cols] for an offline compile."""
    lay = gl.NVMMASharedLayout.get_default_for
    gx = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}[x_dtype]
    x_desc = TensorDescriptor.from_tensor(torch.empty(256, 512, dtype=x_dtype), [bm, 128], lay([bm, 128], gx))
    q_desc = TensorDescriptor.from_tensor(torch.empty(64, 512, dtype=torch.int32), [16, q_cols],
                                          lay([16, q_cols], gl.int32))
    return x_desc, q_desc


def gluon_compile(fn, sig: dict, consts: dict, warps: int):
    """sm_90 compile of a Gluon kernel: sig types the runtime arguments; every other argument (and any const given
    as None) is a constexpr from consts."""
    names = fn.arg_names
    signature = {n: sig.get(n, "constexpr") for n in names}
    signature.update({n: "constexpr" for n, v in consts.items() if v is None})
    src = GluonASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def compile_tcgs(bm: int, bn: int, stages: int, warps: int, fp4: bool, **const):
    x_desc, q_desc = descriptors(bm, bn)
    sig = {"x_desc": x_desc.__mangle__(), "q_desc": q_desc.__mangle__(), "s_ptr": "*u8" if fp4 else "*bf16",
           "y_ptr": "*fp32" if const.get("ATOMIC") else "*bf16", "M": "i32", "N": "i32", "K": "i32",
           "stride_ym": "i32", "split_k": "i32", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "n_full": "i32",
           "n_tiles": "i32"}
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, ATOMIC=False, STAGES=stages, CODE_OFFSET=0 if fp4 else 8, WS=False,
                  FP4=fp4, num_warps=warps, REDUCE=False, TAIL=False, LOOP=2)
    consts.update(const)
    if not consts["REDUCE"]:
        consts.update(ws_ptr=None, cnt_ptr=None)
    if not consts["TAIL"]:
        consts.update(n_full=0, n_tiles=0)
    return gluon_compile(tcg._tcgs_kernel, sig, consts, warps)


def compile_tcgs2(bm: int, bn: int, stages: int, fp4: bool, atomic: bool = False, consumer_regs: int | None = None,
                  loader_regs: int | None = None):
    """ws 2 (gemm_wna16_tcg._tcgs2_kernel): two consumer warpgroups in their own partitions + a loader warp, the
    word descriptor half a tile wide, the register budgets of gemm_wna16_tcg.ws2_regs (as it launches it) unless
    given."""
    consumer_regs = consumer_regs or tcg.ws2_regs(bn)[0]
    loader_regs = loader_regs or tcg.ws2_regs(bn)[1]
    x_desc, q_desc = descriptors(bm, bn // 2)
    sig = {"x_desc": x_desc.__mangle__(), "q_desc": q_desc.__mangle__(), "s_ptr": "*u8" if fp4 else "*bf16",
           "y_ptr": "*fp32" if atomic else "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_ym": "i32",
           "split_k": "i32"}
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, ATOMIC=atomic, STAGES=stages, CODE_OFFSET=0 if fp4 else 8, FP4=fp4,
                  CONSUMER_REGS=consumer_regs, num_warps=4, LOADER_REGS=loader_regs)
    return gluon_compile(tcg._tcgs2_kernel, sig, consts, 4)


def compile_tcgsk(bm: int, bn: int, stages: int, warps: int, fp4: bool, atomic: bool = False, LOOP=2, OWN=False):
    """The stream-K persistent kernel (gemm_wna16_tcg_streamk._tcgsk_kernel)."""
    from kestrel.kernels import gemm_wna16_tcg_streamk as sk
    x_desc, q_desc = descriptors(bm, bn)
    sig = {"x_desc": x_desc.__mangle__(), "q_desc": q_desc.__mangle__(), "s_ptr": "*u8" if fp4 else "*bf16",
           "y_ptr": "*fp32" if atomic else "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_ym": "i32",
           "n_dp": "i32", "per": "i32",
           "ws_ptr": "*fp32", "cnt_ptr": "*i32", "max_parts": "i32"}
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, CODE_OFFSET=0 if fp4 else 8, FP4=fp4, num_warps=warps,
                  ATOMIC=atomic, LOOP=LOOP, OWN=OWN)
    return gluon_compile(sk._tcgsk_kernel, sig, consts, warps)


def main():
    variants = {"plain": {}, "atomic": dict(ATOMIC=True), "reduce": dict(REDUCE=True),
                "tail": dict(REDUCE=True, TAIL=True), "streamk": None, "plain-loop1": dict(LOOP=1),
                "plain-loop0": dict(LOOP=0), "ws1": dict(WS=True), "ws1-atomic": dict(WS=True, ATOMIC=True),
                "ws2": "ws2", "ws2-atomic": "ws2-atomic", "reduce-own": dict(REDUCE=True, OWN=True),
                "streamk-own": "streamk-own"}
    only = re.compile(sys.argv[1]) if len(sys.argv) > 1 else None
    ok = True
    for fp4 in (False, True):
        for (bm, bn, st) in ((128, 128, 4), (128, 256, 3), (64, 128, 4)):
            for name, c in variants.items():
                label = f"{'mxfp4' if fp4 else 'int4'} {bm}x{bn} s{st} {name}"
                if (only and not only.search(label)) or (c in ("ws2", "ws2-atomic") and bn < 128):  # ws 2: valid_for
                    continue
                try:
                    k = (compile_tcgsk(bm, bn, st, 8, fp4, OWN=c == "streamk-own") if c in (None, "streamk-own") else
                         compile_tcgs2(bm, bn, st, fp4, c.endswith("atomic")) if isinstance(c, str) else
                         compile_tcgs(bm, bn, st, 8, fp4, **c))
                    loop, regs, stack = sass_loop(k)
                    ser = wgmma_serialised(k)
                    print(f"{label}: regs {regs} stack {stack} shared "
                          f"{k.metadata.shared} K-loop SASS {len(loop)} ({sum('GMMA' in t for t in loop)} HGMMA), "
                          f"writes to in-flight wgmma A registers {inflight_a_writes(k)}"
                          f"{', wgmma SERIALISED (' + ser + ')' if ser else ''}, sass {sass_hash(k)}", flush=True)
                except Exception as ex:  # report every variant, fail at the end
                    ok = False
                    print(f"{label}: FAILED {type(ex).__name__}: {str(ex)[:1500]}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
