"""Static check of the tc WNA16 kernel for Hopper without a GPU: compile it for sm_90 (Triton's bundled ptxas) and
report registers, shared memory, CTAs per SM, and the instruction mix of the main K loop, next to the old per-plane
"dot" kernel. Useful to choose tiles and to see whether a change emitted wgmma (HGMMA), vector shared-memory stores
of the decoded tile, the packed bf16x2 decode and no spills, before spending GPU time.

  python bench/wna16_tc_sass.py                     # int4 g128 (+ mxfp4) over the heuristic's tiles
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kestrel.kernels import gemm_wna16 as old  # noqa: E402
from kestrel.kernels import gemm_wna16_tc as tc  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTRS = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "gs_ptr": "*fp32", "y_ptr": "*bf16",
        "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_ym": "i32", "split_k": "i32"}
FMT = {"int4": dict(BITS=4, EPW=8, IS_INT=True, EXP_BITS=1, MAN_BITS=0, CODE_OFFSET=8, HAS_ZERO=False,
                    SCALE_KIND=0, GROUP_SIZE=128, PER_CHANNEL=False, HAS_GSCALE=False, R=16),
       "mxfp4": dict(BITS=4, EPW=8, IS_INT=False, EXP_BITS=2, MAN_BITS=1, CODE_OFFSET=0, HAS_ZERO=False,
                     SCALE_KIND=1, GROUP_SIZE=32, PER_CHANNEL=False, HAS_GSCALE=False, R=16)}


def compile_sm90(fn, const: dict, warps: int, stages: int):
    names = fn.arg_names
    sig = {n: PTRS.get(n, "constexpr") for n in names}  # the old dot kernel has no split_k argument
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in PTRS if n in names and n not in ("M", "split_k")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def pair_dim(ttgir: str):
    """Dim of [KB, R, EPW, BN] along which the packed-asm decode pairs adjacent registers (dec 2 needs != 2, the
    field dim: both elements of a pair then share a field), from the layout of the inline asm op."""
    m = re.search(r"elementwise_inline_asm.*?tensor<([\dx]+)x\w+, (#\w+)>", ttgir)
    if not m:
        return None
    shape = [int(v) for v in m.group(1).split("x")]
    lay = re.search(rf"^{m.group(2)} = (.*)$", ttgir, re.M).group(1)
    if "linear" in lay:
        basis = re.search(r"register = \[\[([^\]]*)\]", lay).group(1)
        return [int(v) != 0 for v in basis.split(",")].index(True)
    get = lambda k: [int(v) for v in re.search(rf"{k} = \[([^\]]*)\]", lay).group(1).split(",")]
    spt, tpw, wpc, order = get("sizePerThread"), get("threadsPerWarp"), get("warpsPerCTA"), get("order")
    # registers run over sizePerThread first, then over repetitions of the whole CTA tile, both in `order`
    return next((d for d in order if spt[d] > 1), None) or next(
        (d for d in order if shape[d] > spt[d] * tpw[d] * wpc[d]), None)


def mma_loops(kern) -> tuple[list, str]:
    """(the bodies of every backward branch whose body holds MMAs, outermost first by length; cuobjdump's resource
    usage) of a compiled kernel, through Triton's bundled cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kern.asm["cubin"])
        f.flush()
        sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, text in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if any("GMMA" in t or "HMMA" in t for t in body):
                loops.append(body)
    return sorted(loops, key=len, reverse=True), res


def sass_loop(kern) -> tuple[list, int, int]:
    """(SASS of the K loop: the longest backward branch whose body holds MMAs, registers, stack bytes) of a
    compiled kernel (also used by bench/wna16_mv_sass.py)."""
    loops, res = mma_loops(kern)
    return (loops[0] if loops else [], int(re.search(r"REG:(\d+)", res).group(1)),
            int(re.search(r"STACK:(\d+)", res).group(1)))


