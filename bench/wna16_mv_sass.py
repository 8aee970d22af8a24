"""Static check of the small-M mv kernel for Hopper without a GPU: compile gemm_wna16_small._mv_kernel for sm_90
(Triton's bundled ptxas) and report registers, spills and the K loop's instruction mix per weight element, for
int4 g128 and MXFP4 on the decode tiles in the tune cache. The mv kernel is issue-bound on MXFP4 (session 3), so
the instruction count of its loop is the number to push down before spending GPU time.

  python bench/wna16_mv_sass.py                     # int4 + mxfp4, the usual tiles
  python bench/wna16_mv_sass.py --dump mxfp4 64 1   # also print the loop SASS of one (format, BLOCK_N, warps)
  python bench/wna16_mv_sass.py --scale-paths       # MXFP4: the e8m0 scale paths (barriers, registers, instrs)
  python bench/wna16_mv_sass.py --ab                # session 11's opt-in switches vs the defaults, + the layout
                                                    # Triton decodes FOLD's e2m1 in at num_stages 1 / 2 (TTGIR)
  python bench/wna16_mv_sass.py --ab pairw          # only the pair word order rows (PAIRW 2) and its layout check
  python bench/wna16_mv_sass.py --streamk           # the stream-K grid (STREAMK) beside split-K: registers, K loop
"""
from __future__ import annotations

import collections
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kestrel.kernels import gemm_wna16_small as small  # noqa: E402
from wna16_tc_sass import FMT, sass_loop  # noqa: E402  (same formats; cuobjdump + K-loop extraction)

SCALE_T = {0: "*bf16", 1: "*u8"}
FMT = {**FMT, "uint4": dict(FMT["int4"], CODE_OFFSET=0, HAS_ZERO=True)}  # zero points (bf16 scale + zero rows)


def compile_mv(fmt: str, block_n: int, warps: int, stages: int, split: bool = True, **extra):
    fn = small._mv_kernel
    names = fn.arg_names
    ptrs = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": SCALE_T[FMT[fmt]["SCALE_KIND"]], "z_ptr": "*bf16",
            "gs_ptr": "*fp32", "y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32",
            "K": "i32", "stride_xm": "i32", "stride_ym": "i32", "split_k": "i32"}
    if extra.get("SCALE_WORDS"):  # s_ptr = gemm_wna16_small.e8m0_words(qw)
        ptrs["s_ptr"] = "*i32"
    const = dict(FMT[fmt], BLOCK_M=extra.pop("BLOCK_M", 16), BLOCK_N=block_n, SPLIT=split, NUM_STAGES=stages, SWAP=False, EVEN_K=True,
                 DOT_F32=False, ASM=True, KB=1, PDL=0, PF=0, RED_STEP=2, FOLD=False, MUL16=False, BIASED=False,
                 XSUM=0, PAIRW=0, ADJ=False, STREAMK=False, GROW=0, IMAD=0, PROBE=0, PRE_G=False,
                 SCALE_WORDS=False)
    # every constexpr given explicitly: with FOLD left to its default, a FOLD=True and a FOLD=False compile
    # shared one on-disk cache entry (Triton 3.9 ASTSource key), so the second analysis reported the first kernel
    const.update(extra)
    const = {k: v for k, v in const.items() if k in names}
    sig = {n: ptrs.get(n, "constexpr") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ptrs
             if n in names and n not in ("M", "split_k")}  # strides = K, N: multiples of 16 as on the GPU
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def analyse(fmt, block_n, warps, stages, **extra):
    kern = compile_mv(fmt, block_n, warps, stages, **extra)
    loop, regs, stack = sass_loop(kern)
    op = lambda t: re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
    mix = collections.Counter(op(t) for t in loop)
    extra.pop("BLOCK_M", None)
    elems = block_n * 128  # one planar block (R = 16 words x 8 fields) per loop step
    return dict(regs=regs, stack=stack, loop=len(loop), per_elem=len(loop) * warps * 32 / elems,
                mix=dict(mix.most_common(12)), ops=dict(mix), sass=loop)


