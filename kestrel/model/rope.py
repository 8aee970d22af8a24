"""Rotary position embedding with the scaling variants used by Llama-family checkpoints
(default, linear, llama3). Rotation uses the 'rotate_half' layout of HF checkpoints (GGUF q/k are un-permuted
into that layout by the loader)."""
from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        # Keep high frequencies, divide low ones by `factor`, blend in between (Llama 3.1 recipe).
        factor = scaling["factor"]
        lo, hi = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return torch.where(mid, blended, scaled).float()
    raise ValueError(f"unsupported rope scaling type {kind!r}")


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        self.args = (head_dim, max_positions, theta, scaling)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build()

    def build(self, device="cpu", dtype=torch.float32):
        """(Re)compute the tables in fp32 and keep them in `dtype` (call after model.to(meta/dtype))."""
        head_dim, max_positions, theta, scaling = self.args
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        # cos and sign-folded sin for both halves, precomputed: rotate_half(x) * sin == roll(x, D/2) * [-sin, sin]
        self.cos = torch.cat([freqs.cos(), freqs.cos()], -1).to(device=device, dtype=dtype)
        self.sin = torch.cat([-freqs.sin(), freqs.sin()], -1).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Once per step (shared by all layers): cos, signed sin as [T, 1, D]."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, heads, D] (q and k heads together) -> rotated copy (HF rotate-half convention)."""
        cos, sin = cos_sin
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)
