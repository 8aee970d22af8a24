"""Timing helpers shared by the GPU benches (run as `python bench/<name>.py`, so this imports as `gpu_timing`)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from kestrel.kernels.timing import graph_time_us


def copy_bandwidth(nbytes: int = 4 << 30) -> dict:
    """Device-to-device copy of `nbytes` (median of 10): the ceiling every memory-bound kernel is held against.
    rw_TBps counts bytes read + written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ts = []
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        s.record(); dst.copy_(src); e.record(); e.synchronize(); ts.append(s.elapsed_time(e) / 1e3)
    t = sorted(ts)[len(ts) // 2]
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "median_s": t, "rw_TBps": 2 * nbytes / t / 1e12}


def graph_us(fns, reps=20) -> float:
    """Median µs per call: `reps` calls rotating over fns (distinct weight copies, so L2 stays cold) in one CUDA
    graph, 20 replays after 3 warm-up ones."""
    return graph_time_us(fns, calls=reps, replays=20, warmup=3)


def weight_copies(qw, min_bytes: int = 200_000_000, most: int = 16) -> list:
    """qw plus distinct copies of its tensors, at least 2 and enough to pass min_bytes (at most `most`), so a
    CUDA graph rotating over them reads every weight from HBM rather than the 60 MB L2."""
    n = min(most, max(2, -(-min_bytes // qw.nbytes)))
    clone = lambda q: type(q)(**{**q.__dict__, "qweight": q.qweight.clone(), "scales": q.scales.clone(),
                                 "zeros": None if q.zeros is None else q.zeros.clone()})
    return [qw] + [clone(qw) for _ in range(n - 1)]


class ShapeWeights(NamedTuple):
    w: torch.Tensor       # the float weight (N, K)
    qw: object            # its quantization (kestrel.quant.QuantizedWeight)
    copies: list          # qw + distinct copies (weight_copies): what a cold-L2 timing rotates over
    deq: torch.Tensor     # dequantize(qw), the float32 reference weight


def shape_weights(spec, n: int, k: int, seed: int = 0, dtype=torch.bfloat16, device="cuda") -> ShapeWeights:
    """The per-shape set-up the sweeps share: a seeded N(0, 0.02) weight, quantized to `spec`, its L2-cold copies
    and the dequantized reference."""
    from kestrel.quant import dequantize, quantize
    torch.manual_seed(seed)
    w = torch.randn(n, k, device=device, dtype=dtype) * 0.02
    qw = quantize(w, spec)
    return ShapeWeights(w, qw, weight_copies(qw), dequantize(qw))
