"""Prompt lookup / n-gram drafter: find the latest earlier occurrence of the context's suffix and propose what
followed it. Free to run; strong on summarisation, code edits and repetitive text."""
from __future__ import annotations

import os

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from kestrel.spec.drafter import Draft, DraftInput, Drafter


def ngram_lookup(tokens: np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """Continuation (up to k tokens) of the most recent earlier match of the longest suffix n-gram, n_max..n_min."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        windows = sliding_window_view(tokens[: L - 1], n)  # starts 0..L-1-n: each has >= 1 following token
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            return _continue(tokens, int(hits[-1]) + n, k)
    return []


def _continue(tokens, start: int, k: int) -> list[int]:
    """Copy forward from `start`; a match near the end wraps onto the copied tokens (periodic text)."""
    out = list(tokens[start: start + k])
    period = len(tokens) - start
    while len(out) < k:
        out.append(out[len(out) - period] if len(out) >= period else int(tokens[start + len(out)]))
    return out


class NgramIndex:
    """ngram_lookup for a growing sequence at O(new tokens) per call: for each n, the latest position that
    followed each n-gram (rescanning the whole context every step costs ~50 us a request: at 64 requests, more
    than the verify forward on a GPU)."""

    def __init__(self, n_max: int, n_min: int):
        self.n_max, self.n_min = n_max, n_min
        self.seen: dict[int, dict[tuple, int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.done = 0  # positions e < done are indexed (n-grams ending right before token e)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        L = len(tokens)
        if L < self.done:  # not the sequence we indexed: start over
            self.__init__(self.n_max, self.n_min)
        for e in range(max(self.done, 1), L):  # n-grams with a following token (e < L)
            for n, d in self.seen.items():
                if e >= n:
                    d[tuple(tokens[e - n:e])] = e
        self.done = max(self.done, L)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            e = self.seen[n].get(tuple(tokens[L - n:]))
            if e is not None:
                return _continue(tokens, e, k)
        return []


class NgramDrafter(Drafter):
    def __init__(self, n_max: int = 3, n_min: int = 1, prior: float = 0.5, ema: float = 0.3):
        self.n_max, self.n_min = n_max, n_min
        self.prior, self.ema = prior, ema
        self.rate: dict[str, float] = {}  # per-request running per-token acceptance rate (the confidence)
        self.index: dict[str, NgramIndex] = {}

    def propose(self, inputs: list[DraftInput], k: int) -> Draft:
        toks, lens, conf = [], [], []  # lists, one tensor each at the end (per-row tensor writes cost more)
        for inp in inputs:
            idx = self.index.get(inp.request_id)
            if idx is None:
                idx = self.index[inp.request_id] = NgramIndex(self.n_max, self.n_min)
            cont = idx.lookup(inp.token_ids, k) if k else []
            n = len(cont)
            lens.append(n)
            toks.append(cont + [0] * (k - n))
            r = self.rate.get(inp.request_id, self.prior)  # new requests start at the drafter-wide rate
            conf.append([r] * n + [0.0] * (k - n))
            # drift back toward the prior, so a request whose drafts were skipped for low confidence gets retried
            self.rate[inp.request_id] = r + 0.1 * (self.prior - r)
        B = len(inputs)
        return Draft(torch.tensor(toks, dtype=torch.long).view(B, k), torch.tensor(lens, dtype=torch.long),
                     torch.tensor(conf, dtype=torch.float32).view(B, k), None)

    def observe(self, request_ids, num_proposed, num_accepted):
        for rid, m, a in zip(request_ids, num_proposed, num_accepted):
            if m == 0:
                continue
            # a accepted then (if a < m) one rejected: per-token acceptance observed in this step
            obs = a / (a + (1 if a < m else 0)) if a else 0.0
            r = self.rate.get(rid, self.prior)
            self.rate[rid] = (1 - self.ema) * r + self.ema * obs
            # slow drafter-wide estimate, the start for new requests; kept high enough to keep exploring
            self.prior = min(0.95, max(0.4, 0.95 * self.prior + 0.05 * obs))

    def release(self, request_id):
        self.rate.pop(request_id, None)
        self.index.pop(request_id, None)


def ngram_draft_device(hist: torch.Tensor, length: torch.Tensor, k: int, n_max: int = 3, n_min: int = 1,
                       return_n: bool = False, exclude: torch.Tensor | None = None):
    """NgramIndex.lookup for a batch of histories with tensor ops only (no host sync: runs inside a CUDA graph).

    hist [B, Lm] token ids, row b valid below length[b]. For each row: the latest end e (n <= e <= L-1) of an
    earlier occurrence of the row's longest suffix n-gram, n = n_max..n_min, then the continuation
    hist[e + j % (L - e)] (periodic copy, as _continue). Returns drafts [B, k] (rows without a match repeat their
    last token) and has [B] bool (and, return_n, the matched n-gram's length [B], 0 = none).
    exclude [B]: only matches whose continuation starts with another token count (a second candidate, for a draft
    tree's second n-gram branch: exclude = the first lookup's first draft).
    On CUDA the same lookup runs as one Triton kernel (ngram_kernel.py)."""
    if hist.is_cuda and os.environ.get("KESTREL_NGRAM_TRITON", "1") != "0":
        from kestrel.spec.ngram_kernel import ngram_draft_triton
        d, has, n = ngram_draft_triton(hist, length, k, n_max, n_min, exclude=exclude)
        return (d, has, n) if return_n else (d, has)
    B, Lm = hist.shape
    dev = hist.device
    e = torch.arange(Lm, device=dev)[None, :]
    L = length[:, None]
    best = torch.full((B,), -1, dtype=torch.long, device=dev)
    best_n = torch.zeros(B, dtype=torch.long, device=dev)
    for n in range(n_min, n_max + 1):  # ascending: a longer n-gram's match overrides
        ok = (e >= n) & (e <= L - 1) & (L - 1 >= n)
        if exclude is not None:  # the continuation's first token, hist[e], must differ
            ok = ok & (hist != exclude[:, None])
        for i in range(n):
            # token n - i before e (at e - n + i) against the suffix's token at L - n + i
            shifted = torch.nn.functional.pad(hist, (n - i, 0))[:, :Lm]
            ok = ok & (shifted == hist.gather(1, (L - n + i).clamp(min=0)))
        e_n = torch.where(ok, e, -1).amax(1)
        best = torch.where(e_n >= 0, e_n, best)
        best_n = torch.where(e_n >= 0, n, best_n)
    has = best >= 0
    start = best.clamp(min=0)[:, None]
    period = (L - start).clamp(min=1)
    j = torch.arange(k, device=dev)[None, :]
    idx = torch.where(has[:, None], start + j % period, L - 1)
    d = hist.gather(1, idx.clamp(0, Lm - 1))
    return (d, has, best_n) if return_n else (d, has)
