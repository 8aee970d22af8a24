"""Paged decode attention: one query token per sequence, GQA, optional sliding window, split-KV.

One program handles one (sequence, kv head, split): it loads each K/V tile once for all query heads of the
GQA group (padded to 16 rows so tl.dot is legal on the GPU) and keeps an online softmax. For long contexts and
small batches the context is cut into splits so the whole GPU works; a second kernel merges the splits with
their log-sum-exp.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_tile import load_kv_tile


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
                   out_ptr, lse_ptr, scale, window, stride_bt,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # with a window the query (position seq_len-1) sees only keys with pos > seq_len-1-window
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    # each sequence cuts its own span into NUM_SPLITS tile-aligned chunks (graph-safe: no host-side lengths)
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    num_q_heads = NUM_KV_HEADS * GROUP
    q_heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + (seq * num_q_heads + q_heads)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, stride_bt, pos, n_mask, kvh, offs_d,
                            d_mask, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # An empty split (possible when the context is shorter than the split grid) writes lse=-inf, out=0.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf"))
    o_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + (seq * num_q_heads + q_heads)[:, None] * HEAD_DIM + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        row = (seq * num_q_heads + q_heads) * NUM_SPLITS + split
        tl.store(out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=o_mask)
        tl.store(lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _reduce_splits_kernel(part_ptr, lse_ptr, out_ptr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    row = tl.program_id(0)  # seq * num_q_heads + head
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    lse = tl.load(lse_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(s_mask & (lse > float("-inf")), tl.exp(lse - m), 0.0)
    tot = tl.sum(w, 0)
    w = w / tl.where(tot > 0, tot, 1.0)  # a padding row (seq_len 0) gives zeros, not NaN
    part = tl.load(part_ptr + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                   mask=s_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0)
    tl.store(out_ptr + row * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int = 64,
                       num_sms: int = 132) -> int:
    """Enough splits to put ~2 programs on every SM, but no split shorter than 4 tiles (merging has a cost)."""
    programs = num_seqs * num_kv_heads
    want = max(1, (2 * num_sms) // max(programs, 1))
    most = max(1, max_seq_len // (4 * block_n))
    return int(min(want, most, 64))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           window: int = 0, num_splits: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, Hq, D] (the newest token of each sequence, already in the cache); seq_lens: [B] tokens incl. it.

    window > 0 limits each query to the last `window` keys. num_splits > 1 cuts each sequence's context into
    that many tile-aligned chunks and merges them in a second kernel. Nothing here reads device values on the
    host, so the call can be captured in a CUDA graph. Returns [B, Hq, D] in q's dtype.
    """
    B, Hq, D = q.shape
    _, block_size, Hkv, Dk = k_cache.shape
    if Dk != D or Hq % Hkv:
        raise ValueError(f"q heads/dim {Hq}x{D} do not fit the cache's {Hkv}x{Dk}")
    q = q.contiguous()
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    group = Hq // Hkv
    block_n = 64 if q.is_cuda else 16
    block_d = triton.next_power_of_2(D)
    common = dict(NUM_KV_HEADS=Hkv, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
                  HEAD_DIM=D, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits)
    grid = (B, Hkv, num_splits)
    if num_splits == 1:
        _decode_kernel[grid](q, k_cache, v_cache, block_tables, seq_lens, out, out, scale, window,
                             block_tables.stride(0), **common)
        return out
    part = torch.empty(B * Hq * num_splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B * Hq * num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[grid](q, k_cache, v_cache, block_tables, seq_lens, part, lse, scale, window,
                         block_tables.stride(0), **common)
    _reduce_splits_kernel[(B * Hq,)](part, lse, out, HEAD_DIM=D, BLOCK_D=block_d, NUM_SPLITS=num_splits,
                                     SPLITS_PAD=triton.next_power_of_2(num_splits))
    return out
