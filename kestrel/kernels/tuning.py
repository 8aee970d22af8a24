"""Measure candidate ComputeConfigs on the current GPU and keep the fastest per (layer, M bucket)."""
from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from kestrel.kernels.configs import ComputeConfig, LayerConfig, cache_key, heuristic, m_bucket
from kestrel.kernels.timing import graph_time_us
from kestrel.quant.rtn import quantize
from kestrel.quant.spec import QuantSpec

# named formats for the CLI and the bench
FORMATS = {
    "int4": QuantSpec("int4", group_size=128, scale_dtype="bf16"),
    "uint4-zp": QuantSpec("uint4", group_size=128, has_zero_point=True, scale_dtype="bf16"),
    "int8": QuantSpec("int8", group_size=-1, scale_dtype="bf16"),
    "fp8": QuantSpec("fp8_e4m3", group_size=-1, scale_dtype="fp32"),
    "mxfp4": QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0"),
    "nvfp4": QuantSpec("fp4_e2m1", group_size=16, scale_dtype="fp8_e4m3", global_scale=True),
    "int3": QuantSpec("int3", group_size=128, scale_dtype="bf16"),
    "int2": QuantSpec("int2", group_size=64, scale_dtype="bf16"),
}

MODEL_SHAPES = {  # (N, K) of the linear layers (fused qkv and gate_up)
    "llama3-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "llama3-70b": [(10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)],
}


def candidates(layer: LayerConfig, m: int) -> list[ComputeConfig]:
    out = small_m_candidates(layer, m) if m <= 16 else large_m_candidates(layer, m)
    h = heuristic(layer, m)
    seen, uniq = set(), []
    for c in [h] + out:
        if c not in seen and c.valid_for(layer):
            seen.add(c)
            uniq.append(c)
    # nearest neighbours of the heuristic first, so --max-candidates does a local search around it
    dist = lambda c: sum(a != b for a, b in zip(c.to_dict().values(), h.to_dict().values()))
    return sorted(uniq, key=dist)


def tc_configs(m: int) -> list[ComputeConfig]:
    """tensor-core "tc" tiles tried at this M (> 16), before split-K: the ones that won or came within ~10 % somewhere
    in the H200 round-1 sweep of 2026-12-03 (32-row, 256-row, 256-deep-K tiles and "mv" at M = 64 lost everywhere)."""
    C = ComputeConfig
    if m <= 64:
        return [C("tc", 64, 128, 0, 1, 8, 3), C("tc", 64, 128, 0, 1, 8, 4), C("tc", 64, 64, 0, 1, 4, 4),
                C("tc", 64, 64, 0, 1, 4, 3)]
    if m <= 256:
        return [C("tc", 128, 128, 0, 1, 8, 2), C("tc", 128, 128, 0, 1, 8, 3), C("tc", 128, 128, 0, 1, 8, 4),
                C("tc", 64, 128, 0, 1, 8, 3), C("tc", 128, 256, 0, 1, 8, 3)]
    return [C("tc", 128, 128, 0, 1, 8, 2), C("tc", 128, 128, 0, 1, 8, 3), C("tc", 128, 256, 0, 1, 8, 3)]


