"""`kestrel tune --moe MODEL`: measure candidate compute configs of the grouped MoE GEMM (both projections of the
model's experts) per token-count bucket on this GPU; the winners go to the low-bit tune cache (lowbit_tune.py's
file), keyed by GPU + kernel + experts/top-k + N + K + M bucket, and FusedMoE reads them (moe_gemm.moe_configs).

block_m is not searched: it follows the slots per expert (moe_gemm.moe_config) and is shared by the two projections,
because one sort/align serves both. Everything else (tile N, split-K, warps, stages, swapped operands) is per
projection.
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch

from kestrel.kernels.configs import load_cache, m_bucket, nearest_shape_entry, shape_key, store_cache
from kestrel.kernels.lowbit_gemm import GemmConfig
from kestrel.kernels.lowbit_tune import PACKAGED_CACHE, cache_path, gpu_name
from kestrel.kernels.moe_mv import MvConfig
from kestrel.kernels.moe_tc import TcConfig
from kestrel.kernels.tuning import fastest

MOE_MODELS = {  # experts, top_k, hidden, moe intermediate
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v2-lite": (64, 6, 2048, 1408),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "deepseek-v3": (256, 8, 7168, 2048),
}
# kernel name -> (weight format, activation format, planar layout)
MOE_KERNELS = {"moe-int4p": ("int4", "bf16", True), "moe-int4": ("int4", "bf16", False),
               "moe-fp8": ("fp8", "fp8", False), "moe-bf16": ("bf16", "bf16", False)}


def kernel_name(w, act: str) -> str:
    """the cache name of the grouped kernel these ExpertWeights run on."""
    if w.planar is not None:
        return "moe-int4p"
    return f"moe-{w.fmt}" if (w.fmt, act) in (("int4", "bf16"), ("fp8", "fp8"), ("bf16", "bf16")) else ""


def _name(kernel: str, E: int, top_k: int) -> str:
    return f"{kernel}-e{E}k{top_k}"


def _config_of(entry):
    try:
        d = entry["config"]
        kind = entry.get("kind")
        if kind == "tcg":
            from kestrel.kernels.moe_gemm import TcgConfig, moe_tcg
            return TcgConfig.from_dict(d) if moe_tcg is not None else None
        return (MvConfig if kind == "mv" else TcConfig if kind == "tc" else GemmConfig).from_dict(d)
    except (TypeError, KeyError):
        return None


_LOOKUPS: dict = {}  # memo: every MoE layer call looks its two projections up (the nearest-shape scan is not free)


@lru_cache(maxsize=8)
def _user_cache(env_value):  # cache_path() costs ~30 us (home directory lookup); once per setting of the variable
    return cache_path()


def _mtime(path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def lookup(kernel: str, M: int, E: int, top_k: int, N: int, K: int, block_m: int):
    """tuned config of this projection for M tokens, or None (then moe_gemm's heuristic). Only an entry with the
    block_m the layer uses counts."""
    user = _user_cache(os.environ.get("KESTREL_LOWBIT_TUNE_CACHE"))
    key = (gpu_name(), kernel, E, top_k, N, K, m_bucket(M), block_m, str(user), _mtime(user), _mtime(PACKAGED_CACHE))
    if key not in _LOOKUPS:
        caches = [load_cache(user), load_cache(PACKAGED_CACHE)]
        entry = nearest_shape_entry(caches, gpu_name(), _name(kernel, E, top_k), N, K, m_bucket(M),
                                    accept=lambda e: getattr(_config_of(e), "BM", None) == block_m)
        _LOOKUPS[key] = None if entry is None else _config_of(entry)
    return _LOOKUPS[key]


def _kind(cfg) -> str:
    from kestrel.kernels.moe_gemm import TcgConfig
    return ("mv" if isinstance(cfg, MvConfig) else "tc" if isinstance(cfg, TcConfig) else
            "tcg" if isinstance(cfg, TcgConfig) else "gemm")


def store(kernel: str, M: int, E: int, top_k: int, N: int, K: int, cfg, us=None, heuristic_us=None) -> None:
    entry = {"config": cfg.as_dict(), "kind": _kind(cfg)}
    if us is not None:
        entry.update(us=round(us, 3), heuristic_us=None if heuristic_us is None else round(heuristic_us, 3))
    store_cache(cache_path(), {shape_key(gpu_name(), _name(kernel, E, top_k), N, K, m_bucket(M)): entry})


def candidates(kernel: str, M: int, E: int, top_k: int, N: int, K: int, heuristic=None) -> list:
    """the heuristic first, then the search space at the layer's block_m (split-K only where K allows 2 blocks
    of 128 per split)."""
    from kestrel.kernels.moe_gemm import moe_config
    _, act, planar = MOE_KERNELS[kernel]
    bm = moe_config(M * top_k, E, act, planar=planar).BM
    decode = bm <= 16
    out = []
    if planar:  # the mv K loop; swapped operands (W as the MMA A operand) pay off from 32-row blocks up
        for bn in ((32, 64, 128) if decode else (64, 128, 256)):
            for split in ((1, 2, 4, 8) if decode else (1, 2)):
                for warps in ((1, 2, 4) if decode else (4, 8)):
                    for swap in ((0,) if decode else (0, 1)):
                        out.append(MvConfig(BM=bm, BN=bn, SPLIT_K=split, num_warps=warps, num_stages=3, SWAP=swap))
        if not decode:  # the tc kernel (one K=128 dot per step)
            for bn, warps, dec in ((128, 4, 1), (128, 8, 2), (256, 8, 1), (64, 4, 1)):
                for stages in (3, 4):
                    out.append(TcConfig(BM=bm, BN=bn, num_warps=warps, num_stages=stages, DEC=dec))
            from kestrel.kernels.moe_gemm import TcgConfig, moe_tcg
            if moe_tcg is not None and bm in (64, 128):  # the Gluon kernels (Hopper; moe_gemm falls back to tc)
                for swap, bn, stages in ((2, 256, 4), (2, 256, 5), (1, 256, 3), (1, 256, 4), (2, 128, 4),
                                         (1, 128, 3), (0, 128, 3)):
                    out.append(TcgConfig(BM=bm, BN=bn, num_warps=8, num_stages=stages, GROUP_M=8, SWAP=swap))
    else:
        swaps = (0, 1) if act != "bf16" or kernel == "moe-int4" else (0,)
        # split-K outermost: a --max-candidates prefix covers every tile width before any K split (with thousands
        # of expert-block programs from M = 64 up, a split rarely pays)
        for split in ((1, 2, 4) if decode else (1,)):
            for bn in (64, 128, 256):
                for stages in (3, 4):
                    for swap in swaps:
                        warps = 8 if bm * bn >= 128 * 128 or bn >= 256 else 4
                        out.append(GemmConfig(BM=bm, BN=bn, BK=128 if act != "bf16" or kernel == "moe-int4" else 64,
                                              SPLIT_K=split, num_warps=warps, num_stages=stages, SWAP_AB=swap))
    out = [c for c in out if c.SPLIT_K == 1 or K % (128 * c.SPLIT_K) == 0 and K // (128 * c.SPLIT_K) >= 2]
    if heuristic is not None:
        out = [heuristic] + [c for c in out if c != heuristic]
    return out


def make_case(kernel: str, M: int, E: int, top_k: int, N: int, K: int, device="cuda", n_routings: int = 4):
    """-> (run(cfg) over `n_routings` routings, the heuristic config): one projection [E, N, K], random weights."""
    from kestrel.kernels.moe_align import moe_align
    from kestrel.kernels.moe_gemm import _projection_config, moe_config, quant_act, quantize_experts
    wfmt, act, planar = MOE_KERNELS[kernel]
    w = quantize_experts(torch.randn(E, N, K, device=device) * 0.02, wfmt, 128, planar=planar)
    x = torch.randn(M, K, device=device).to(torch.bfloat16)
    a = quant_act(x, act)
    T = M * top_k
    base = moe_config(T, E, act, planar=planar)
    heur = _projection_config(base, T, E, w, 132)
    ids = [torch.rand(M, E, device=device).topk(top_k, dim=-1).indices.to(torch.int32) for _ in range(n_routings)]
    aligns = [moe_align(i, E, base.BM) for i in ids]
    out = torch.empty(T, N, device=device, dtype=torch.bfloat16)

    def run(cfg):
        from kestrel.kernels.moe_gemm import grouped_gemm
        for al in aligns:
            grouped_gemm(a, w, al, T, top_k, out, cfg)
    return run, heur


def _graph_us(fn) -> float:
    from kestrel.kernels.timing import graph_time_us
    return graph_time_us([fn], calls=5, replays=10, warmup=2)


def tune_moe(model: str, kernel: str, ms: list[int], progress=None, timer=None, device="cuda",
             save: bool = True, max_candidates: int | None = None) -> dict:
    """both projections of `model` for each M (tokens) -> {key: {"config", "us", "heuristic_us"}}."""
    timer = timer or _graph_us
    E, k, H, I = MOE_MODELS[model]
    results = {}
    for N, K in ((2 * I, H), (H, I)):
        for M in ms:
            run, heur = make_case(kernel, M, E, k, N, K, device)
            cands = candidates(kernel, M, E, k, N, K, heur)[:max_candidates]
            best, best_t, times = fastest(cands, lambda cfg: timer(lambda: run(cfg)), progress)
            if best is None:
                continue
            if save:
                store(kernel, M, E, k, N, K, best, best_t, times[0])
            results[f"{_name(kernel, E, k)}|N{N}|K{K}|M{m_bucket(M)}"] = {"config": best.as_dict(), "us": best_t,
                                                                       "heuristic_us": times[0]}
    return results


def run_cli(models: list[str], kernels: list[str], ms: list[int], max_candidates: int | None) -> None:
    if not torch.cuda.is_available():
        raise ValueError("kestrel tune needs a CUDA GPU (none is visible)")
    from tqdm import tqdm
    total = 0
    for model in models:
        E, k, H, I = MOE_MODELS[model]
        for kern in kernels:
            for N, K in ((2 * I, H), (H, I)):
                total += sum(min(len(candidates(kern, m, E, k, N, K)) + 1, max_candidates or 10**9) for m in ms)
    with tqdm(total=total, desc=f"tuning MoE GEMMs on {torch.cuda.get_device_name()}", unit="cfg") as bar:
        for model in models:
            for kern in kernels:
                bar.set_postfix_str(f"{model} {kern}")
                for key, v in tune_moe(model, kern, ms, progress=bar, max_candidates=max_candidates).items():
                    tqdm.write(f"{key}: {v['us']:.1f} us (heuristic {v['heuristic_us']:.1f}) {v['config']}")
    print(f"wrote {cache_path()}")
