"""Triton paged attention kernels (run under TRITON_INTERPRET=1 on CPU) and their torch form for CPU engines
(torch_paged.py) vs a dense float64 PyTorch reference."""
import math

import pytest
import torch

from kestrel.kernels.attention import paged_decode_attention, paged_prefill_attention, store_kvcache
from kestrel.kernels.attention.torch_paged import torch_paged_prefill_attention, torch_store_kvcache

PREFILL = pytest.mark.parametrize("prefill", [paged_prefill_attention, torch_paged_prefill_attention],
                                  ids=["triton", "torch"])


def _paged_setup(seq_lens, num_kv_heads, head_dim, block_size, dtype, gen):
    """Random caches with each sequence's blocks scattered over a shuffled pool (never contiguous)."""
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.full((len(seq_lens), max_blocks), -7, dtype=torch.int32)  # junk past the end
    i = 0
    for s, nb in enumerate(blocks_per_seq):
        block_tables[s, :nb] = perm[i:i + nb].to(torch.int32)
        i += nb
    block_tables[block_tables < 0] = 0
    return k_cache, v_cache, block_tables


def _gather(cache, table, n, block_size):
    pos = torch.arange(n)
    return cache[table[pos // block_size].long(), pos % block_size]  # [n, H, D]


def _reference(q, k, v, q_pos, scale, window):
    """q: [M, Hq, D] at positions q_pos; k, v: [L, Hkv, D] at positions 0..L-1. float64, dense mask."""
    hq, hkv = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.double(), k) * scale
    kp = torch.arange(k.shape[0])
    vis = kp[None, :] <= q_pos[:, None]
    if window > 0:
        vis &= q_pos[:, None] - kp[None, :] < window
    s = s.masked_fill(~vis[None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(s, -1), v)


def _rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("store", [store_kvcache, torch_store_kvcache], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 5e-3)])
def test_store_kvcache_writes_slots_and_skips_padding(dtype, tol, store):
    gen = torch.Generator().manual_seed(0)
    T, H, D, nb, bs = 7, 2, 24, 5, 4
    k = torch.randn(T, H, D, generator=gen).to(dtype)
    v = torch.randn(T, H, D, generator=gen).to(dtype)
    k_cache = torch.full((nb, bs, H, D), 9.0, dtype=dtype)
    v_cache = torch.full((nb, bs, H, D), 9.0, dtype=dtype)
    slots = torch.tensor([13, 2, -1, 19, 0, 7, -1], dtype=torch.int64)
    store(k, v, k_cache, v_cache, slots)
    kf, vf = k_cache.view(-1, H, D), v_cache.view(-1, H, D)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kf[s], k[t]) and torch.equal(vf[s], v[t])
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert (kf[untouched] == 9.0).all() and (vf[untouched] == 9.0).all()


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,window,num_splits", [
    (4, 2, 32, 0, 1),     # GQA group 2
    (6, 1, 24, 0, 3),     # MQA, non-power-of-two head dim, split-KV + reduce
    (4, 4, 16, 0, 4),     # MHA, split-KV with splits that can be empty for the short sequences
    (4, 2, 32, 9, 1),     # sliding window
    (8, 2, 16, 20, 2),    # sliding window + split-KV
])
def test_paged_decode_matches_reference(num_q_heads, num_kv_heads, head_dim, window, num_splits):
    gen = torch.Generator().manual_seed(num_q_heads * 100 + head_dim + window)
    seq_lens = [1, 37, 70, 16]
    bs = 8
    k_cache, v_cache, tables = _paged_setup(seq_lens, num_kv_heads, head_dim, bs, torch.float32, gen)
    q = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    out = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), scale,
                                 window=window, num_splits=num_splits)
    for b, n in enumerate(seq_lens):
        ref = _reference(q[b:b + 1], _gather(k_cache, tables[b], n, bs), _gather(v_cache, tables[b], n, bs),
                         torch.tensor([n - 1]), scale, window)
        assert _rel_err(out[b:b + 1], ref) < 1e-4, f"seq {b}"