def analyse(kern, warps: int) -> dict:
    loop, regs, stack = sass_loop(kern)
    op = lambda t: re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]
    mix = collections.Counter(op(t).split(".")[0] for t in loop)
    smem = kern.metadata.shared
    ctas = min(65536 // (-(-regs // 8) * 8 * 32 * warps), 232448 // (smem + 1024))
    return {"pair_dim": pair_dim(kern.asm["ttgir"]), "regs": regs,
            "spill_bytes": stack, "smem_KB": smem // 1024,
            "ctas_per_sm": ctas, "loop_instrs": len(loop), "HGMMA": mix["HGMMA"], "MMA_waits": sum(
                "WARPGROUP.DEPBAR" in t for t in loop),
            "STS": dict(collections.Counter(op(t) for t in loop if op(t).startswith("STS"))),
            "decode_ops": {k: mix[k] for k in ("SHF", "LOP3", "PRMT", "HADD2", "HMUL2", "FFMA", "FMUL", "F2FP")
                           if mix[k]}}


def dec2_pairs() -> dict:
    """Pair dim of the packed-asm decode in the tiles gemm_wna16_tc gives dec 2 (8 warps, 128-wide halves)."""
    out = {}
    for fmt, bm, bn, stages in (("int4", 64, 128, 3), ("int4", 128, 128, 2), ("int4", 128, 256, 2),
                                ("mxfp4", 128, 128, 2)):
        const = dict(FMT[fmt], BLOCK_M=bm, BLOCK_N=bn, KB=1, SPLIT=False, NUM_STAGES=stages, GROUP_M=8, SWAP=False,
                     LAYOUT=0, EVEN_K=True, EVEN_N=True, NH=bn // 128, DEC=2, TILE_EXP=0 if fmt == "int4" else 64,
                     DOT_F32=False)
        out[f"{fmt} {bm}x{bn}"] = pair_dim(compile_sm90(tc._tc_kernel, const, 8, stages).asm["ttgir"])
    return out


def main():
    if "--pairs" in sys.argv:
        import json
        print(json.dumps(dec2_pairs()))
        return
    rows = []
    C = tc.ComputeConfig
    tiles = [(C("tc", 32, 128, 0, 1, 8, 4, swap=True), 2), (C("tc", 64, 128, 0, 1, 8, 3, swap=True), 2),
             (C("tc", 64, 128, 0, 1, 8, 3), 2), (C("tc", 64, 128, 0, 1, 8, 3), 1), (C("tc", 128, 128, 0, 1, 8, 2), 2),
             (C("tc", 128, 128, 0, 1, 8, 2), 1), (C("tc", 128, 128, 0, 1, 8, 2), 0),
             (C("tc", 256, 128, 0, 1, 8, 2, swap=True), 2), (C("tc", 256, 128, 0, 1, 8, 2), 2),
             (C("tc", 128, 256, 0, 1, 8, 2), 2), (C("tc", 128, 128, 0, 1, 4, 2), 2)]
    for fmt in ("int4", "mxfp4"):
        for cfg, dec in tiles if fmt == "int4" else [tiles[i] for i in (0, 2, 4)]:
            const = dict(FMT[fmt], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, KB=1, SPLIT=False,
                         NUM_STAGES=cfg.num_stages, GROUP_M=8, SWAP=cfg.swap, LAYOUT=0,
                         NH=2 if cfg.block_n == 256 and not cfg.swap else 1,
                         EVEN_K=True, EVEN_N=True, DEC=dec, TILE_EXP=0 if fmt == "int4" else 64,
                         DOT_F32=False)
            a = analyse(compile_sm90(tc._tc_kernel, const, cfg.num_warps, cfg.num_stages), cfg.num_warps)
            rows.append((f"tc {fmt} {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
                         f"{' swap' if const['SWAP'] else ''} dec{dec}", cfg.block_n * 128, a))
    for bm, bn in ((16, 64), (64, 64)):  # the old per-bit-plane kernel (K=16 MMAs), one 128-k planar block per step
        const = dict(FMT["int4"], BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=1, NUM_STAGES=3, DOT_F32=False)
        kern = compile_sm90(old._dot_kernel, const, 4, 3)
        rows.append((f"dot (old) int4 {bm}x{bn} w4 s3", bn * 128, analyse(kern, 4)))
    print(f"triton {triton.__version__}, target sm_90; per K step of 128 (one planar block)")
    print("| kernel / tile | regs | spill B | smem KB | CTAs/SM | loop instrs | thread-instrs / W elem | HGMMA | "
          "MMA waits | smem stores | decode ops | asm pair dim |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, elems, a in rows:
        warps = int(re.search(r" w(\d+)", name).group(1))
        per = a["loop_instrs"] * warps * 32 / elems  # issue cost of the decode (+ loads, MMA issue) per weight
        print(f"| {name} | {a['regs']} | {a['spill_bytes']} | {a['smem_KB']} | {a['ctas_per_sm']} | "
              f"{a['loop_instrs']} | "
              f"{per:.2f} | {a['HGMMA']} | {a['MMA_waits']} | {a['STS']} | {a['decode_ops']} | {a['pair_dim']} |")


if __name__ == "__main__":
    main()
