"""The one internal packed layout the kernels read, and the bit-stream helpers converters use.

Internal layout ("planar", chosen for the kernels): codes (unsigned, `container_bits` wide) packed into int32
words, K-major: `qweight[K // epw, N]`. K is cut into blocks of PLANE_ROWS * epw elements; within block b, word
row b * PLANE_ROWS + r holds in its bit field i (bits i*cb .. i*cb+cb-1) the code of k = b*block + i*PLANE_ROWS + r.
So one [PLANE_ROWS, BN] tile of words unpacks, field by field, into epw tiles [PLANE_ROWS, BN] of *contiguous* k
with the same register layout as the loaded words (no reshapes or shuffles in the kernel), loads are contiguous
along N (coalesced), and every field of a tile lies in one quantization group when group >= PLANE_ROWS.
"""
from __future__ import annotations

import numpy as np
import torch

PLANE_ROWS = 16


def plane_block(container_bits: int) -> int:
    """K granularity of the layout: PLANE_ROWS words of 32 // container_bits codes."""
    return PLANE_ROWS * (32 // container_bits)


def padded_k(k: int, container_bits: int) -> int:
    """K rounded up to whole planar blocks: a K that is not a multiple is stored zero-padded (the kernels mask x
    beyond K, so padded codes never contribute)."""
    pb = plane_block(container_bits)
    return -(-k // pb) * pb


def pack_codes(codes: torch.Tensor, container_bits: int) -> torch.Tensor:
    """codes [N, K] (0 <= c < 2^bits) -> int32 [padded_k(K) // epw, N] in the planar layout."""
    n, k = codes.shape
    epw = 32 // container_bits
    pb = plane_block(container_bits)
    if k % pb:
        codes = torch.nn.functional.pad(codes, (0, padded_k(k, container_bits) - k))
        k = codes.shape[1]
    c = codes.t().to(torch.int64).reshape(k // pb, epw, PLANE_ROWS, n)
    shifts = (torch.arange(epw, dtype=torch.int64, device=codes.device) * container_bits).view(1, epw, 1, 1)
    words = (c << shifts).sum(dim=1)  # [K/pb, PLANE_ROWS, N]
    return _to_int32(words.reshape(k // epw, n))


def unpack_codes(qweight: torch.Tensor, container_bits: int, k: int) -> torch.Tensor:
    """int32 [padded_k(K) // epw, N] (planar) -> codes int32 [N, K] (padding dropped)."""
    epw = 32 // container_bits
    pb = plane_block(container_bits)
    n = qweight.shape[1]
    kp = qweight.shape[0] * epw
    w = (qweight.to(torch.int64) & 0xFFFFFFFF).reshape(kp // pb, 1, PLANE_ROWS, n)
    shifts = (torch.arange(epw, dtype=torch.int64, device=qweight.device) * container_bits).view(1, epw, 1, 1)
    c = (w >> shifts) & ((1 << container_bits) - 1)  # [K/pb, epw, PLANE_ROWS, N]
    return c.reshape(kp, n)[:k].t().to(torch.int32).contiguous()


def pair_halves(qweight: torch.Tensor) -> torch.Tensor:
    """The pair word order (4-bit codes; an opt-in packing, QuantizedWeight.pair_words): word rows 2p, 2p + 1 of the
    planar layout (adjacent k of one column, the two words a thread of the mv kernel's MMA operand decodes together)
    swap the high half of the first with the low half of the second, so row 2p holds fields 0-3 of rows 2p | 2p + 1
    in its low | high 16 bits and row 2p + 1 their fields 4-7. A field's two codes then sit at the same offset of
    the two halves of one word, as a bf16x2 / f16x2 register wants them (no byte permute to gather them). The swap
    is its own inverse."""
    rows, n = qweight.shape
    if rows % 2 or qweight.dtype != torch.int32:
        raise ValueError(f"pair order needs int32 words with an even row count, got {qweight.dtype} {rows}")
    h = qweight.contiguous().view(torch.int16).view(rows // 2, 2, n, 2)  # [pair, row in pair, column, half]
    return h.transpose(1, 3).contiguous().view(rows, 2 * n).view(torch.int32)


def adjacent_pairs(qweight: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Storage of word rows 2p, 2p + 1 of each column next to each other (opt-in, with the pair order:
    QuantizedWeight.pair_adjacent): element (r, n) of the [rows, N] array moves to flat position
    (r // 2) * 2N + 2n + r % 2, so a thread's two words of one column are one 64-bit shared-memory load; the shape
    stays [rows, N] and a planar block keeps its bytes. inverse=True undoes it."""
    rows, n = qweight.shape
    if rows % 2:
        raise ValueError(f"adjacent pairs need an even row count, got {rows}")
    shape = (rows // 2, n, 2) if inverse else (rows // 2, 2, n)
    return qweight.contiguous().view(shape).transpose(1, 2).contiguous().view(rows, n)


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
    if 32 % bits == 0:  # whole fields per word: shifts in torch (the bit-array path below is ~100x slower, which
        # made loading one Llama-8B-sized GPTQ layer take a minute); arithmetic >> then & mask is exact for int32
        w = words.to(torch.int32)
        d = dim % w.dim()
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=w.device).view(-1, *[1] * (w.dim() - d - 1))
        vals = (w.unsqueeze(d + 1) >> shifts) & ((1 << bits) - 1)  # field axis right after `dim`, then merged
        return vals.flatten(d, d + 1)
    w = (words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF).numpy().astype(np.uint64)
    lead, nw = w.shape[:-1], w.shape[-1]
    count = nw * 32 // bits  # trailing pad bits (a padded last word) are dropped
    bitarr = ((w[..., :, None] >> np.arange(32, dtype=np.uint64)) & 1).reshape(*lead, nw * 32)[..., :count * bits]
    bitarr = bitarr.reshape(*lead, count, bits)
    vals = (bitarr << np.arange(bits, dtype=np.uint64)).sum(-1).astype(np.int64)
    return torch.from_numpy(vals).to(torch.int32).movedim(-1, dim).contiguous()