def test_paged_decode_fp16():
    gen = torch.Generator().manual_seed(5)
    seq_lens = [33, 5]
    k_cache, v_cache, tables = _paged_setup(seq_lens, 2, 32, 16, torch.float16, gen)
    q = torch.randn(2, 8, 32, generator=gen).half()
    out = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), 0.2,
                                 num_splits=2)
    assert out.dtype == torch.float16
    for b, n in enumerate(seq_lens):
        ref = _reference(q[b:b + 1], _gather(k_cache, tables[b], n, 16), _gather(v_cache, tables[b], n, 16),
                         torch.tensor([n - 1]), 0.2, 0)
        assert _rel_err(out[b:b + 1], ref) < 5e-3


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,window", [
    (4, 2, 32, 0),
    (3, 1, 24, 0),
    (4, 2, 16, 7),
])
@PREFILL
def test_paged_prefill_with_cached_prefix_matches_reference(num_q_heads, num_kv_heads, head_dim, window, prefill):
    gen = torch.Generator().manual_seed(num_q_heads + head_dim + window)
    # (cached prefix tokens, new tokens): plain prefill, prefix-cache resume, chunk longer than a tile, 1 token
    plan = [(0, 5), (16, 21), (9, 35), (40, 1)]
    seq_lens = [c + n for c, n in plan]
    bs = 8
    k_cache, v_cache, tables = _paged_setup(seq_lens, num_kv_heads, head_dim, bs, torch.float32, gen)
    q_lens = [n for _, n in plan]
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_q_heads, head_dim, generator=gen)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    prefill(q, k_cache, v_cache, tables, cu, torch.tensor(seq_lens, dtype=torch.int32), scale,
            max_q_len=max(q_lens), window=window, out=out)
    for b, (c, n) in enumerate(plan):
        L = c + n
        ref = _reference(q[cu[b]:cu[b + 1]], _gather(k_cache, tables[b], L, bs), _gather(v_cache, tables[b], L, bs),
                         torch.arange(c, L), scale, window)
        assert _rel_err(out[cu[b]:cu[b + 1]], ref) < 1e-4, f"seq {b}"


def test_store_then_prefill_equals_unpaged_causal_attention():
    """End to end: write K/V through store_kvcache with a slot mapping, then prefill vs torch SDPA."""
    gen = torch.Generator().manual_seed(3)
    H, D, bs, n = 2, 16, 4, 11
    k = torch.randn(n, H, D, generator=gen)
    v = torch.randn(n, H, D, generator=gen)
    q = torch.randn(n, H, D, generator=gen)
    table = torch.tensor([[5, 0, 3]], dtype=torch.int32)
    k_cache = torch.randn(6, bs, H, D, generator=gen)
    v_cache = torch.randn(6, bs, H, D, generator=gen)
    pos = torch.arange(n)
    slots = table[0, pos // bs].long() * bs + pos % bs
    store_kvcache(k, v, k_cache, v_cache, slots)
    out = paged_prefill_attention(q, k_cache, v_cache, table, torch.tensor([0, n], dtype=torch.int32),
                                  torch.tensor([n], dtype=torch.int32), D ** -0.5, max_q_len=n)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           is_causal=True).transpose(0, 1)
    assert (out - ref).abs().max().item() < 1e-4


def test_prefill_reads_row_strided_q_heads():
    """q sliced from a fused q|k tensor (token rows strided, as LlamaAttention hands it over): read in place, same
    result as the contiguous copy, output contiguous."""
    gen = torch.Generator().manual_seed(5)
    Hq, Hkv, D, bs, n = 4, 2, 16, 4, 9
    qk = torch.randn(n, Hq + Hkv, D, generator=gen)
    q = qk[:, :Hq]
    assert not q.is_contiguous()
    k_cache, v_cache, tables = _paged_setup([n], Hkv, D, bs, torch.float32, gen)
    args = (k_cache, v_cache, tables, torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
            D ** -0.5)
    got = paged_prefill_attention(q, *args, max_q_len=n)
    ref = paged_prefill_attention(q.contiguous(), *args, max_q_len=n)
    assert got.is_contiguous() and torch.equal(got, ref)


def test_torch_prefill_matches_kernel_on_padded_chunks():
    """The padded chunk step (prefill_graphs / verify_graph): a sequence padded past its real queries (seq_len =
    ctx + S) and a padding sequence (seq_len 0, S queries, nothing visible: zeros). The torch form a CPU engine runs
    gives the kernel's output row for row, padding rows included."""
    gen = torch.Generator().manual_seed(11)
    Hq, Hkv, D, bs, S = 4, 2, 16, 4, 6
    ctxs = [7, 0]
    k_cache, v_cache, tables = _paged_setup([c + S for c in ctxs] + [1], Hkv, D, bs, torch.float32, gen)
    cu = torch.arange(len(ctxs) + 2, dtype=torch.int32) * S
    seq_lens = torch.tensor([c + S for c in ctxs] + [0], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), Hq, D, generator=gen)
    want = paged_prefill_attention(q, k_cache, v_cache, tables, cu, seq_lens, 0.25, max_q_len=S)
    got = torch_paged_prefill_attention(q, k_cache, v_cache, tables, cu, seq_lens, 0.25, max_q_len=S)
    assert (got[-S:] == 0).all() and (want[-S:] == 0).all()
    assert (got - want).abs().max().item() < 1e-5
