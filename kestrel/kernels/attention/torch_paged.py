"""The paged chunk attention of prefill.py / store_kvcache.py in plain torch: what a CPU engine runs.

The engine's CPU backend (kestrel/engine/attention.py TorchAttentionBackend) never calls the Triton kernels; the
chunk steps (prefill graphs, speculative verify: kestrel/engine/prefill_graphs.PagedChunkCtx) take this path on a
CPU for the same reason: under TRITON_INTERPRET=1 every tile op is a Python call (a tree-verify engine test spent
334 of its 366 s in the interpreted prefill kernel) and without it Triton cannot run on a CPU at all. Same inputs
and the same semantics as paged_prefill_attention, padding included: a query at a negative position (a padding
sequence with seq_len 0) sees no key and returns 0, a slot < 0 is not stored. The kernels' own tests run the
kernels under the interpreter against this and against independent references.
"""
from __future__ import annotations

import torch


def torch_store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """store_kvcache: k, v [T, Hkv, D] into slot_mapping's slots of [blocks, block_size, Hkv, D] (-1 = skip)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def torch_paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                                  scale: float, max_q_len: int, window: int = 0, out: torch.Tensor | None = None,
                                  tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """paged_prefill_attention's result (q [T, Hq, D] -> [T, Hq, D]; its signature, so callers pick either), one
    sequence at a time in fp32. max_q_len sizes only the kernel's grid: unused here."""
    T, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device) if out is None else out
    out.zero_()  # rows of empty sequences stay 0, as the kernel's
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, L in enumerate(lens):
        q0, n = cu[b], cu[b + 1] - cu[b]
        if n == 0 or L <= 0:
            continue
        ctx = L - n
        kpos = torch.arange(L, device=q.device)
        slots = block_tables[b].long()[kpos // bs] * bs + kpos % bs
        kk = k_cache.view(-1, Hkv, D)[slots].float().repeat_interleave(Hq // Hkv, 1)  # [L, Hq, D]
        vv = v_cache.view(-1, Hkv, D)[slots].float().repeat_interleave(Hq // Hkv, 1)
        qpos = ctx + torch.arange(n, device=q.device)
        visible = kpos[None, :] <= qpos[:, None]
        if window > 0:
            visible &= qpos[:, None] - kpos[None, :] < window
        if tree_mask is not None:  # chunk keys: only the query's ancestors (bit k - ctx of its mask word)
            bits = tree_mask[q0:q0 + n].long()
            rel = (kpos - ctx).clamp_min(0)
            visible &= (kpos[None, :] < ctx) | ((bits[:, None] >> rel[None, :]) & 1).bool()
        s = torch.einsum("qhd,khd->hqk", q[q0:q0 + n].float(), kk) * scale
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)  # no key visible: 0
        out[q0:q0 + n] = torch.einsum("hqk,khd->qhd", p, vv).to(q.dtype)
    return out
