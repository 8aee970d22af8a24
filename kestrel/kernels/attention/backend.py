"""Paged attention over per-layer KV caches with the Triton kernels: the GPU half of the engine's attention
backend (the engine-facing adapter lives in kestrel/engine/attention_triton.py).

A step is described once by `PagedAttentionMetadata` (built by the runner, or written in place into static
buffers for CUDA-graph replay); every layer then calls `attention(layer, q, k, v)`, which stores the new K/V
into the layer's cache and attends. Decode-only steps use the split-KV decode kernel; anything with a prefill
chunk (mixed batches included: a decode token is a 1-token chunk) uses the varlen prefill kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .decode import default_num_splits, paged_decode_attention
from .prefill import paged_prefill_attention
from .store_kvcache import store_kvcache


@dataclass
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token (-1 = padding, not stored)
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, tokens in the cache for each sequence after this step
    is_decode: bool  # every sequence has exactly one new token
    cu_seqlens_q: torch.Tensor | None = None  # [B+1] int32 (prefill)
    max_q_len: int = 1
    num_splits: int = 1  # decode split-KV factor


class PagedAttention:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device, scale: float,
                 sliding_windows: list[int | None] | None = None):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size, self.num_kv_heads, self.head_dim, self.scale = block_size, num_kv_heads, head_dim, scale
        self.windows = [int(w or 0) for w in (sliding_windows or [None] * num_layers)]
        self.meta: PagedAttentionMetadata | None = None
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count \
            if torch.device(device).type == "cuda" else 1

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def decode_splits(self, num_seqs: int, max_seq_len: int) -> int:
        return default_num_splits(num_seqs, self.num_kv_heads, max_seq_len, num_sms=self.num_sms) \
            if self.num_sms > 1 else 1

    def set_metadata(self, meta: PagedAttentionMetadata) -> None:
        self.meta = meta

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq * D]."""
        m = self.meta
        kc, vc = self.k_caches[layer], self.v_caches[layer]
        store_kvcache(k, v, kc, vc, m.slot_mapping)
        if m.is_decode:
            out = paged_decode_attention(q, kc, vc, m.block_tables, m.seq_lens, self.scale,
                                         window=self.windows[layer], num_splits=m.num_splits)
        else:
            out = paged_prefill_attention(q, kc, vc, m.block_tables, m.cu_seqlens_q, m.seq_lens, self.scale,
                                          max_q_len=m.max_q_len, window=self.windows[layer])
        return out.view(q.shape[0], -1)
