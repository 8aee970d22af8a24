"""Merge `kestrel tune` result files (GPU runs) into the packaged per-GPU tune cache (kestrel/kernels/
tune_cache_h200.json): entries of later files win; only keys of the given GPU name are taken.

  python bench/merge_tune_cache.py bench/results/gemm_wna16_largem_tune_h200_s3r1.json [more.json ...]
  python bench/merge_tune_cache.py --gpu "NVIDIA H100 80GB HBM3" bench/results/wna16_tune_h100_s15_mxfp4.json
  python bench/merge_tune_cache.py --lowbit --gpu "NVIDIA H100 80GB HBM3" bench/results/w4a8tcg_tune_h100_s23.json
(--lowbit: `kestrel tune --lowbit` results into the low-bit kernels' cache, kestrel/kernels/tune_cache_lowbit_h200.json)

(The file holds every GPU's entries: keys start with the torch device name, so an H100 entry never reaches an H200.)
"""
from __future__ import annotations

import argparse
import json

from kestrel.kernels import lowbit_tune
from kestrel.kernels.configs import PACKAGED_CACHE, load_cache, store_cache


def main(paths: list[str], gpu: str = "NVIDIA H200", lowbit: bool = False) -> None:
    cache = lowbit_tune.PACKAGED_CACHE if lowbit else PACKAGED_CACHE
    before = load_cache(cache)
    new = {}
    for p in paths:
        src = f"kestrel tune, {p.rsplit('/', 1)[-1]}"  # the result file's name says the session / round
        new.update({k: {**v, "source": src} for k, v in json.load(open(p)).items() if k.startswith(gpu + "|")})
    store_cache(cache, new)
    print(f"{len(new)} entries merged ({sum(k in before for k in new)} replaced) into {cache}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="merge GPU tune results into the packaged WNA16 (or low-bit) tune cache")
    ap.add_argument("paths", nargs="+", help="tune result JSON files (kestrel tune / bench sweeps' entries)")
    ap.add_argument("--gpu", default="NVIDIA H200", help="take only the keys of this torch device name")
    ap.add_argument("--lowbit", action="store_true", help="into the low-bit kernels' cache (kestrel tune --lowbit)")
    a = ap.parse_args()
    main(a.paths, a.gpu, a.lowbit)
