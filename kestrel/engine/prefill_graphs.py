"""CUDA graphs of one sequence's short prefill chunk, one graph per padded token-count bucket.

Why: a ~40-token chat prompt's eager prefill of SmolLM2-135M is ~378 kernel launches, ~20 ms of host time for
0.9 ms of device work (bench/prefill_ttft.py, session 10 R3): that is the whole time to first token, in no-spec
and speculative modes alike. Here a chunk of n tokens (on top of `start` cached tokens: 0 for a fresh prompt) is
padded to the smallest bucket S >= n and replayed from the graph captured at S. Padding never touches real data
(the scheme of kestrel/spec/verify_graph.py):
  - padding tokens get cache slot -1 (their K/V are not stored) and the last real position (a valid rope angle);
  - the prefill attention kernel places query j at position seq_len - S + j, so seq_len = start + S puts the real
    queries at their true positions, and causality keeps them off every key after them (padding keys included);
  - only the last real row (a static row index) leaves the graph: its hidden state and its logits.
On a CPU (tests) the same padded step runs without capture, its attention in torch (kernels/attention/torch_paged.py).
"""
from __future__ import annotations

import os

import torch

from kestrel.kernels.attention import paged_prefill_attention, store_kvcache
from kestrel.kernels.attention.torch_paged import torch_paged_prefill_attention, torch_store_kvcache

DEFAULT_BUCKETS = (16, 32, 48, 64, 96, 128)


def wanted() -> bool:
    """On by default wherever the decode graphs are captured (KESTREL_PREFILL_GRAPHS=0: the eager prefill). GPU
    check, H100 session 16 (bench/results/spec_decode.md): all six buckets pass the capture-time self-check (logits,
    hidden state 0 difference, KV ok), first tokens identical 8/8, time to first token 1.35 ms vs 12.0 eager."""
    return os.environ.get("KESTREL_PREFILL_GRAPHS", "1") == "1"


class PagedChunkCtx:
    """The model's attention context inside a captured chunk step (a prefill chunk here, a verify chunk in
    kestrel/spec/verify_graph.py): store the chunk's K/V, then varlen paged attention (tree_mask: [T] int64
    ancestor bits of a draft-tree verify, kestrel/spec/tree.py, or None)."""

    def __init__(self, k_caches, v_caches, window, scale, slot_mapping, block_tables, cu_q, seq_lens, max_q,
                 tree_mask=None):
        self.k_caches, self.v_caches, self.window, self.scale = k_caches, v_caches, window, scale
        self.tree_mask = tree_mask
        self.slot_mapping, self.block_tables, self.cu_q, self.seq_lens, self.max_q = \
            slot_mapping, block_tables, cu_q, seq_lens, max_q

    def attention(self, layer, q, k, v):
        kc, vc = self.k_caches[layer], self.v_caches[layer]
        # a CPU engine attends in torch, as its TorchAttentionBackend (the interpreted kernels are ~50x slower)
        store, attend = (store_kvcache, paged_prefill_attention) if q.is_cuda else \
            (torch_store_kvcache, torch_paged_prefill_attention)
        store(k, v, kc, vc, self.slot_mapping)
        out = attend(q, kc, vc, self.block_tables, self.cu_q, self.seq_lens, self.scale, max_q_len=self.max_q,
                     window=self.window, tree_mask=self.tree_mask)
        return out.view(q.shape[0], -1)


