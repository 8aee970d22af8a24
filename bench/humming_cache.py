"""Humming's on-disk cubin cache, made portable between the GPU rounds (bench only; Humming's kernels are unchanged).

Humming JIT-compiles every M-interval kernel of a (format, shape) at its first call (~10 s, one shape at a time),
and keys each cubin on a signature that includes its headers' absolute paths and mtimes; the mtimes change with
every install of the wheel, so a cache carried to a fresh machine would never hit. pin_cache_key() keys on the
headers' contents instead (same Humming build -> same key). With HUMMING_CACHE_DIR pointing at a carried copy the
timing loop then only loads cubins.

  python bench/humming_cache.py pack CACHE_DIR OUT.tgz [--max-mb 9]   # cubins + signatures only
"""
from __future__ import annotations

import argparse
import functools
import glob
import hashlib
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


def pack(cache_dir: str, out: str, max_mb: float) -> None:
    """tar.gz of the cache's kernel.cubin files (what a hit needs: the directory name is the key), newest last,
    stopping before max_mb of input."""
    cubins = sorted(glob.glob(os.path.join(cache_dir, "*", "kernel.cubin")), key=os.path.getmtime)
    total, kept = 0, 0
    with tarfile.open(out, "w:gz") as tar:
        for f in cubins:
            size = os.path.getsize(f)
            if total + size > max_mb * 2 ** 20:
                break
            tar.add(f, arcname=os.path.relpath(f, cache_dir))
            total, kept = total + size, kept + 1
    print(f"humming cache: {kept} of {len(cubins)} cubins, {total / 2 ** 20:.1f} MB in -> "
          f"{os.path.getsize(out) / 2 ** 20:.1f} MB {out}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("cache_dir")
    p.add_argument("out")
    p.add_argument("--max-mb", type=float, default=9.0)
    args = ap.parse_args()
    pack(args.cache_dir, args.out, args.max_mb)


if __name__ == "__main__":
    main()
