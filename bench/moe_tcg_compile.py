"""Offline sm_90a compile of the grouped Gluon MoE kernels (moe_tcg.py) with the H200's Triton 3.6 + ptxas on a
machine without a GPU: registers, stack, shared memory, K-loop SASS, and the K loops' writes to registers an
in-flight wgmma may still read as A (the race gemm_wna16_tcg fixed with _swap_kloop: must be 0). Not a correctness
check (Gluon runs only on a Hopper GPU). The compile is moe_tcg_sass.compile_tcgp, the race count and ptxas'
C7511 check bench/wna16_tcg_compile.py's.

  PYTHONPATH=/tmp/t36:$PWD python bench/moe_tcg_compile.py            # the configs serving uses (+ SWAP 2 / 1 / 0)
  PYTHONPATH=/tmp/t36:$PWD python bench/moe_tcg_compile.py 80:256:8:4:8:2:0:0:0:0:2
  ... --md5     # also the md5 of each variant's whole SASS: run in two trees (e.g. a `git archive` of main) and
                # diff, to show a change leaves a default compile identical
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from wna16_tcg_compile import inflight_a_writes, wgmma_serialised  # noqa: E402  (also the Triton 3.6 aliases)
from moe_tcg_sass import compile_tcgp  # noqa: E402
from wna16_tc_sass import BIN, sass_loop  # noqa: E402

from kestrel.kernels.moe_tcg import TcgConfig  # noqa: E402

# BM:BN:warps:stages:GROUP_M:SWAP:REFILL:MAXNREG:PROBE:PERSIST:WS[:LOOP]. Serving (moe_gemm._projection_config,
# KESTREL_MOE_TCG=5 on Hopper): the WS loop with 64 / 80 / 96-row blocks, BN 256; 128-row blocks (KESTREL_MOE_TCG_BM
# =128 or =3) the tcgp loop with BN 128; =4 the persistent tcgp; =2 the old swapped loop
SERVING = ("64:256:8:4:8:2:0:0:0:0:2", "80:256:8:4:8:2:0:0:0:0:2", "96:256:8:4:8:2:0:0:0:0:2",
           "128:128:8:4:8:2", "64:256:8:4:8:2", "64:256:8:4:8:2:0:0:0:1", "64:256:8:3:8:1")
SERVING = SERVING + tuple(c + ":0" * (10 - c.count(":")) + ":2" for c in SERVING[:6])  # + their LOOP 2 forms


def sass_text(kern) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kern.asm["cubin"])
        f.flush()
        return subprocess.run([f"{BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout


def sass_md5(kern) -> str:
    """md5 of the kernel's SASS instructions (addresses and encodings dropped)."""
    body = "\n".join(m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass_text(kern)))
    return hashlib.md5(body.encode()).hexdigest()


def k_step(kern) -> str:
    """the innermost K loop (the shortest backward branch whose body holds a wgmma; sass_loop's longest one spans
    the WS partitions' epilogue too): instructions, HGMMA, WARPGROUP.DEPBAR (wgmma waits) and BAR per K step."""
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass_text(kern))]
    best = None
    for addr, text in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if any("GMMA" in t for t in body) and (best is None or len(body) < len(best)):
                best = body
    op = lambda t: re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]
    return (f"K step {len(best)} SASS ({sum('GMMA' in op(t) for t in best)} HGMMA/QGMMA, "
            f"{sum(op(t).startswith('WARPGROUP.DEPBAR') for t in best)} wgmma waits, "
            f"{sum(op(t).startswith('BAR') for t in best)} BAR)")


def inflight_a_writes_skipping(kern) -> int:
    """inflight_a_writes on the path that takes every forward branch inside a K loop (the persistent loop's
    tile epilogue, `if last:`, holds a wait(0) that the straight-line replay would otherwise always count as run):
    the same count (wna16_tcg_compile's), fed the SASS without those skipped regions."""
    sass = sass_text(kern)
    ins = [(int(m.group(1), 16), m.group(0)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(int(m.group(1), 16), a) for a, t in ins for m in [re.search(r"BRA (0x[0-9a-f]+)", t)]
             if m and int(m.group(1), 16) < a]
    skip = []
    for a, t in ins:
        m = re.search(r"@!?U?P\w+\s+BRA (0x[0-9a-f]+)", t)
        if m and int(m.group(1), 16) > a and any(lo <= a and int(m.group(1), 16) <= hi for lo, hi in loops):
            skip.append((a, int(m.group(1), 16)))
    drop = {t for a, t in ins if any(lo < a < hi for lo, hi in skip)}
    return inflight_a_writes_on(kern, "\n".join(line for line in sass.splitlines() if not any(d in line for d in drop)))


def inflight_a_writes_on(kern, sass: str) -> int:
    """wna16_tcg_compile.inflight_a_writes of kern, counted on the given (edited) SASS text instead of kern's own
    (it runs cuobjdump itself: its answer is substituted for that one call)."""
    real = subprocess.run
    subprocess.run = lambda *a, **k: type("R", (), {"stdout": sass})() if "-sass" in a[0] else real(*a, **k)
    try:
        return inflight_a_writes(kern)
    finally:
        subprocess.run = real


def ptxas_wgmma_notes(kern) -> list[str]:
    """ptxas' C75xx notes on the kernel's PTX (Triton's bundled ptxas, -v): C7511 serialised wgmma, C7517 a
    warpgroup.wait it injected (e.g. the persistent loop's: a full wait every step, no decode / MMA overlap)."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        open(src, "w").write(kern.asm["ptx"])
        res = subprocess.run([f"{BIN}/ptxas", "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    return sorted(set(re.findall(r"\((C75\d\d)\)", res.stdout + res.stderr)))


def parse(c: str) -> TcgConfig:
    return TcgConfig(*(int(v) for v in c.split(":")))


def report(c: str, reduce: bool, md5: bool = False) -> bool:
    tag = f"{c} {'reduce' if reduce else 'store'}"
    try:
        k = compile_tcgp(parse(c), reduce)
        loop, regs, stack = sass_loop(k)
        print(f"{tag}: regs {regs} stack {stack} shared {k.metadata.shared} {k_step(k)}, "
              f"longest HGMMA loop {len(loop)} SASS, writes to in-flight wgmma A registers "
              f"{inflight_a_writes(k)} (forward branches taken: {inflight_a_writes_skipping(k)}), ptxas wgmma notes "
              f"{ptxas_wgmma_notes(k) or 'none'}{', wgmma SERIALISED (C7511)' if wgmma_serialised(k) else ''}"
              f"{', SASS md5 ' + sass_md5(k) if md5 else ''}", flush=True)
        return True
    except Exception as ex:  # report every variant, fail at the end
        print(f"{tag}: FAILED {type(ex).__name__}: {str(ex)[:1500]}", flush=True)
        return False


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="*", default=list(SERVING))
    p.add_argument("--store-only", action="store_true", help="skip the down projection's routed atomic epilogue")
    p.add_argument("--md5", action="store_true", help="also print each variant's SASS md5")
    args = p.parse_args()
    ok = True
    for c in args.configs:
        for red in (False,) if args.store_only else (False, True):
            ok &= report(c, red, args.md5)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
