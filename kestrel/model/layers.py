"""Building blocks shared by model families. Every linear layer is created by `make_linear`, so a quantized
implementation (kestrel.kernels QuantLinear) can be swapped in from one place via `set_linear_factory`."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

LinearFactory = Callable[[int, int, bool, str], nn.Module]


def _default_linear(in_features: int, out_features: int, bias: bool, name: str) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=bias)


_linear_factory: LinearFactory = _default_linear


def set_linear_factory(factory: LinearFactory | None) -> None:
    """Install a factory (in_features, out_features, bias, name) -> module; None restores nn.Linear."""
    global _linear_factory
    _linear_factory = factory or _default_linear


def make_linear(in_features: int, out_features: int, bias: bool = False, name: str = "") -> nn.Module:
    return _linear_factory(in_features, out_features, bias, name)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one-pass Triton row kernel: PyTorch's generic kernel is ~3x slower at decode sizes
            from kestrel.kernels.rmsnorm import rms_norm
            return rms_norm(x, self.weight, self.eps)
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
