"""The verify forward of speculative decoding at fixed shapes, replayed from CUDA graphs.

A verification step scores, for each decoding request, its last token plus k draft tokens: a (1 + k)-token chunk on
top of its cached context. For a small model that forward is hundreds of short kernels, so run eagerly it costs
far more in launches than plain decode does from its graphs (kestrel/engine/cuda_graphs.py) and eats the gain.
Here the chunk of every request is padded to K + 1 tokens and the batch to a bucket size B, and one graph per
(B, K) is captured. Padding never touches real data:
  - a request's padding tokens (k < K) get cache slot -1 (not stored); the attention kernel places query j at
    position seq_len - (K + 1) + j, so with seq_len = context + K + 1 the real queries sit at their true
    positions and see only real keys (causal); padding queries read some keys that were never written (finite
    values, rows discarded);
  - padding rows (beyond the real batch) get seq_len 0 (empty attention) and slots -1.
`pack_verify_inputs` builds those host tensors (pure, testable on the CPU); `VerifyGraphs` owns the static
buffers and graphs and, on a CPU (tests), runs the same padded step without capture, its attention in torch
(PagedChunkCtx).
"""
from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from kestrel.engine.prefill_graphs import ChunkGraphBuffers, PagedChunkCtx


def default_k_buckets(k_max: int) -> list[int]:
    # a verify of K+1 tokens per row costs ~ the same as K'+1 on a GPU (launch-bound); few buckets keep capture short
    # (6 for deeper drafts: session 3 measured K=4 at only +0.10 ms over K=0, so k 6-8 may pay)
    return sorted({k for k in (1, 2, 4, 6) if k < k_max} | {k_max})


def pad_rows(lists, width: int, fill: int = 0):
    """Ragged int lists -> ([len(lists), width] int64 array padded with `fill`, lengths [len(lists)]): one flat
    fill through a mask, no per-row array writes."""
    lens = np.fromiter(map(len, lists), np.int64, len(lists))
    out = np.full((len(lists), width), fill, np.int64)
    if lens.size and lens.max() > 0:
        out[np.arange(width)[None, :] < lens[:, None]] = np.fromiter(chain.from_iterable(lists), np.int64,
                                                                     int(lens.sum()))
    return out, lens


