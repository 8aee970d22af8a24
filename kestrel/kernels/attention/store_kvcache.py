"""Write the K/V of new tokens into their paged-cache slots.

Cache layout (docs/CONTRACTS.md): [num_blocks, block_size, num_kv_heads, head_dim], so one slot is a contiguous
run of num_kv_heads * head_dim elements and slot s starts at s * num_kv_heads * head_dim. A slot < 0 marks a
padding token (CUDA-graph batches are padded) and is skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          stride_kt, stride_vt, ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(k_ptr + t * stride_kt + offs, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """k, v: [T, num_kv_heads, head_dim]; slot_mapping: [T] int (slot = block * block_size + offset, -1 = skip)."""
    T, H, D = k.shape
    if T == 0:
        return
    if k_cache.shape[-2:] != (H, D) or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError(f"KV cache must be contiguous [blocks, block_size, {H}, {D}], got {tuple(k_cache.shape)}")
    # Each token's heads must be one contiguous row; a strided view from a fused QKV projection is fine per token.
    k = k if k.stride(-1) == 1 and k.stride(-2) == D else k.contiguous()
    v = v if v.stride(-1) == 1 and v.stride(-2) == D else v.contiguous()
    row = H * D
    _store_kvcache_kernel[(T,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                                ROW=row, BLOCK=triton.next_power_of_2(row))
