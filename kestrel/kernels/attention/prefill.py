"""Paged prefill attention over packed variable-length queries (causal, optional sliding window).

The new tokens' K/V are written into the paged cache first (store_kvcache), so one kernel covers both plain
prefill and resumes whose earlier tokens came from the prefix cache: query i of sequence b sits at position
(seq_len_b - q_len_b + i) and attends every cached key at or before it (and within `window`, when set).
Grid: (sequence, query head, query tile).

Tree verification (speculative decoding, kestrel/spec/tree.py): with `tree_mask` [T] int64, the chunk is a draft
tree, not a sequence: chunk token j is stored at position ctx + j and sees every cached key before the chunk plus
the chunk tokens i whose bit i is set in tree_mask[j] (its ancestors and itself), so at most 64 tokens per chunk.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_tile import load_kv_tile


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_q_ptr, seq_lens_ptr, out_ptr,
                    scale, window, stride_bt, stride_qt, tree_ptr,
                    TREE: tl.constexpr, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    mblk = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if mblk * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx = seq_len - q_len  # tokens already in the cache before this chunk
        kvh = head // (NUM_Q_HEADS // NUM_KV_HEADS)
        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        m_mask = offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        q_pos = ctx + offs_m
        q_rows = (q_start + offs_m).to(tl.int64) * NUM_Q_HEADS + head  # output rows: [T, Hq, D] contiguous
        q = tl.load(q_ptr + ((q_start + offs_m).to(tl.int64) * stride_qt + head * HEAD_DIM)[:, None] + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)

        bits = tl.zeros([BLOCK_M], tl.int64)
        if TREE:
            bits = tl.load(tree_ptr + q_start + offs_m, mask=m_mask, other=0).to(tl.int64)
        # keys this tile can see: [lo, hi)
        hi = tl.minimum(ctx + (mblk + 1) * BLOCK_M, seq_len)
        lo = tl.where(window > 0, tl.maximum(ctx + mblk * BLOCK_M - window + 1, 0), 0)
        lo = (lo // BLOCK_N) * BLOCK_N

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            k_pos = n0 + offs_n
            n_mask = k_pos < hi
            k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, stride_bt, k_pos, n_mask, kvh,
                                offs_d, d_mask, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
            s = tl.dot(q, tl.trans(k)) * scale
            visible = n_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if TREE:  # chunk keys: only the query's ancestors (bit k_pos - ctx of its mask word)
                rel = tl.maximum(k_pos - ctx, 0).to(tl.int64)
                anc = ((bits[:, None] >> rel[None, :]) & 1) != 0
                visible = visible & ((k_pos[None, :] < ctx) | anc)
            visible = visible & ((window <= 0) | (q_pos[:, None] - k_pos[None, :] < window))
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row with nothing visible yet keeps m=-inf; use 0 as its shift so exp() gives 0, not NaN
            m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_rows[:, None] * HEAD_DIM + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float, max_q_len: int, window: int = 0,
                            out: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D] packed queries; cu_seqlens_q: [B+1] int32 offsets into T; seq_lens: [B] total tokens per
    sequence (cached context + this chunk), all already in the cache. tree_mask: [T] int64 ancestor bits of each
    chunk token (module docstring), None = causal. Returns [T, Hq, D]."""
    T, Hq, D = q.shape
    _, block_size, Hkv, Dk = k_cache.shape
    if Dk != D or Hq % Hkv:
        raise ValueError(f"q heads/dim {Hq}x{D} do not fit the cache's {Hkv}x{Dk}")
    if q.stride(-1) != 1 or q.stride(-2) != D:  # token rows may be strided (q heads sliced from a fused q|k
        q = q.contiguous()                     # output): no copy for those, one launch less per layer
    out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device) if out is None else out
    B = seq_lens.shape[0]
    if T == 0 or B == 0:
        return out
    block_m, block_n = (64, 64) if q.is_cuda else (16, 16)
    if q.is_cuda and D > 128:
        block_m, block_n = 64, 32  # keep the tiles inside shared memory
    if tree_mask is not None and (window > 0 or max_q_len > 64):
        raise ValueError("tree attention: chunks of at most 64 tokens, no sliding window")
    grid = (B, Hq, triton.cdiv(max_q_len, block_m))
    _prefill_kernel[grid](q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, scale, window,
                          block_tables.stride(0), q.stride(0),
                          tree_mask if tree_mask is not None else seq_lens,  # (any pointer when TREE is off)
                          TREE=tree_mask is not None, NUM_Q_HEADS=Hq, NUM_KV_HEADS=Hkv, HEAD_DIM=D,
                          BLOCK_D=triton.next_power_of_2(D), BLOCK_SIZE=block_size, BLOCK_M=block_m,
                          BLOCK_N=block_n)
    return out