def scale_paths():
    """MXFP4 bn128 w2 (M-tile 16): how the e8m0 scales reach the loop (CTA barriers, registers, instructions)."""
    for name, extra in (("SCALE_PREFETCH (M 5..16 default)", dict(PRE_G=True)),
                        ("FOLD + SCALE_WORDS", dict(FOLD=True, SCALE_WORDS=True)),
                        ("GROUP_ROWS 4 groups (M <= 4 default)", dict(GROW=4)),
                        ("GROUP_ROWS 4 groups + SCALE_WORDS", dict(GROW=4, SCALE_WORDS=True))):
        a = analyse("mxfp4", 128, 2, 3, **{"GROW": 0, "IMAD": 0, "PROBE": 0, **extra})
        print(f"{name}: regs {a['regs']} spill {a['stack']} B, loop {a['loop']} instrs ({a['per_elem']:.2f} / W elem), "
              f"BAR.SYNC {sum('BAR.SYNC' in t for t in a['sass'])}", flush=True)


def asm_layouts(fmt, block_n, warps, stages, **extra):
    """{layout of the inline-asm decode's result: count} from the TTGIR (a pack=2 pair is two adjacent registers
    of that layout: two k of one column in the MMA operand layout, two columns in a blocked [1, 8] one)."""
    ttgir = compile_mv(fmt, block_n, warps, stages, **extra).asm["ttgir"]
    outs = re.findall(r"tt\.elementwise_inline_asm .*-> tensor<[^,]*, (#[\w.]+)", ttgir)

    def name(o):  # a linear layout whose first register basis is [1, 0]: a pair = k rows r, r + 1 of one column
        if o.startswith("#ttg.dot_op"):
            return "dot_op"
        m = re.search(re.escape(o) + r" = #ttg\.linear<\{register = \[\[(\d+), (\d+)\]", ttgir)
        return f"{o} (pair = 2 k)" if m and m.groups() == ("1", "0") else o
    return dict(collections.Counter(name(o) for o in outs))


def pairw_rows(base, fold):
    """The pair word order (QuantizedWeight.pair_words -> PAIRW 2: the pair-order PTX, no PRMT per register pair)
    next to the planar defaults and the other opt-in switches it combines with."""
    rows = [("int4", bn, w, s, n, dict(base, **x)) for bn, w, s in ((128, 2, 3), (64, 1, 3), (256, 4, 3), (128, 4, 2))
            for n, x in (("default", {}), ("PAIRW", {"PAIRW": 2}), ("PAIRW + ADJ", {"PAIRW": 2, "ADJ": True}),
                         ("INT_XSUM", {"XSUM": 1}), ("PAIRW + INT_XSUM", {"PAIRW": 2, "XSUM": 1}),
                         ("PAIRW + ADJ + INT_XSUM", {"PAIRW": 2, "ADJ": True, "XSUM": 1}))]
    rows += [("uint4", 128, 2, 3, f"g128 {n}", dict(base, **x)) for n, x in (
        ("default", {}), ("PAIRW", {"PAIRW": 2}), ("PAIRW + ADJ", {"PAIRW": 2, "ADJ": True}),
        ("PAIRW + INT_XSUM", {"PAIRW": 2, "XSUM": 1}), ("PAIRW + ADJ + INT_XSUM", {"PAIRW": 2, "ADJ": True, "XSUM": 1}))]
    rows += [("mxfp4", bn, w, s, n, dict(fold, **x)) for bn, w, s in ((128, 2, 3), (64, 1, 3), (128, 4, 2))
             for n, x in (("fold default", {}), ("PAIRW", {"PAIRW": 2}), ("PAIRW + ADJ", {"PAIRW": 2, "ADJ": True}),
                          ("PAIRW + FOLD_BIAS_WORDS", {"PAIRW": 2, "BIASED": True}),
                          ("PAIRW + ADJ + FOLD_BIAS_WORDS", {"PAIRW": 2, "ADJ": True, "BIASED": True}),
                          ("PAIRW + MUL16", {"PAIRW": 2, "MUL16": True}))]
    rows += [("mxfp4", bn, 1 if bn == 64 else 2, 1, n, dict(fold, MUL16=True, **x)) for bn in (64, 128)
             for n, x in (("s1 fold + MUL16 (FOLD_S1)", {}), ("s1 fold + MUL16, PAIRW 1 + ADJ", {"PAIRW": 1, "ADJ": True}))]
    return rows


