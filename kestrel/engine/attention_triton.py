"""Engine adapter: the `AttentionBackend` interface (kestrel/engine/attention.py) on the Triton paged kernels.

The runner's `AttentionMetadata` is translated once per step (the first layer's call) into the kernels'
tensors: decode rows go to the split-KV decode kernel, prefill chunks to the varlen prefill kernel. The
KV caches are the base class's tensors, so block accounting is unchanged.
"""
from __future__ import annotations

import torch

from kestrel.kernels.attention import default_num_splits, paged_decode_attention, paged_prefill_attention, store_kvcache

from .attention import AttentionBackend, AttentionMetadata, to_device


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        dev = self.device  # (a group may have no layers: a model without full-attention layers)
        self.num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        self.window = int(self.sliding_window or 0)
        self._meta = None  # the step whose translation is cached (a strong ref: ids get reused)
        self._dec = self._pre = None

    def _translate(self, meta: AttentionMetadata, device) -> None:
        d = meta.num_decode
        self._dec = None
        if d:
            bt = meta.decode_block_tables
            seq_lens = meta.decode_seq_lens.to(device=bt.device, dtype=torch.int32)  # the kernel's window masks
            splits = default_num_splits(d, self.num_kv_heads, bt.shape[1] * self.block_size, num_sms=self.num_sms) \
                if self.num_sms > 1 else 1
            self._dec = (bt.to(torch.int32).contiguous(), seq_lens, splits)
        self._pre = None
        if meta.prefills:
            nb = max(p.block_table.numel() for p in meta.prefills)
            tables = torch.zeros(len(meta.prefills), nb, dtype=torch.int32, device=device)
            for i, p in enumerate(meta.prefills):
                tables[i, :p.block_table.numel()] = p.block_table
            lens = [p.end - p.start for p in meta.prefills]
            cu = to_device(torch.tensor([0] + lens, dtype=torch.int32).cumsum(0), torch.int32, device)
            seq_lens = to_device([p.context_len for p in meta.prefills], torch.int32, device)
            self._pre = (meta.prefills[0].start, tables, cu, seq_lens, max(lens))
        self._meta = meta

    def forward(self, layer, q, k, v, meta: AttentionMetadata):
        if meta is not self._meta:
            self._translate(meta, q.device)
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        store_kvcache(k, v, kc, vc, meta.slot_mapping)
        out = torch.empty_like(q)
        if self._dec is not None:
            bt, seq_lens, splits = self._dec
            d = meta.num_decode
            paged_decode_attention(q[:d], kc, vc, bt, seq_lens, self.scale, window=self.window,
                                   num_splits=splits, out=out[:d])
        if self._pre is not None:
            start, tables, cu, seq_lens, max_q = self._pre
            paged_prefill_attention(q[start:], kc, vc, tables, cu, seq_lens, self.scale, max_q_len=max_q,
                                    window=self.window, out=out[start:])
        return out.view(q.shape[0], -1)
