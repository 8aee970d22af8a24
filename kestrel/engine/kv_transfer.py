"""Prefill/decode disaggregation, engine side: export the KV of a prompt's cached prefix blocks, and import such
blocks into another engine's prefix cache.

Blocks travel with their token ids, never with hashes (each engine chains its own hashes), so an imported block
is found by the ordinary prefix-cache lookup when the same prompt arrives: the decode engine then computes only
the tail the blocks do not cover (less than one block, at least the last token), and decodes from there.
Both functions touch the block manager and KV tensors, so they must run on the engine's own thread
(AsyncLLMEngine.call)."""
from __future__ import annotations

import torch


def _kv_tensors(engine):
    if getattr(engine, "tp_size", 1) > 1:  # rank 0's cache holds only its share of the KV heads
        raise ValueError("KV transfer of a tensor-parallel engine is not supported yet")
    bm = getattr(engine, "block_manager", None)
    backend = getattr(getattr(engine, "runner", None), "backend", None)
    if bm is None or backend is None:
        raise ValueError("KV transfer needs a single-process engine (no tensor parallelism)")
    return bm, backend.k_cache, backend.v_cache


def export_prefix_blocks(engine, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """The leading full blocks of `token_ids` that this engine holds in its prefix cache, as
    {"k", "v": [n, layers, block_size, kv_heads, head_dim], "token_ids": [n * block_size]} (CPU tensors)."""
    bm, kc, vc = _kv_tensors(engine)
    bs, ids = bm.block_size, bm.cached_prefix_blocks(token_ids)
    n = len(ids)
    index = torch.tensor(ids, dtype=torch.long, device=kc[0].device)
    k = torch.stack([c.index_select(0, index) for c in kc], 1).cpu() if n else torch.empty(0)
    v = torch.stack([c.index_select(0, index) for c in vc], 1).cpu() if n else torch.empty(0)
    return {"k": k.contiguous(), "v": v.contiguous(),
            "token_ids": torch.tensor(token_ids[:n * bs], dtype=torch.int64)}


def import_prefix_blocks(engine, tensors: dict[str, torch.Tensor]) -> int:
    """Put received blocks into the prefix cache as free-but-cached blocks (the most recently used ones).
    Returns how many blocks are now held (already-present ones count; stops early if no block is free)."""
    bm, kc, vc = _kv_tensors(engine)
    k, v, token_ids = tensors["k"], tensors["v"], tensors["token_ids"].tolist()
    bs = bm.block_size
    n = len(token_ids) // bs
    if n == 0:
        return 0
    expect = (n, len(kc), *kc[0].shape[1:])
    if tuple(k.shape) != expect or tuple(v.shape) != expect:
        raise ValueError(f"KV blocks of shape {tuple(k.shape)} do not fit this engine's cache (expects {expect})")
    prev, held = None, 0
    for i in range(n):
        tokens = tuple(token_ids[i * bs:(i + 1) * bs])
        h = bm._chain(prev, tokens)
        prev = h
        bid = bm.hash_to_block.get(h)
        if bid is not None and bm.blocks[bid].token_ids == tokens:
            held += 1
            continue
        if not bm.free:
            break
        bid = bm._take_free()  # ref_count 1 while we fill it
        for layer in range(len(kc)):
            kc[layer][bid].copy_(k[i, layer])
            vc[layer][bid].copy_(v[i, layer])
        blk = bm.blocks[bid]
        blk.hash, blk.token_ids = h, tokens
        bm.hash_to_block[h] = bid
        blk.ref_count = 0
        bm.free[bid] = None  # tail of the LRU: evicted last
        held += 1
    engine.num_kv_blocks_imported = getattr(engine, "num_kv_blocks_imported", 0) + held
    return held
