"""QuantizedWeight (the internal packed form every converter produces) and its CPU reference dequantize()."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kestrel.quant.formats import decode_minifloat, decode_scales
from kestrel.quant.packing import adjacent_pairs, padded_k, pair_halves, unpack_codes
from kestrel.quant.spec import QuantSpec


@dataclass
class QuantizedWeight:
    """W[N, K] ~= dequantize(self).

    qweight: int32 [Kp // epw, N]  codes packed along K (see packing.py); rows in `perm` order if perm is set;
                                   Kp = K rounded up to the layout's block (zero codes beyond K)
    scales:  [G, N]                float (fp16/bf16/fp32) or uint8 codes (e8m0 / fp8_e4m3); G = ceil(Kp / group),
                                   1 per channel; rows for groups wholly beyond K are zero-filled here if absent
    zeros:   [G, N] float or None  w = (code - zero) * scale; symmetric types use the constant spec.code_offset
    perm:    int64 [K] or None     act-order: stored row j holds input channel perm[j]; the kernel gathers x[:, perm]
    global_scale: float32 scalar tensor or None (NVFP4 second-level scale, a multiplier)
    pair_words: bool               qweight in the pair word order (packing.pair_halves; 4-bit codes, opt-in): only the
                                   mv / mvs kernels read it (they specialise on it), see with_pair_words
    pair_adjacent: bool            with pair_words: rows 2p, 2p + 1 of a column stored next to each other
                                   (packing.adjacent_pairs)
    """

    spec: QuantSpec
    shape: tuple[int, int]
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    pair_words: bool = False
    pair_adjacent: bool = False

    def __post_init__(self):
        n, k = self.shape
        epw = self.spec.elems_per_word
        kp = padded_k(k, self.spec.container_bits)
        if tuple(self.qweight.shape) != (kp // epw, n) or self.qweight.dtype != torch.int32:
            raise ValueError(f"qweight must be int32 [{kp // epw}, {n}], got {self.qweight.dtype} {tuple(self.qweight.shape)}")
        if self.pair_words and self.spec.container_bits != 4:
            raise ValueError("the pair word order is for 4-bit codes only")
        if self.pair_adjacent and not self.pair_words:
            raise ValueError("pair_adjacent is a storage of the pair word order (pair_words)")
        if self.spec.group_size == -1:
            g = g_real = 1
        else:
            g, g_real = -(-kp // self.spec.group_size), -(-k // self.spec.group_size)
        if self.scales.shape[0] == g_real < g:  # converters give groups of the real K: pad (x is 0 there anyway)
            self.scales = _pad_rows(self.scales, g)
            self.zeros = None if self.zeros is None else _pad_rows(self.zeros, g)
        if tuple(self.scales.shape) != (g, n):
            raise ValueError(f"scales must be [{g}, {n}], got {tuple(self.scales.shape)}")
        if self.spec.has_zero_point != (self.zeros is not None):
            raise ValueError("zeros must be given exactly when spec.has_zero_point")

    @property
    def padded_k(self) -> int:
        return padded_k(self.shape[1], self.spec.container_bits)

    @property
    def num_groups(self) -> int:
        return self.scales.shape[0]

    @property
    def group_size(self) -> int:
        """Input channels per scale row (the padded K for per-channel scales)."""
        return self.padded_k if self.spec.group_size == -1 else self.spec.group_size

    def to(self, device) -> "QuantizedWeight":
        mv = lambda t: None if t is None else t.to(device)
        return replace(self, qweight=mv(self.qweight), scales=mv(self.scales), zeros=mv(self.zeros),
                       perm=mv(self.perm), global_scale=mv(self.global_scale))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.qweight, self.scales, self.zeros) if t is not None)


def with_pair_words(qw: QuantizedWeight, adjacent: bool = False) -> QuantizedWeight:
    """The same weight with qweight in the pair word order (packing.pair_halves), for the mv / mvs kernels' e2m1
    and int4 decode without the byte permute per register pair (gemm_wna16_small PAIRW); adjacent: also the two
    words of a pair stored next to each other (packing.adjacent_pairs: one 64-bit LDS per pair). Done once at
    pack / load time. Other kernels refuse such a weight."""
    if qw.pair_words:
        if qw.pair_adjacent != adjacent:
            raise ValueError("the weight is in the pair word order with the other storage already")
        return qw
    words = pair_halves(qw.qweight)
    return replace(qw, qweight=adjacent_pairs(words) if adjacent else words, pair_words=True, pair_adjacent=adjacent)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))], dim=0)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """Reference: float32 [N, K] in the original input-channel order (computed on the weight's device)."""
    spec, (n, k) = qw.spec, qw.shape
    words = adjacent_pairs(qw.qweight, inverse=True) if qw.pair_adjacent else qw.qweight
    words = pair_halves(words) if qw.pair_words else words
    codes = unpack_codes(words, spec.container_bits, k).t()  # [K, N], stored order
    if spec.is_int:
        zero = qw.zeros.float().repeat_interleave(qw.group_size, 0)[:k] if qw.zeros is not None else spec.code_offset
        vals = codes.to(torch.float32) - zero
    else:
        vals = decode_minifloat(codes, *spec.minifloat)
    scale = decode_scales(qw.scales, spec.scale_dtype).repeat_interleave(qw.group_size, 0)[:k]
    w = vals * scale
    if qw.global_scale is not None:
        w = w * qw.global_scale.float()
    if qw.perm is not None:
        out = torch.empty_like(w)
        out[qw.perm] = w
        w = out
    return w.t().contiguous()