def ab():
    """(Run with a fresh TRITON_CACHE_DIR: kernels that differ only in a defaulted constexpr may share a cache
    entry.) Session 11's opt-in switches (gemm_wna16_small.INT_XSUM, FOLD_BIAS_WORDS, MUL16, FOLD at num_stages 1,
    the pair word order PAIRW) against the defaults on the usual tiles: registers, spills, K-loop instructions."""
    base = dict(GROW=0, IMAD=0, PROBE=0)
    fold = dict(base, FOLD=True, SCALE_WORDS=True, IMAD=2)
    if "pairw" in sys.argv:
        return ab_table(pairw_rows(base, fold), fold)
    rows = [("int4", bn, w, s, n, dict(base, **x)) for bn, w, s in ((128, 2, 3), (64, 1, 3), (256, 4, 3), (128, 4, 2))
            for n, x in (("default", {}), ("INT_XSUM", {"XSUM": 1}))]
    rows += [("uint4", 128, 2, 3, f"g{g} {n}", dict(base, GROUP_SIZE=g, **x)) for g in (128, 32)
             for n, x in (("default", {}), ("INT_XSUM", {"XSUM": 1}))]
    rows += [("mxfp4", bn, w, s, n, dict(fold, **x)) for bn, w, s in ((128, 2, 3), (64, 1, 3), (128, 4, 2))
             for n, x in (("fold default", {}), ("FOLD_BIAS_WORDS", {"BIASED": True}), ("MUL16", {"MUL16": True}),
                          ("MUL16 + FOLD_BIAS_WORDS", {"MUL16": True, "BIASED": True}))]
    rows += [("mxfp4", bn, 1 if bn == 64 else 2, 1, n, dict(base, **x)) for bn in (64, 128)
             for n, x in (("s1 unfolded (default)", {}), ("s1 fold + MUL16 (FOLD_S1)", dict(fold, MUL16=True)),
                          ("s1 fold + MUL16 + FOLD_BIAS_WORDS", dict(fold, MUL16=True, BIASED=True)))]
    rows += [r for r in pairw_rows(base, fold) if "PAIRW" in r[4]]
    ab_table(rows, fold)


