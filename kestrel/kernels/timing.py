"""CUDA-graph timing of few-µs kernels: the one implementation the tuner (tuning.py) and the benches use."""
from __future__ import annotations

import torch


def cold_copies(nbytes: int, min_bytes: int = 256 << 20, most: int = 8) -> int:
    """How many distinct copies of an `nbytes` weight a timing rotates over so the L2 (50-60 MB) holds none."""
    return max(1, min(most, -(-min_bytes // max(1, nbytes))))


def graph_time_us(fns, calls: int = 20, replays: int = 20, warmup: int = 1) -> float:
    """Median µs per call of a CUDA graph of `calls` calls rotating over fns.

    fns are usually the same op on distinct weight copies, so the L2 stays cold; one graph hides the launch gaps
    that decode (graph mode) never sees. Each fn runs once eagerly on a side stream first (compiles, allocates
    outside the capture); `warmup` replays before the `replays` timed ones."""
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(st)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fns[i % len(fns)]()
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(replays):
        s.record(); g.replay(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    del g
    return sorted(ts)[len(ts) // 2] * 1e3 / calls
