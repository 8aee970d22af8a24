"""CUDA-graph capture of decode steps, one graph per batch-size bucket.

A decode step of a small batch is hundreds of short kernels whose launch cost exceeds their run time; replaying
a captured graph removes the CPU launch path. Each bucket's graph reads its inputs from static buffers (token
ids, positions, cache slots, block tables, context lengths), so a step copies the real batch into them and
replays the smallest bucket that fits; padding rows get slot -1 (their K/V are not stored) and context length 0
(their attention is empty), so they never touch real sequences. The attention inside the graph is the Triton
paged decode kernel over the engine's caches; it reads lengths on the device only, so it is capture-safe.
"""
from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm

from kestrel.kernels.attention import default_num_splits, paged_decode_attention, store_kvcache


def default_batch_buckets(max_num_seqs: int) -> list[int]:
    # dense where batches are small, coarser above: each bucket costs a capture at start-up, and decode of a
    # padded row is cheap (its attention is empty; the weight reads dominate the GEMMs)
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256] + list(range(320, 1025, 64))
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


class _GraphDecodeCtx:
    """The model's attention context inside a captured decode step."""

    def __init__(self, k_caches, v_caches, windows, scale, slot_mapping, block_tables, seq_lens, num_splits):
        self.k_caches, self.v_caches, self.windows, self.scale = k_caches, v_caches, windows, scale
        self.slot_mapping, self.block_tables, self.seq_lens, self.num_splits = \
            slot_mapping, block_tables, seq_lens, num_splits

    def attention(self, layer, q, k, v):
        kc, vc = self.k_caches[layer], self.v_caches[layer]
        store_kvcache(k, v, kc, vc, self.slot_mapping)
        out = paged_decode_attention(q, kc, vc, self.block_tables, self.seq_lens, self.scale,
                                     window=self.windows[layer], num_splits=self.num_splits)
        return out.view(q.shape[0], -1)


class DecodeCudaGraphs:
    """Captures `model.compute_logits(model(ids, positions, ctx))` for each batch bucket.

    model: LlamaForCausalLM-like (forward(input_ids, positions, ctx) -> hidden; compute_logits(hidden)).
    k_caches/v_caches: per-layer [num_blocks, block_size, num_kv_heads, head_dim] tensors (the engine's).
    """

    def __init__(self, model, k_caches, v_caches, max_num_seqs: int, max_blocks_per_seq: int,
                 sliding_window: int | None = None, batch_sizes: list[int] | None = None,
                 scale: float | None = None):
        dev = k_caches[0].device
        if dev.type != "cuda":
            raise ValueError("CUDA graphs need the model and KV cache on a CUDA device")
        self.model, self.k_caches, self.v_caches = model, k_caches, v_caches
        _, self.block_size, self.num_kv_heads, head_dim = k_caches[0].shape
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.windows = [int(sliding_window or 0)] * len(k_caches)
        self.batch_sizes = sorted(batch_sizes or default_batch_buckets(max_num_seqs))
        n = self.batch_sizes[-1]
        self.max_blocks = max_blocks_per_seq
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.num_sms = torch.cuda.get_device_properties(dev).multi_processor_count

    def _step(self, bs: int) -> torch.Tensor:
        splits = default_num_splits(bs, self.num_kv_heads, self.max_blocks * self.block_size, num_sms=self.num_sms)
        ctx = _GraphDecodeCtx(self.k_caches, self.v_caches, self.windows, self.scale, self.slot_mapping[:bs],
                              self.block_tables[:bs], self.seq_lens[:bs], splits)
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], ctx)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> None:
        # padding state: nothing stored, nothing attended
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        for bs in tqdm(sorted(self.batch_sizes, reverse=True), desc="Capturing decode CUDA graphs",
                       disable=not progress):  # largest first, so smaller graphs reuse its memory pool
            side = torch.cuda.Stream()  # warm-up outside the graph (Triton JIT, cuBLAS handles), on a side stream
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._step(bs)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.outputs[bs] = self._step(bs)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[bs] = g
        torch.cuda.synchronize()

    def bucket(self, n: int) -> int | None:
        for bs in self.batch_sizes:
            if bs >= n:
                return bs
        return None

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """One decode step for n sequences (tensors of n rows; block_tables may be narrower than the capture).
        Returns logits [n, vocab] (a view of the graph's output: consume it before the next replay)."""
        n = input_ids.shape[0]
        bs = self.bucket(n)
        if bs is None:
            raise ValueError(f"decode batch of {n} exceeds the largest captured graph ({self.batch_sizes[-1]})")
        if block_tables.shape[1] > self.max_blocks:
            raise ValueError(f"block table of {block_tables.shape[1]} blocks exceeds the captured {self.max_blocks}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n, :block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        if n < bs:
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].zero_()
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

    def run_seqs(self, last_tokens: list[int] | torch.Tensor, positions, block_tables) -> torch.Tensor:
        """`run` from host data (the engine's per-sequence state): positions [n] and block tables, as arrays
        (numpy [n] int64 / [n, width] zero-padded, as ModelRunner.prepare builds them) or lists; one
        host-to-device copy per tensor, no per-row host work."""
        if not isinstance(block_tables, np.ndarray):
            from .attention import block_table_array
            block_tables = block_table_array(block_tables)
        pos_np = np.asarray(positions, np.int64)
        n = len(pos_np)
        slots_np = block_tables[np.arange(n), pos_np // self.block_size] * self.block_size + pos_np % self.block_size
        pos, slots = torch.from_numpy(pos_np), torch.from_numpy(slots_np)
        bt = torch.from_numpy(block_tables.astype(np.int32))
        dev = self.input_ids.device
        # pinned copies: a pageable one would wait for the step in flight (async scheduling queues behind it);
        # last_tokens may already be a device tensor (async scheduling gathers the previous step's ids there)
        h2d = lambda t: t.pin_memory().to(dev, non_blocking=True)
        ids = last_tokens.to(dev) if isinstance(last_tokens, torch.Tensor) else h2d(torch.tensor(last_tokens))
        return self.run(ids, h2d(pos), h2d(slots), h2d(bt), h2d((pos + 1).to(torch.int32)))
