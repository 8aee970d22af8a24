"""Humming's on-disk cubin cache, made portable between the GPU rounds (bench only; Humming's kernels are unchanged).

Humming JIT-compiles every M-interval kernel of a (format, shape) at its first call (~10 s, one shape at a time),
and keys each cubin on a signature that includes its headers' absolute paths and mtimes; the mtimes change with
every install of the wheel, so a cache carried to a fresh machine would never hit. pin_cache_key() keys on the
headers' contents instead (same Humming build -> same key). With HUMMING_CACHE_DIR pointing at a carried copy the
timing loop then only loads cubins.

  python bench/humming_cache.py warm --max-m 16 --procs 4              # fill HUMMING_CACHE_DIR (Llama shapes)
  python bench/humming_cache.py pack CACHE_DIR OUT.tgz [--max-mb 8]   # OUT_i.tgz, for the next round
"""
from __future__ import annotations

import argparse
import functools
import glob
import hashlib
import json
import os
import tarfile


def pin_cache_key() -> None:
    """Replace the mtime part of Humming's cubin signature by a hash of its header contents (idempotent)."""
    from humming.jit.compiler import Compiler
    if getattr(Compiler, "_kestrel_pinned", False):
        return
    inc = Compiler.humming_include_dir()

    @functools.lru_cache(maxsize=1)
    def headers_hash() -> str:
        h = hashlib.sha256()
        for f in sorted(glob.glob(f"{inc}/**/*.cuh", recursive=True)):
            h.update(os.path.relpath(f, inc).encode())
            h.update(open(f, "rb").read())
        return "headers-sha256:" + h.hexdigest()

    Compiler.cuh_last_update_time = staticmethod(headers_hash)
    Compiler._kestrel_pinned = True


def small_m_tuning(layer, max_m: int) -> list:
    """Humming's heuristic tuning list for this layer (what its forward resolves when given none: [lo, hi, config]
    entries, M in (lo, hi]) cut to the entries holding some M <= max_m, the last one open-ended."""
    from humming.kernel.humming import HummingKernel
    _, _, tuning = HummingKernel._resolve_configs(layer.humming_config.to_str(), None, None,
                                                  torch_device_index())
    keep = [list(e) for e in tuning if e[0] < max_m]
    keep[-1][1] = 1 << 30
    return keep


def torch_device_index() -> int:
    import torch
    return torch.cuda.current_device()


def small_m_caller(layer, max_m: int):
    """layer(x) with the cut tuning list (falls back to the plain layer, with a note, if Humming refuses it)."""
    import functools as ft
    try:
        tuning = small_m_tuning(layer, max_m)
        json.dumps(tuning)  # Humming's forward passes it on as JSON
    except Exception as ex:
        print(f"humming: tuning list not cut ({ex!r}"[:200] + ")", flush=True)
        return layer
    call = ft.partial(layer, tuning_config=tuning)
    call.n_kernels = len(tuning)
    return call


def pack(cache_dir: str, out: str, max_mb: float) -> None:
    """The cache's kernel.cubin files (all a hit needs: the directory name is the key) as OUT_0.tgz, OUT_1.tgz, ...
    of at most max_mb of cubins each (each comes back from a round as one small file)."""
    cubins = sorted(glob.glob(os.path.join(cache_dir, "*", "kernel.cubin")))
    parts, cur, size = [], [], 0
    for f in cubins:
        if cur and size + os.path.getsize(f) > max_mb * 2 ** 20:
            parts.append(cur)
            cur, size = [], 0
        cur.append(f)
        size += os.path.getsize(f)
    if cur:
        parts.append(cur)
    base = out[:-4] if out.endswith(".tgz") else out
    for i, files in enumerate(parts):
        with tarfile.open(f"{base}_{i}.tgz", "w:gz") as tar:
            for f in files:
                tar.add(f, arcname=os.path.relpath(f, cache_dir))
        print(f"humming cache part {i}: {len(files)} cubins, {sum(map(os.path.getsize, files)) / 2 ** 20:.1f} MB "
              f"-> {os.path.getsize(f'{base}_{i}.tgz') / 2 ** 20:.1f} MB", flush=True)


def _warm(pairs_max_m):
    """Worker: build Humming for each (fmt, N, K) first (the GPU part, while a bench beside it is still compiling),
    then call each once (its first call compiles the kernels: CPU, plus one tiny launch)."""
    import time
    import torch
    from gemm_wna16 import build_humming
    pairs, max_m = pairs_max_m
    calls = []
    for fmt, n, k in pairs:
        try:
            calls.append(build_humming(fmt, torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, max_m)[0])
        except Exception as ex:
            calls.append(None)
            print(f"humming warm {fmt} {n}x{k}: build failed {ex!r}"[:200], flush=True)
    if any(c is not None for c in calls):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    for (fmt, n, k), call in zip(pairs, calls):
        if call is None:
            continue
        t0 = time.time()
        try:
            call(torch.randn(1, k, device="cuda", dtype=torch.bfloat16))
            torch.cuda.synchronize()
            msg = f"{time.time() - t0:.1f}s ({getattr(call, 'n_kernels', 'all')} kernels)"
        except Exception as ex:
            msg = f"failed {ex!r}"[:200]
        print(f"humming warm {fmt} {n}x{k}: {msg}", flush=True)


def warm(formats, models, max_m, procs):
    """Fill HUMMING_CACHE_DIR for these formats x Llama shapes (largest first), `procs` processes."""
    import multiprocessing as mp
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from kestrel.kernels.tuning import MODEL_SHAPES
    pairs = sorted({(f, n, k) for f in formats for mo in models for n, k in MODEL_SHAPES[mo]},
                   key=lambda p: -p[1] * p[2])
    jobs = [(pairs[i::procs], max_m) for i in range(procs) if pairs[i::procs]]
    with mp.get_context("spawn").Pool(len(jobs)) as pool:
        pool.map(_warm, jobs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("cache_dir")
    p.add_argument("out")
    p.add_argument("--max-mb", type=float, default=8.0)
    w = sub.add_parser("warm", help="JIT-compile Humming's M <= max-m kernels of the Llama shapes into the cache")
    w.add_argument("--formats", default="int4,mxfp4")
    w.add_argument("--models", default="llama3-8b,llama3-70b")
    w.add_argument("--max-m", type=int, default=16)
    w.add_argument("--procs", type=int, default=4)
    args = ap.parse_args()
    if args.cmd == "pack":
        pack(args.cache_dir, args.out, args.max_mb)
    else:
        warm(args.formats.split(","), args.models.split(","), args.max_m, args.procs)


if __name__ == "__main__":
    main()
