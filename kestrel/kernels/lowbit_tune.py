"""Tune cache of the low-bit GEMMs (W8A8, W4A8, W4A4): per-GPU winners keyed by GPU + kernel + N + K + M bucket.

Filled by `kestrel tune --lowbit` (lowbit_tuning.py); read by the kernels at launch: user cache, then the packaged
H200 cache, then the nearest tuned shape, then lowbit_gemm.heuristic_config. File I/O, key format, M buckets and the
nearest-shape rule are the WNA16 cache's (configs.py); only the file locations and the config type are ours.
"""
from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from kestrel.kernels.configs import load_cache, m_bucket, nearest_shape_entry, shape_key, store_cache
from kestrel.kernels.lowbit_gemm import GemmConfig

PACKAGED_CACHE = Path(__file__).with_name("tune_cache_lowbit_h200.json")


def cache_path() -> Path:
    return Path(os.environ.get("KESTREL_LOWBIT_TUNE_CACHE",
                               Path.home() / ".cache" / "kestrel" / "lowbit_tune.json"))


@lru_cache(maxsize=1)
def gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def key(kernel: str, M: int, N: int, K: int) -> str:
    return shape_key(gpu_name(), kernel, N, K, m_bucket(M))


def _config_of(entry) -> GemmConfig | None:
    try:
        return GemmConfig.from_dict(entry["config"] if "config" in entry else entry)
    except (TypeError, KeyError):
        return None


def lookup(kernel: str, M: int, N: int, K: int, nearest: bool = True) -> GemmConfig | None:
    """tuned config for this (kernel, shape, M bucket) on this GPU, or None (then the caller's heuristic).
    nearest=False: this exact shape's entry only (no neighbour's)."""
    caches = [load_cache(cache_path()), load_cache(PACKAGED_CACHE)]
    entry = nearest_shape_entry(caches, gpu_name(), kernel, N, K, m_bucket(M), max_dist=2.0 if nearest else 0.0,
                                accept=lambda e: _config_of(e) is not None)
    return None if entry is None else _config_of(entry)


def store(kernel: str, M: int, N: int, K: int, cfg: GemmConfig, us: float | None = None,
          heuristic_us: float | None = None) -> None:
    entry = {"config": cfg.as_dict()}
    if us is not None:
        entry.update(us=round(us, 3), heuristic_us=None if heuristic_us is None else round(heuristic_us, 3))
    store_cache(cache_path(), {key(kernel, M, N, K): entry})