def ab_table(rows, fold):
    print("| fmt | tile | variant | regs | spill B | loop instrs | thread-instrs / W elem | LDS | LDGSTS | BAR |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for fmt, bn, w, s, name, extra in rows:
        a = analyse(fmt, bn, w, s, **extra)
        cnt = lambda op: a["ops"].get(op, 0)
        print(f"| {fmt} | 16x{bn} w{w} s{s} | {name} | {a['regs']} | {a['stack']} | {a['loop']} | "
              f"{a['per_elem']:.2f} | {cnt('LDS')} | {cnt('LDGSTS')} | {sum('BAR.SYNC' in t for t in a['sass'])} |",
              flush=True)
    for s in (1, 2):
        print(f"MXFP4 fold (int32 multipliers) bn32 w1 s{s}: e2m1 asm results in",
              asm_layouts("mxfp4", 32, 1, s, **fold), flush=True)
    # PAIRW 2 is right only where a pack=2 pair is two k of one column (the MMA operand layout): every pair-order
    # asm result must be in #dot_op (gemm_small takes PAIRW 1 at num_stages 1)
    for fmt, bn, w, s, extra in (("mxfp4", 128, 2, 3, fold), ("mxfp4", 128, 4, 2, fold), ("int4", 128, 2, 3, {}),
                                 ("int4", 128, 4, 2, {}), ("mxfp4", 64, 1, 3, dict(fold, MUL16=True)),
                                 ("mxfp4", 128, 2, 3, dict(fold, SWAP=True, BLOCK_M=8)),
                                 ("int4", 128, 2, 3, dict(SWAP=True, BLOCK_M=8)),
                                 ("mxfp4", 128, 2, 3, dict(fold, ADJ=True)), ("int4", 128, 2, 3, dict(ADJ=True)),
                                 ("int4", 128, 2, 3, dict(SWAP=True, BLOCK_M=8, ADJ=True))):
        print(f"PAIRW 2 {'mvs8' if extra.get('SWAP') else 'mv'}{' ADJ' if extra.get('ADJ') else ''} {fmt} bn{bn} w{w} "
              f"s{s}: asm results in",
              asm_layouts(fmt, bn, w, s, **{"GROW": 0, "IMAD": 0, "PROBE": 0, **extra, "PAIRW": 2}), flush=True)


def inner_loop(kern) -> int:
    """Instructions of the innermost loop holding MMAs (the K loop; sass_loop takes the longest, which for the
    stream-K grid is the loop over a program's tiles)."""
    from wna16_tc_sass import mma_loops
    loops, _ = mma_loops(kern)
    return len(loops[-1]) if loops else 0


def streamk_rows():
    """Session 25: the stream-K grid (STREAMK) beside the split-K grid on the tiles it is tuned with: registers,
    spills and the K loop (which should be the same loop)."""
    tiles = [("int4", 128, 2, 3, {"XSUM": 1}), ("int4", 64, 2, 3, {"XSUM": 1}), ("int4", 64, 1, 4, {"XSUM": 1}),
             ("int4", 128, 4, 3, {"XSUM": 1}),
             ("mxfp4", 128, 4, 3, {"FOLD": True, "SCALE_WORDS": True, "BIASED": True, "IMAD": 2, "PDL": 1}),
             ("mxfp4", 128, 2, 3, {"FOLD": True, "SCALE_WORDS": True, "BIASED": True, "IMAD": 2, "PDL": 1})]
    print("| fmt | tile | grid | regs | spill B | K loop instrs | resident CTAs / SM (regs) |")
    print("|---|---|---|---|---|---|---|")
    for fmt, bn, w, st, extra in tiles:
        for sk in (False, True):
            kern = compile_mv(fmt, bn, w, st, **extra, STREAMK=sk)
            _, regs, stack = sass_loop(kern)
            ctas = 65536 // (-(-regs // 8) * 8 * 32 * w)
            print(f"| {fmt} | 16x{bn} w{w} s{st} | {'stream-K' if sk else 'split-K'} | {regs} | {stack} | "
                  f"{inner_loop(kern)} | {ctas} |", flush=True)


def main():
    if "--streamk" in sys.argv:
        print(f"triton {triton.__version__}, sm_90")
        return streamk_rows()
    if "--ab" in sys.argv:
        print(f"triton {triton.__version__}, sm_90")
        return ab()
    if "--scale-paths" in sys.argv:
        print(f"triton {triton.__version__}, sm_90")
        return scale_paths()
    tiles = [("int4", 128, 2, 3, {}), ("int4", 64, 1, 3, {})] + [
        ("mxfp4", bn, w, 3, fold) for bn, w in ((64, 1), (128, 2), (128, 4))
        for fold in ({}, {"FOLD": True}, {"FOLD": True, "SCALE_WORDS": True})]
    print(f"triton {triton.__version__}, sm_90, mv loop per planar block (16 words x 8 fields x BLOCK_N)")
    print("| fmt | tile | regs | spill B | loop instrs | thread-instrs / W elem | top ops |")
    print("|---|---|---|---|---|---|---|")
    for fmt, bn, w, s, extra in tiles:
        a = analyse(fmt, bn, w, s, **extra)
        print(f"| {fmt}{' fold' if extra.get('FOLD') else ''}{' words' if extra.get('SCALE_WORDS') else ''} | 16x{bn} w{w} s{s} | {a['regs']} | {a['stack']} | {a['loop']} | {a['per_elem']:.2f} | "
              f"{a['mix']} |", flush=True)
    if "--dump" in sys.argv:
        i = sys.argv.index("--dump")
        fmt, bn, w = sys.argv[i + 1], int(sys.argv[i + 2]), int(sys.argv[i + 3])
        print("\n".join(analyse(fmt, bn, w, 3, FOLD="--fold" in sys.argv)["sass"]))


if __name__ == "__main__":
    main()
