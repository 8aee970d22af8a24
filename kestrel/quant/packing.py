"""The one internal packed layout the kernels read, and the bit-stream helpers converters use.

Internal layout: codes (unsigned, `container_bits` wide) packed along K into int32 words, K-major:
`qweight[K // epw, N]`, code of (n, k) in word (k // epw, n) at bit (k % epw) * container_bits.
K-major keeps each tile's loads contiguous along N (coalesced) and lets the kernel unpack a
[BLOCK_K // epw, epw, BLOCK_N] block with one broadcast shift.
"""
from __future__ import annotations

import numpy as np
import torch


def pack_codes(codes: torch.Tensor, container_bits: int) -> torch.Tensor:
    """codes [N, K] (0 <= c < 2^bits) -> int32 [K // epw, N]."""
    n, k = codes.shape
    epw = 32 // container_bits
    if k % epw:
        raise ValueError(f"K={k} must be a multiple of {epw} to pack {container_bits}-bit codes")
    c = codes.t().to(torch.int64).reshape(k // epw, epw, n)
    shifts = (torch.arange(epw, dtype=torch.int64, device=codes.device) * container_bits).view(1, epw, 1)
    words = (c << shifts).sum(dim=1)
    return _to_int32(words)


def unpack_codes(qweight: torch.Tensor, container_bits: int, k: int) -> torch.Tensor:
    """int32 [K // epw, N] -> codes int32 [N, K]."""
    epw = 32 // container_bits
    w = qweight.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(epw, dtype=torch.int64, device=qweight.device) * container_bits).view(1, epw, 1)
    c = (w.unsqueeze(1) >> shifts) & ((1 << container_bits) - 1)
    return c.reshape(k, -1).t().to(torch.int32).contiguous()


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    w = words & 0xFFFFFFFF
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def pack_bitstream(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned `bits`-wide values along `dim` as a little-endian bit stream of int32 words
    (GPTQ's layout; for bits in 1,2,4,8 this equals element i at bit i*bits of its word)."""
    v = values.movedim(dim, -1).to(torch.int64).numpy().astype(np.uint64)
    lead, count = v.shape[:-1], v.shape[-1]
    if (count * bits) % 32:
        raise ValueError(f"{count} values of {bits} bits do not fill whole int32 words")
    bitarr = ((v[..., :, None] >> np.arange(bits, dtype=np.uint64)) & 1).astype(np.uint8)
    bitarr = bitarr.reshape(*lead, count * bits // 32, 32)
    words = (bitarr.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
    return _to_int32(torch.from_numpy(words.astype(np.int64))).movedim(-1, dim).contiguous()


def unpack_bitstream(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of pack_bitstream: int32 words along `dim` -> int32 values along `dim`."""
    w = (words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF).numpy().astype(np.uint64)
    lead, nw = w.shape[:-1], w.shape[-1]
    count = nw * 32 // bits  # trailing pad bits (a padded last word) are dropped
    bitarr = ((w[..., :, None] >> np.arange(32, dtype=np.uint64)) & 1).reshape(*lead, nw * 32)[..., :count * bits]
    bitarr = bitarr.reshape(*lead, count, bits)
    vals = (bitarr << np.arange(bits, dtype=np.uint64)).sum(-1).astype(np.int64)
    return torch.from_numpy(vals).to(torch.int32).movedim(-1, dim).contiguous()
