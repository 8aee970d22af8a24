"""Column- and row-parallel linears (Megatron style), for nn.Linear and kestrel QuantLinear alike.

Column-parallel: each rank holds some output rows of W [N, K] and returns its slice of y; no communication.
Row-parallel: each rank holds a slice of the input columns, multiplies its slice of x, and the partial sums are
all-reduced; the bias is added once, after the reduction. A fused projection (q|k|v, gate|up) is sharded segment
by segment, so every rank still holds "its q, its k, its v" back to back.

QuantLinear shards are cut from the packed weight itself (qweight [K/epw, N], scales/zeros [G, N]), not
re-quantized, so a shard dequantizes to exactly the rows/columns of the unsharded weight.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from .distributed import ParallelGroup


def _is_quant(m: nn.Module) -> bool:
    return hasattr(m, "qweight_struct")


def _check_float_linear(m: nn.Module) -> None:
    """nn.Linear or any linear-like module exposing its float `.weight` [N, K] and `.bias` (e.g. a CPU-prepacked
    linear); the shard is always a plain nn.Linear."""
    w = getattr(m, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"cannot shard {type(m).__name__}: expected nn.Linear, QuantLinear or a linear with .weight")


def _k_block(spec) -> int:
    """K granularity of the packed layout (kestrel.quant.packing), one int32 word if it defines none."""
    from kestrel.quant import packing

    if hasattr(packing, "plane_block"):
        return packing.plane_block(spec.container_bits)
    return spec.elems_per_word


def _cat_rows(t: torch.Tensor | None, segments, dim: int) -> torch.Tensor | None:
    if t is None:
        return None
    return torch.cat([t.narrow(dim, a, b - a) for a, b in segments], dim=dim).clone()


def column_shard(m: nn.Module, segments: list[tuple[int, int]]) -> nn.Module:
    """A new module computing output features [a, b) of each segment of `m`, concatenated."""
    if _is_quant(m):
        from kestrel.kernels.quant_linear import QuantLinear

        qw = m.qweight_struct
        n = sum(b - a for a, b in segments)
        sub = replace(qw, shape=(n, qw.shape[1]), qweight=_cat_rows(qw.qweight, segments, 1),
                      scales=_cat_rows(qw.scales, segments, 1), zeros=_cat_rows(qw.zeros, segments, 1))
        return QuantLinear(sub, _cat_rows(m.bias, segments, 0), use_kernel=m.use_kernel)
    _check_float_linear(m)
    w = m.weight.detach()
    bias = getattr(m, "bias", None)
    out = nn.Linear(w.shape[1], sum(b - a for a, b in segments), bias=bias is not None,
                    device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(_cat_rows(w, segments, 0))
        if bias is not None:
            out.bias.copy_(_cat_rows(bias.detach(), segments, 0))
    return out.requires_grad_(False)


def row_shard(m: nn.Module, k0: int, k1: int) -> nn.Module:
    """A new module over input features [k0, k1) of `m`, without bias (RowParallelLinear adds it after the sum)."""
    if _is_quant(m):
        from kestrel.kernels.quant_linear import QuantLinear

        qw = m.qweight_struct
        if qw.perm is not None:
            raise ValueError("act-order (permuted) quantized weights cannot be split along K for tensor "
                             "parallelism; use a checkpoint without act-order or tensor-parallel-size 1")
        epw, g = qw.spec.elems_per_word, qw.group_size
        unit = _k_block(qw.spec)  # whole word rows of the packed layout: a K slice must not split one
        per_channel = qw.num_groups == 1
        if k0 % unit or k1 % unit or (not per_channel and (k0 % g or k1 % g)):
            raise ValueError(f"row-parallel split [{k0}, {k1}) is not aligned to the quantization group "
                             f"({g}) / packed K block ({unit}); choose a tensor-parallel size that divides evenly")
        sl = (lambda t: t) if per_channel else (lambda t: None if t is None else t[k0 // g:k1 // g].clone())
        sub = replace(qw, shape=(qw.shape[0], k1 - k0), qweight=qw.qweight[k0 // epw:k1 // epw].clone(),
                      scales=sl(qw.scales), zeros=sl(qw.zeros))
        return QuantLinear(sub, None, use_kernel=m.use_kernel)
    _check_float_linear(m)
    w = m.weight.detach()
    out = nn.Linear(k1 - k0, w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w[:, k0:k1])
    return out.requires_grad_(False)


class ColumnParallelLinear(nn.Module):
    """Holds this rank's output rows; forward returns the local slice (gather_output=True: the full y)."""

    def __init__(self, local: nn.Module, group: ParallelGroup, gather_output: bool = False):
        super().__init__()
        self.local, self.group, self.gather_output = local, group, gather_output

    @classmethod
    def from_full(cls, m: nn.Module, group: ParallelGroup, segment_sizes: list[int] | None = None,
                  rank_segments: list[tuple[int, int]] | None = None, gather_output: bool = False):
        """Split each fused segment (sizes `segment_sizes`, default: one segment of all rows) evenly over the
        group; or give this rank's rows explicitly with `rank_segments`."""
        if rank_segments is None:
            sizes = segment_sizes or [m.out_features]
            rank_segments, off = [], 0
            for s in sizes:
                if s % group.size:
                    raise ValueError(f"output size {s} is not divisible by tensor-parallel size {group.size}")
                per = s // group.size
                rank_segments.append((off + group.rank * per, off + (group.rank + 1) * per))
                off += s
        return cls(column_shard(m, rank_segments), group, gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        return self.group.all_gather_cat(y, -1) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Holds this rank's input columns; forward(x_local) = all_reduce(x_local @ W_local^T) + bias."""

    def __init__(self, local: nn.Module, bias: torch.Tensor | None, group: ParallelGroup):
        super().__init__()
        self.local, self.group = local, group
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_full(cls, m: nn.Module, group: ParallelGroup):
        k = m.in_features
        if k % group.size:
            raise ValueError(f"input size {k} is not divisible by tensor-parallel size {group.size}")
        per = k // group.size
        return cls(row_shard(m, group.rank * per, (group.rank + 1) * per), getattr(m, "bias", None), group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(self.local(x))
        return y if self.bias is None else y + self.bias.to(y.dtype)
