"""Triton paged attention: KV-cache writes, varlen prefill and split-KV decode (both with sliding windows)."""
from kestrel.kernels.attention.decode import default_num_splits, paged_decode_attention
from kestrel.kernels.attention.prefill import paged_prefill_attention
from kestrel.kernels.attention.store_kvcache import store_kvcache

__all__ = ["store_kvcache", "paged_prefill_attention", "paged_decode_attention", "default_num_splits"]
