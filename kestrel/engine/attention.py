"""Attention over the paged KV cache, behind a small backend interface.

KV layout per layer (docs/CONTRACTS.md): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim].
The runner orders a step's sequences decodes-first and builds `AttentionMetadata` once per step; every layer
then calls `backend.forward(layer, q, k, v, meta)`, which writes k/v into their slots and attends.
`TorchAttentionBackend` is the CPU/PyTorch implementation; a Triton/GPU backend subclasses `AttentionBackend`
with the same metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # token range [start, end) of this sequence's new tokens in the flattened batch
    end: int
    context_len: int  # tokens of the sequence after this step (cached + new)
    block_table: torch.Tensor  # [num_blocks_of_seq] int64
    window: int | None = None  # sliding window of the layers this metadata serves
    _mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def mask(self) -> torch.Tensor | None:
        """[q_len, context_len] bool (True = attend); None = plain causal, no cached prefix. Built on first use:
        only the PyTorch backend reads it (the Triton kernels take lengths), so the GPU path never pays for it."""
        computed, w = self.context_len - (self.end - self.start), self.window
        if not (computed > 0 or (w is not None and self.context_len > w)):
            return None
        if self._mask is None:
            dev = self.block_table.device
            qpos = torch.arange(computed, self.context_len, device=dev)[:, None]
            kpos = torch.arange(self.context_len, device=dev)[None, :]
            mask = kpos <= qpos
            if w is not None:
                mask &= kpos > qpos - w
            self._mask = mask
        return self._mask


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    num_decode: int = 0  # the first num_decode tokens are single-token decodes, one per sequence
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks] int64
    decode_seq_lens: torch.Tensor | None = None  # [num_decode] int32: context length of each decode (incl. new token)
    prefills: list[PrefillChunk] = field(default_factory=list)
    block_size: int = 16
    window: int | None = None  # sliding window of the layers this metadata serves
    _decode_mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def decode_mask(self) -> torch.Tensor | None:
        """[num_decode, 1, 1, max_blocks * block_size] bool, built on first use from the lengths (the PyTorch
        backend's SDPA mask; the Triton backend reads decode_seq_lens and never builds it)."""
        if self._decode_mask is None and self.num_decode:
            lens = self.decode_seq_lens.to(torch.long)
            key_pos = torch.arange(self.decode_block_tables.shape[1] * self.block_size, device=lens.device)
            mask = key_pos[None, :] < lens[:, None]
            if self.window is not None:
                mask &= key_pos[None, :] > (lens[:, None] - 1 - self.window)
            self._decode_mask = mask[:, None, None, :]
        return self._decode_mask


class AttentionBackend:
    """Owns the KV cache tensors and computes attention for one layer of a flattened batch."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device, sliding_window: int | None = None):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sliding_window = sliding_window
        self.device = torch.device(device)
        self.scale = head_dim ** -0.5
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError


class TorchAttentionBackend(AttentionBackend):
    def forward(self, layer, q, k, v, meta):
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        flat_k = kc.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = vc.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        d = meta.num_decode
        if d:
            nb = meta.decode_block_tables.shape[1]
            # gather each sequence's blocks: [d, nb*bs, kvh, hd] -> [d, kvh, L, hd]
            # index_select copies whole blocks; ~3x faster than advanced indexing on the CPU
            flat_tables = meta.decode_block_tables.view(-1)
            kd = kc.index_select(0, flat_tables).view(d, nb * self.block_size, self.num_kv_heads, self.head_dim)
            vd = vc.index_select(0, flat_tables).view(d, nb * self.block_size, self.num_kv_heads, self.head_dim)
            o = F.scaled_dot_product_attention(q[:d].unsqueeze(2), kd.transpose(1, 2), vd.transpose(1, 2),
                                               attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=True)
            out[:d] = o.squeeze(2)
        for p in meta.prefills:
            qp = q[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, hd]
            if p.mask is None:  # whole prompt in this chunk: attend to the new k/v directly
                kp, vp = k[p.start:p.end], v[p.start:p.end]
            else:
                kp = kc.index_select(0, p.block_table).flatten(0, 1)[:p.context_len]
                vp = vc.index_select(0, p.block_table).flatten(0, 1)[:p.context_len]
            o = F.scaled_dot_product_attention(qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                                               attn_mask=p.mask, is_causal=p.mask is None, scale=self.scale,
                                               enable_gqa=True)
            out[p.start:p.end] = o[0].transpose(0, 1)
        return out.view(q.shape[0], -1)


def to_device(data, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list/tensor on `device`. CUDA: through pinned memory with non_blocking, because a plain `.to("cuda")`
    of pageable memory waits for every queued kernel (it would stall async scheduling, which queues the next step
    while the current one runs)."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda" or t.device.type != "cpu":  # already on a device: no host copy
        return t.to(device=device, dtype=dtype, non_blocking=True)
    return t.to(dtype).pin_memory().to(device, non_blocking=True)


def block_table_array(tables) -> np.ndarray:
    """Zero-padded [n, longest] int64 array of per-sequence block-id lists: one masked fill from the flattened
    ids instead of a tensor per row (a step of 256 decodes paid ~4 ms for those)."""
    n = len(tables)
    lens = np.fromiter(map(len, tables), np.int64, n)
    width = int(lens.max()) if n else 0
    out = np.zeros((n, width), np.int64)
    out[np.arange(width)[None, :] < lens[:, None]] = np.fromiter(chain.from_iterable(tables), np.int64, int(lens.sum()))
    return out


def build_metadata(decode_seqs, prefill_seqs, block_size: int, sliding_window: int | None,
                   device="cpu") -> tuple[AttentionMetadata, list[int]]:
    """decode_seqs: [(context_len, block_table)], prefill_seqs: [(num_computed, num_new, block_table)].
    Returns metadata and the flattened positions of the new tokens (decodes first). Host work is a few numpy
    ops over the batch; masks are left to the backend that needs them (AttentionMetadata.decode_mask)."""
    d = len(decode_seqs)
    meta = AttentionMetadata(slot_mapping=None, num_decode=d, block_size=block_size, window=sliding_window)
    pos_parts, slot_parts = [], []
    if d:
        ctx = np.fromiter((c for c, _ in decode_seqs), np.int64, d)
        tables = block_table_array([bt for _, bt in decode_seqs])
        pos = ctx - 1
        pos_parts.append(pos)
        slot_parts.append(tables[np.arange(d), pos // block_size] * block_size + pos % block_size)
        meta.decode_block_tables = to_device(torch.from_numpy(tables), torch.long, device)
        meta.decode_seq_lens = to_device(torch.from_numpy(ctx), torch.int32, device)
    start = d
    for computed, n, bt in prefill_seqs:
        bt = np.asarray(bt, np.int64)
        pos = np.arange(computed, computed + n)
        pos_parts.append(pos)
        slot_parts.append(bt[pos // block_size] * block_size + pos % block_size)
        meta.prefills.append(PrefillChunk(start, start + n, computed + n, to_device(torch.from_numpy(bt), torch.long,
                                                                                   device), sliding_window))
        start += n
    positions = np.concatenate(pos_parts) if pos_parts else np.zeros(0, np.int64)
    slots = np.concatenate(slot_parts) if slot_parts else np.zeros(0, np.int64)
    meta.slot_mapping = to_device(torch.from_numpy(slots), torch.long, device)
    return meta, positions.tolist()
