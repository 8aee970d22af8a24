"""Timing helpers shared by the GPU benches (run as `python bench/<name>.py`, so this imports as `gpu_timing`)."""
from __future__ import annotations

import torch


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
    """Median µs per call: `reps` calls rotating over fns (distinct weight copies, so L2 stays cold), captured in
    one CUDA graph to hide launch gaps, 20 replays."""
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(st)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fns[i % len(fns)]()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(20):
        s.record(); g.replay(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    del g
    return sorted(ts)[len(ts) // 2] * 1e3 / reps