def pack_verify_inputs(rows, K: int, bs: int, block_size: int):
    """rows: [(last_token, drafts list (len <= K), context_len = tokens already cached, block_table list)].
    Returns host tensors for a (bs, K) step: input_ids, positions, slot_mapping [bs*(K+1)] int64,
    seq_lens [bs] int32 and block_tables [len(rows), longest table] int32 (rows past len(rows) are padding).
    This runs every step: lists for a few rows, a few numpy ops over the batch beyond (per-row work there would
    cost more than the graph replay)."""
    n, S = len(rows), K + 1
    if n > bs:
        raise ValueError(f"{n} rows do not fit a verify batch of {bs}")
    if n <= 16:
        return _pack_lists(rows, K, bs, block_size)
    last, drafts, ctx, tables = zip(*rows)
    d, k = pad_rows(drafts, K)
    if n and k.max() > K:
        raise ValueError(f"{int(k.max())} draft tokens exceed the verify shape K={K}")
    bt, _ = pad_rows(tables, max([len(t) for t in tables] + [1]))
    ctx = np.fromiter(ctx, np.int64, n)
    ids = np.zeros((bs, S), np.int64)
    ids[:n, 0] = np.fromiter(last, np.int64, n)
    ids[:n, 1:] = d
    j = np.arange(S)[None, :]
    real = j <= k[:, None]
    p = ctx[:, None] + np.minimum(j, k[:, None])  # padding tokens: any valid rope position (the last real one)
    pos = np.zeros((bs, S), np.int64)
    pos[:n] = p
    slots = np.full((bs, S), -1, np.int64)
    slots[:n] = np.where(real, np.take_along_axis(bt, p // block_size, 1) * block_size + p % block_size, -1)
    seq_lens = np.zeros(bs, np.int32)
    seq_lens[:n] = ctx + S  # query j then sits at position ctx + j
    return (torch.from_numpy(ids.ravel()), torch.from_numpy(pos.ravel()), torch.from_numpy(slots.ravel()),
            torch.from_numpy(seq_lens), torch.from_numpy(bt.astype(np.int32)))


def _pack_lists(rows, K: int, bs: int, block_size: int):
    """pack_verify_inputs for a few rows: plain lists beat numpy's fixed per-op cost there."""
    n, S = len(rows), K + 1
    pad = (bs - n) * S
    ids, pos, slots, seq_lens, tables = [], [], [], [], []
    nb = max([len(r[3]) for r in rows] + [1])
    for last, drafts, ctx, table in rows:
        k = len(drafts)
        if k > K:
            raise ValueError(f"{k} draft tokens exceed the verify shape K={K}")
        ids += [last, *drafts] + [0] * (K - k)
        p = range(ctx, ctx + k + 1)
        pos += [*p] + [ctx + k] * (K - k)  # padding tokens: any valid rope position
        slots += [table[q // block_size] * block_size + q % block_size for q in p] + [-1] * (K - k)
        seq_lens.append(ctx + S)  # query j then sits at position ctx + j
        tables.append(list(table) + [0] * (nb - len(table)))
    ids += [0] * pad
    pos += [0] * pad
    slots += [-1] * pad
    seq_lens += [0] * (bs - n)
    return (torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long),
            torch.tensor(slots, dtype=torch.long), torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(tables, dtype=torch.int32).view(n, nb))


class VerifyGraphs(ChunkGraphBuffers):
    """Verify forwards for (batch bucket, K bucket) shapes. `run(rows)` -> (logits [n, K+1, V], argmax [n, K+1],
    hidden [n, K+1, H]), views of static outputs: consume (or copy) them before the next run.

    capture=False (or a CPU cache) runs the padded step eagerly: the same metadata and kernels, no graph."""

    def __init__(self, model, k_caches, v_caches, batch_sizes: list[int], k_sizes: list[int], max_blocks_per_seq: int,
                 sliding_window: int | None = None, capture: bool = True):
        self.batch_sizes, self.k_sizes = sorted(batch_sizes), sorted(k_sizes)
        B = self.batch_sizes[-1]
        super().__init__(model, k_caches, v_caches, B, self.k_sizes[-1] + 1, max_blocks_per_seq, sliding_window,
                         capture)  # graphs / outputs keyed by (batch bucket, K bucket)
        self.cu_q = {K: (torch.arange(B + 1, dtype=torch.int32) * (K + 1)).to(self.dev) for K in self.k_sizes}

    def _step(self, bs: int, K: int):
        T = bs * (K + 1)
        ctx = PagedChunkCtx(self.k_caches, self.v_caches, self.window, self.scale, self.slot_mapping[:T],
                            self.block_tables[:bs], self.cu_q[K][:bs + 1], self.seq_lens[:bs], K + 1)
        hidden = self.model(self.input_ids[:T], self.positions[:T], ctx)
        logits = self.model.compute_logits(hidden)
        return logits, logits.argmax(-1), hidden

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_graphs:
            return
        self.slot_mapping.fill_(-1)  # padding state: nothing stored, nothing attended
        self.seq_lens.zero_()
        graphs, outputs, self.pool = capture_graphs(self._step, self.batch_sizes, self.k_sizes, self.pool)
        self.graphs.update(graphs)
        self.outputs.update(outputs)

    def shape_for(self, n: int, k: int) -> tuple[int, int] | None:
        """Smallest captured (batch, K) holding n rows of up to k drafts; None if none does."""
        bs = next((b for b in self.batch_sizes if b >= n), None)
        K = next((x for x in self.k_sizes if x >= k), None)
        return None if bs is None or K is None else (bs, K)

    @torch.inference_mode()
    def run(self, rows, K: int | None = None):
        n = len(rows)
        shape = self.shape_for(n, max([len(r[1]) for r in rows] + [K or 0]))
        if shape is None:
            raise ValueError("verify batch exceeds the captured shapes")
        bs, K = shape
        ids, pos, slots, seq_lens, bt = pack_verify_inputs(rows, K, bs, self.block_size)
        T, nb = bs * (K + 1), bt.shape[1]
        if nb > self.width:
            raise ValueError(f"block table of {nb} blocks exceeds the captured {self.width}")
        self.input_ids[:T].copy_(ids, non_blocking=True)
        self.positions[:T].copy_(pos, non_blocking=True)
        self.slot_mapping[:T].copy_(slots, non_blocking=True)
        self.seq_lens[:bs].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n, :nb].copy_(bt, non_blocking=True)
        if self.use_graphs:
            self.graphs[(bs, K)].replay()
            logits, top, hidden = self.outputs[(bs, K)]
        else:
            logits, top, hidden = self._step(bs, K)
        S = K + 1
        return (logits.view(bs, S, -1)[:n], top.view(bs, S)[:n], hidden.view(bs, S, -1)[:n])


def capture_graphs(step, batch_sizes, ks, pool):
    """One CUDA graph of step(bs, K) per (batch, K), warmed up on a side stream first (Triton JIT, cuBLAS handles
    stay outside the graph). Largest first, so the smaller graphs reuse its memory pool.
    Returns ({(bs, K): graph}, {(bs, K): the step's output tensors}, pool)."""
    graphs, outputs = {}, {}
    for bs, K in sorted(((b, k) for b in batch_sizes for k in ks), key=lambda s: -s[0] * (s[1] + 1)):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step(bs, K)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            outputs[(bs, K)] = step(bs, K)
        pool = g.pool() if pool is None else pool
        graphs[(bs, K)] = g
    torch.cuda.synchronize()
    return graphs, outputs, pool
