"""ngram_draft_device as one Triton program per row (CUDA): the same lookup in one launch instead of ~50.

Why: inside the overlapped loop's graph the tensor-op version (pads, gathers, compares over the whole [B, Lm]
history for n = 1..3) is ~50 small kernels per step; with a 135M target every launch in the graph costs ~1.5-2 µs
(bench/spec_verify_profile.py, session 3 R1: ~100 extra launches per speculative step).
Semantics are exactly ngram_draft_device's (tests compare the two): for n = n_min..n_max (a longer match
overrides) the latest end e in [n, L-1] with hist[e-n : e] == hist[L-n : L]; drafts hist[e + j % (L - e)], or the
last token repeated when nothing matched.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ngram_kernel(hist_ptr, len_ptr, d_ptr, has_ptr, n_ptr, excl_ptr, stride_h, K, N_MIN: tl.constexpr,
                  N_MAX: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, EXCL: tl.constexpr):
    b = tl.program_id(0)
    row = hist_ptr + b * stride_h
    L = tl.load(len_ptr + b)
    if EXCL:
        x = tl.load(excl_ptr + b)
    offs = tl.arange(0, BLOCK)
    best = tl.full([], -1, tl.int64)
    best_n = tl.full([], 0, tl.int64)
    for n in tl.static_range(N_MIN, N_MAX + 1):
        e_n = tl.full([], -1, tl.int64)
        if L - 1 >= n:
            for e0 in range(0, L, BLOCK):
                e = e0 + offs
                ok = (e >= n) & (e <= L - 1)
                if EXCL:  # the continuation's first token must differ from x
                    ok = ok & (tl.load(row + e, mask=ok, other=-1) != x)
                for i in tl.static_range(n):
                    suffix = tl.load(row + L - n + i)
                    tok = tl.load(row + e - n + i, mask=ok, other=-1)
                    ok = ok & (tok == suffix)
                e_n = tl.maximum(e_n, tl.max(tl.where(ok, e.to(tl.int64), -1), 0))
        best = tl.where(e_n >= 0, e_n, best)
        best_n = tl.where(e_n >= 0, n, best_n)
    has = best >= 0
    start = tl.maximum(best, 0)
    period = tl.maximum(L - start, 1)
    j = tl.arange(0, BLOCK_K)
    idx = tl.where(has, start + j % period, L - 1)
    d = tl.load(row + idx, mask=j < K, other=0)
    tl.store(d_ptr + b * K + j, d, mask=j < K)
    tl.store(has_ptr + b, has)
    tl.store(n_ptr + b, best_n)


def ngram_draft_triton(hist: torch.Tensor, length: torch.Tensor, k: int, n_max: int = 3, n_min: int = 1,
                       exclude: torch.Tensor | None = None):
    """-> drafts [B, k] (hist's dtype), has [B] bool, matched n [B] (0 = none); see ngram_draft_device."""
    B = hist.shape[0]
    if hist.stride(1) != 1:
        hist = hist.contiguous()
    d = torch.empty(B, k, dtype=hist.dtype, device=hist.device)
    has = torch.empty(B, dtype=torch.bool, device=hist.device)
    n = torch.empty(B, dtype=torch.long, device=hist.device)
    excl = exclude.to(hist.dtype).contiguous() if exclude is not None else n
    _ngram_kernel[(B,)](hist, length.to(torch.long).contiguous(), d, has, n, excl, hist.stride(0), k, N_MIN=n_min,
                        N_MAX=n_max, BLOCK=1024, BLOCK_K=max(2, triton.next_power_of_2(k)), EXCL=exclude is not None)
    return d, has, n
