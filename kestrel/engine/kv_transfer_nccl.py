"""Prefill/decode disaggregation across GPUs: a prompt's cached KV blocks go from the prefill engine's GPU to the
decode engine's GPU with torch.distributed point-to-point send/recv (NCCL between GPUs, gloo on the CPU), instead
of through the host as safetensors over HTTP (kestrel/server/kv_transfer.py, whose block format and prefix-cache
import this reuses: blocks travel with their token ids and land in the decode engine's prefix cache, so the
request sent there next computes only the tail).

Wire format, in order: header int64 [num_blocks, num_tokens, num_layers], token ids int64 [num_tokens], then
k and v [num_blocks, num_layers, block_size, kv_heads, head_dim] in the cache dtype. The k/v gather happens on
the sender's device and the receiver's buffers are allocated on its device, so with NCCL nothing touches the host.
Both engines must be in one process group (e.g. a 2-rank world, one engine per rank).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .kv_transfer import import_prefix_blocks


def _comm_device(engine) -> torch.device:
    if getattr(engine, "tp_size", 1) > 1:  # rank 0's cache holds only its share of the KV heads
        raise ValueError("KV transfer of a tensor-parallel engine is not supported yet")
    dev = engine.runner.backend.k_cache[0].device
    if dist.get_backend() == "nccl" and dev.type != "cuda":
        raise ValueError("NCCL KV transfer needs the KV cache on a GPU")
    return dev


def send_prefix_blocks(engine, token_ids: list[int], dst: int, group=None) -> int:
    """Send the cached prefix blocks of `token_ids` to rank `dst`; returns the number of blocks sent."""
    backend = engine.runner.backend
    kc, vc = backend.k_cache, backend.v_cache
    dev = _comm_device(engine)
    ids = engine.block_manager.cached_prefix_blocks(token_ids)
    n, bs = len(ids), engine.block_manager.block_size
    dist.send(torch.tensor([n, n * bs, len(kc)], dtype=torch.long, device=dev), dst, group=group)
    if n == 0:
        return 0
    dist.send(torch.tensor(token_ids[:n * bs], dtype=torch.long, device=dev), dst, group=group)
    index = torch.tensor(ids, dtype=torch.long, device=dev)
    for cache in (kc, vc):  # one contiguous message each: [n, layers, block_size, kv_heads, head_dim]
        dist.send(torch.stack([c.index_select(0, index) for c in cache], 1).contiguous(), dst, group=group)
    return n


def recv_prefix_blocks(engine, src: int, group=None) -> int:
    """Receive blocks sent by `send_prefix_blocks` on rank `src` into this engine's prefix cache; returns how
    many blocks it now holds for that prefix (see kv_transfer.import_prefix_blocks)."""
    kc = engine.runner.backend.k_cache
    dev = _comm_device(engine)
    header = torch.empty(3, dtype=torch.long, device=dev)
    dist.recv(header, src, group=group)
    n, num_tokens, layers = header.tolist()
    if layers != len(kc):
        raise ValueError(f"sender has {layers} layers, this engine {len(kc)}")
    if n == 0:
        return 0
    token_ids = torch.empty(num_tokens, dtype=torch.long, device=dev)
    dist.recv(token_ids, src, group=group)
    shape = (n, layers, *kc[0].shape[1:])
    k = torch.empty(shape, dtype=kc[0].dtype, device=dev)
    v = torch.empty_like(k)
    dist.recv(k, src, group=group)
    dist.recv(v, src, group=group)
    return import_prefix_blocks(engine, {"k": k, "v": v, "token_ids": token_ids.cpu()})