class ChunkGraphBuffers:
    """What the captured chunk steps share (PrefillCudaGraphs here, kestrel/spec/verify_graph.VerifyGraphs): the
    model, its paged caches and their geometry, and the static inputs a replay reads for up to `seqs` sequences of
    up to S tokens each (padding slots -1: nothing stored), plus the graphs, their outputs and one memory pool."""

    def __init__(self, model, k_caches, v_caches, seqs: int, S: int, max_blocks_per_seq: int,
                 sliding_window: int | None, capture: bool):
        self.model, self.k_caches, self.v_caches = model, k_caches, v_caches
        self.dev = dev = k_caches[0].device
        self.use_graphs = capture and dev.type == "cuda"
        _, self.block_size, _, head_dim = k_caches[0].shape
        self.scale = head_dim ** -0.5
        self.window = int(sliding_window or 0)
        # padding queries look up to S - 1 positions past a sequence's end: room for them in the block table
        self.width = max_blocks_per_seq + -(-S // self.block_size) + 1
        self.input_ids = torch.zeros(seqs * S, dtype=torch.long, device=dev)
        self.positions = torch.zeros(seqs * S, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((seqs * S,), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(seqs, self.width, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(seqs, dtype=torch.int32, device=dev)
        self.graphs: dict = {}
        self.outputs: dict = {}
        self.pool = None


class PrefillCudaGraphs(ChunkGraphBuffers):
    """`run(token_ids, start, block_table)` -> (logits [1, V], hidden [1, H]) of the chunk's last token: views of
    static outputs (consume or copy them before the next run). `fits(n)`: a bucket holds an n-token chunk."""

    def __init__(self, model, k_caches, v_caches, max_blocks_per_seq: int, sliding_window: int | None = None,
                 buckets=DEFAULT_BUCKETS, capture: bool = True):
        self.buckets = sorted(buckets)
        super().__init__(model, k_caches, v_caches, 1, self.buckets[-1], max_blocks_per_seq, sliding_window, capture)
        dev = self.dev
        self.last_row = torch.zeros(1, dtype=torch.long, device=dev)
        self.cu_q = {b: torch.tensor([0, b], dtype=torch.int32, device=dev) for b in self.buckets}
        self.num_runs = 0  # chunks served (tests and benches check the path was taken)
        self.check: dict = {}  # prefill_graph_check.check_prefill_graphs's report per bucket
        self.capture_errors: dict = {}  # bucket -> why its capture failed (dropped)

    def _step(self, S: int):
        ctx = PagedChunkCtx(self.k_caches, self.v_caches, self.window, self.scale, self.slot_mapping[:S],
                            self.block_tables, self.cu_q[S], self.seq_lens, S)
        hidden = self.model(self.input_ids[:S], self.positions[:S], ctx)
        h = hidden.index_select(0, self.last_row)
        return self.model.compute_logits(h), h

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.use_graphs:
            return
        self.slot_mapping.fill_(-1)  # capture state: nothing stored, nothing attended
        self.seq_lens.zero_()
        for S in sorted(self.buckets, reverse=True):  # largest first: the smaller graphs reuse its pool
            try:
                self._capture(S)
            except Exception as e:  # that bucket's chunks go eager (or to a larger bucket): logged, not fatal
                self.capture_errors[S] = f"{type(e).__name__}: {e}"
        torch.cuda.synchronize()
        if self.capture_errors:
            import logging
            logging.getLogger(__name__).warning("prefill graphs: capture failed for bucket(s) %s, dropped: %s",
                                                sorted(self.capture_errors), self.capture_errors)
            self.drop(list(self.capture_errors))

    def _capture(self, S: int) -> None:
        side = torch.cuda.Stream()  # warm-up outside the graph (Triton JIT, cuBLAS handles)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(S)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            self.outputs[S] = self._step(S)
        self.pool = g.pool() if self.pool is None else self.pool
        self.graphs[S] = g

    def drop(self, buckets) -> None:
        """Stop serving these buckets (a failed capture or self-check): their chunks take the next larger bucket
        left, or the eager prefill when none is (fits() is False once no bucket is left)."""
        for S in buckets:
            self.graphs.pop(S, None)
            self.outputs.pop(S, None)
        self.buckets = [b for b in self.buckets if b not in set(buckets)]

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def fits(self, n: int, table_len: int) -> bool:
        return bool(self.buckets) and 0 < n <= self.buckets[-1] and table_len <= self.width

    @torch.inference_mode()
    def run(self, token_ids, start: int, block_table, pad_token: int = 0):
        """token_ids: the chunk's n tokens (positions start .. start + n - 1, their blocks in block_table)."""
        n = len(token_ids)
        S = self.bucket(n)
        if S is None or len(block_table) > self.width:
            raise ValueError(f"prefill chunk of {n} tokens / {len(block_table)} blocks exceeds the captured shapes")
        bs = self.block_size
        pos = list(range(start, start + n))
        slots = [block_table[p // bs] * bs + p % bs for p in pos] + [-1] * (S - n)
        host = torch.tensor([*token_ids, *[pad_token] * (S - n),  # ids
                             *pos, *[start + n - 1] * (S - n),  # positions (padding: the last real one)
                             *slots, start + S, n - 1], dtype=torch.long)  # seq_len: query j at start + j
        bt = torch.zeros(self.width, dtype=torch.int32)
        bt[:len(block_table)] = torch.tensor(block_table, dtype=torch.int32)
        if self.dev.type == "cuda":  # pinned: a pageable copy would wait for the step in flight
            host, bt = host.pin_memory(), bt.pin_memory()
        host = host.to(self.dev, non_blocking=True)  # one copy for all the small inputs
        self.input_ids[:S].copy_(host[:S])
        self.positions[:S].copy_(host[S:2 * S])
        self.slot_mapping[:S].copy_(host[2 * S:3 * S])
        self.seq_lens.copy_(host[3 * S:3 * S + 1])
        self.last_row.copy_(host[3 * S + 1:])
        self.block_tables[0].copy_(bt, non_blocking=True)
        self.num_runs += 1
        if self.use_graphs:
            self.graphs[S].replay()
            return self.outputs[S]
        return self._step(S)
