"""Merge `kestrel tune` result files (GPU runs) into the packaged per-GPU tune cache (kestrel/kernels/
tune_cache_h200.json): entries of later files win; only keys of the given GPU name are taken.

  python bench/merge_tune_cache.py bench/results/gemm_wna16_largem_tune_h200_s3r1.json [more.json ...]
"""
from __future__ import annotations

import json
import sys

from kestrel.kernels.configs import PACKAGED_CACHE, load_cache, store_cache


def main(paths: list[str], gpu: str = "NVIDIA H200") -> None:
    before = load_cache(PACKAGED_CACHE)
    new = {}
    for p in paths:
        src = f"kestrel tune, {p.rsplit('/', 1)[-1]}"  # the result file's name says the session / round
        new.update({k: {**v, "source": src} for k, v in json.load(open(p)).items() if k.startswith(gpu + "|")})
    store_cache(PACKAGED_CACHE, new)
    print(f"{len(new)} entries merged ({sum(k in before for k in new)} replaced) into {PACKAGED_CACHE}")


if __name__ == "__main__":
    main(sys.argv[1:])