def large_m_candidates(layer: LayerConfig, m: int, num_sms: int = 132) -> list[ComputeConfig]:
    """M > 16: the tc tiles, each also split over K while the tiles fill fewer than ~3 CTAs per SM and each split
    keeps >= 8 K steps (M <= 256); from M = 256 the dequant + cuBLAS path as one pass, and from M = 1024 also as
    2-8 column blocks overlapped with the matmul (chunks). Also the grid of bench/wna16_tc_sweep.py --wide."""
    C = ComputeConfig
    steps = -(-layer.k // layer.spec.k_multiple)
    out = []
    for c in tc_configs(m):
        out.append(c)
        tiles = -(-m // c.block_m) * -(-layer.n // c.block_n)
        sk = 2
        while m <= 256 and tiles * sk <= 3 * num_sms and steps // sk >= 8 and sk <= 8:
            out.append(C(**{**c.to_dict(), "split_k": sk}))
            sk *= 2
    if m >= 256:
        out += [C("dequant_mm", 1, 64, 128, 1, 4, 1), C("dequant_mm", 1, 128, 128, 1, 8, 1)]
        if m >= 1024:
            out += [C("dequant_mm", 1, 128, 128, 1, 8, 1, chunks=ch) for ch in (2, 4, 8)]
    return out


def small_m_candidates(layer: LayerConfig, m: int) -> list[ComputeConfig]:
    """M <= 16 (gemm_wna16_small.py): the mv tiles that came within 5 % of the best on some (format, shape, M) of the
    H200 `kestrel tune` run of 2026-12-03 session 3 round 1 (int4 g128 and MXFP4, 4 Llama shapes, M = 1 and 16;
    bench/results/gemm_wna16_smallm.md), split-K 1..16 (32 for the narrow tiles), and for M <= 4 the CUDA-core
    stream kernel (gemm_wna16_stream.py). Narrow tiles (64 or fewer columns per warp) put more warps on each SM
    for the same weight bytes: MXFP4 won with them by up to 25 %. Dropped there (never within 5 %): the CUDA-core
    gemv kernel, mvs, 8-warp tiles, num_stages=1 (register prefetch), block_k=256 on 4-warp tiles; earlier the
    L2-prefetch variants (ComputeConfig.prefetch: 4-40 % slower on every point of the session-2 round-1 sweep)."""
    km = layer.spec.k_multiple
    out = stream_candidates(m)
    narrow = (("mv", 128, 2, 0, 3), ("mv", 128, 1, 0, 3), ("mv", 64, 1, 0, 3), ("mv", 64, 2, 0, 3),
              ("mv", 32, 1, 0, 3))
    wide = (("mv", 128, 2, 0, 4), ("mv", 64, 1, 0, 4), ("mv", 64, 2, 0, 4), ("mv", 128, 4, 0, 3), ("mv", 256, 4, 0, 3),
            ("mv", 128, 2, 2 * km, 3), ("mv", 256, 4, 2 * km, 3))
    for (kern, bn, w, bk, st), sk in itertools.product(narrow + wide, (1, 2, 4, 8, 16)):
        out.append(ComputeConfig(kern, 16, bn, bk, sk, w, st))
    out += [ComputeConfig(kern, 16, bn, bk, 32, w, st) for kern, bn, w, bk, st in narrow]
    return out


# stream kernel (gemm_wna16_stream.py) tiles tried at M <= 4: (block_n, num_warps, num_stages). The first two were
# the best of the session-1 sweep (bench/results/gemm_wna16_smallm.md) and won 8B o at M = 1 for int4 and MXFP4 in
# the session-3 `kestrel tune` run; the other two swap their register prefetch (num_stages 2 / 1)
STREAM_TILES = ((64, 1, 2), (128, 1, 1), (64, 1, 1), (128, 1, 2))


def stream_candidates(m: int) -> list[ComputeConfig]:
    """CUDA-core "stream" configs for M <= 4 (one program per <= 4 rows of x; beyond that the tensor-core mv
    kernel reads the weights once for all 16 rows)."""
    if m > 4:
        return []
    bm = 1 << (m - 1).bit_length()  # block_m is a power of two: M = 3 runs as 4 with the last row masked
    return [ComputeConfig("stream", b, bn, 0, sk, w, st) for b in sorted({1, bm}) for (bn, w, st) in STREAM_TILES
            for sk in (8, 16, 32)]


def make_weights(layer: LayerConfig, device, min_bytes: int = 256 << 20, max_copies: int = 8):
    """Several copies of a random quantized weight so timing rotates past the L2 (60 MB on an H200)."""
    w = torch.randn(layer.n, layer.k, device=device, dtype=torch.float32) * 0.02
    qw = quantize(w, layer.spec)
    copies = max(1, min(max_copies, math.ceil(min_bytes / max(1, qw.nbytes))))
    out = [qw]
    for _ in range(copies - 1):
        out.append(type(qw)(**{**qw.__dict__, "qweight": qw.qweight.clone(), "scales": qw.scales.clone(),
                               "zeros": None if qw.zeros is None else qw.zeros.clone()}))
    return out


def time_config_graph(fn_for_copy, n_copies: int, calls: int = 20, replays: int = 10) -> float:
    """Median µs per call inside a CUDA graph of `calls` calls rotating over the weight copies: what the engine
    (graph mode) sees; do_bench would time the Python launch of few-µs kernels, and of the multi-launch
    dequant + cuBLAS paths, instead."""
    return graph_time_us([lambda i=i: fn_for_copy(i) for i in range(n_copies)], calls=calls, replays=replays)


def fastest(configs, measure, progress=None):
    """-> (fastest config or None, its time, every config's time in order); a config whose measure(cfg) raises
    (the compiler rejects it: shared memory, registers; or it computes something else) counts as inf."""
    best, best_t, times = None, float("inf"), []
    for cfg in configs:
        try:
            t = measure(cfg)
        except Exception:
            t = float("inf")
        times.append(t)
        if t < best_t:
            best, best_t = cfg, t
        if progress is not None:
            progress.update(1)
    return best, best_t, times


def compile_key(cfg: ComputeConfig) -> ComputeConfig:
    """The part of a config the JIT specialises on: the split count is a runtime argument (only split > 1 is a
    constexpr), so configs that differ only there share one compiled kernel."""
    return dataclasses.replace(cfg, split_k=min(cfg.split_k, 2))


def layer_candidates(layer: LayerConfig, m: int, max_candidates: int | None = None) -> list[ComputeConfig]:
    cands = candidates(layer, m)
    return cands[:max_candidates] if max_candidates else cands


_WARM_WEIGHTS: dict = {}


def _warm_one(job):
    """Worker: compile (run once) one config at the given M on the layer's own shape, so the timing process finds
    the kernel in Triton's on-disk cache. -> (job, seconds, error or None)."""
    layer, cfg, ms, device = job
    import time
    from kestrel.kernels.gemm_wna16 import gemm_wna16
    t0 = time.time()
    try:
        if layer not in _WARM_WEIGHTS:  # a worker compiles many configs of a layer: quantize once
            w = torch.randn(layer.n, layer.k, device=device, dtype=torch.float32) * 0.02
            _WARM_WEIGHTS[layer] = quantize(w, layer.spec)
        for m in ms:
            gemm_wna16(torch.randn(m, layer.k, device=device, dtype=torch.bfloat16), _WARM_WEIGHTS[layer], cfg)
        if device != "cpu":
            torch.cuda.synchronize()
        return job, time.time() - t0, None
    except Exception as ex:  # the timing pass records it as inf
        return job, time.time() - t0, repr(ex)[:200]


def warm_compile(layers: list[LayerConfig], ms: list[int], jobs: int, max_candidates: int | None = None,
                 log=print, device="cuda") -> float:
    """JIT-compile every candidate of these layers in `jobs` spawned processes (Triton compiles take 5-30 s each
    and one process compiles serially). Configs the JIT cannot tell apart (same format, compile_key and
    specialisation) are compiled once, on the first layer that has them. -> wall seconds."""
    import multiprocessing as mp
    import time
    t0 = time.time()
    todo: dict = {}
    for layer in layers:
        for m in ms:
            for c in layer_candidates(layer, m, max_candidates):
                key = (layer.spec, layer.n % 16 == 0 and layer.k % 16 == 0, compile_key(c))
                todo.setdefault(key, (layer, c, set()))[2].add(m)
    work = [(layer, c, sorted(m_set), device) for layer, c, m_set in todo.values()]
    with mp.get_context("spawn").Pool(jobs) as pool:
        for (layer, c, _, _), t, err in pool.imap_unordered(_warm_one, work):
            if err:
                log(f"compile failed {layer.key} {c}: {err}")
    log(f"compiled {len(work)} kernels in {jobs} processes: {time.time() - t0:.1f} s")
    return time.time() - t0


def tune_layer(layer: LayerConfig, ms: list[int], gpu: str, device="cuda", progress=None,
               max_candidates: int | None = None, record: list | None = None) -> dict:
    """-> {cache_key: {"config": {...}, "us": t, "heuristic_us": t_h, "previous_us": t_p}} for each M bucket;
    the config in use before (TuningConfig.lookup: tune cache or heuristic) is measured too, so a stored winner is
    never slower than what it replaces. `record` (a list) gets every measurement as a dict."""
    from kestrel.kernels.configs import TuningConfig
    from kestrel.kernels.gemm_wna16 import gemm_wna16
    from kestrel.quant import dequantize
    weights = make_weights(layer, device)
    deq = dequantize(weights[0]).float()
    results = {}
    for m in ms:
        x = torch.randn(m, layer.k, device=device, dtype=torch.bfloat16)
        prev = TuningConfig(gpu).lookup(layer, m)
        cands = list(dict.fromkeys([prev] + layer_candidates(layer, m, max_candidates)))
        ref = x.float() @ deq.t()

        def measure(cfg):
            y = gemm_wna16(x, weights[0], cfg).float()  # never store a config that computes something else
            if not ((y - ref).norm() <= 1e-2 * ref.norm()):
                raise ValueError(f"{cfg} disagrees with x @ dequant(W)^T")
            return time_config_graph(lambda i: gemm_wna16(x, weights[i], cfg), len(weights))
        best, best_t, times = fastest(cands, measure, progress)
        at = lambda want: next((round(t, 3) for c, t in zip(cands, times) if c == want and t < float("inf")), None)
        if record is not None:
            record += [{"layer": layer.key, "M": m, "config": c.to_dict(), "us": t if t < float("inf") else None,
                        "previous": c == prev} for c, t in zip(cands, times)]
        if best is not None:
            results[cache_key(gpu, layer, m_bucket(m))] = {"config": best.to_dict(), "us": round(best_t, 3),
                                                          "heuristic_us": at(heuristic(layer, m)),
                                                          "previous_us": at(prev)}
    return results
