"""The two elementwise steps of a Llama layer that read strided views of a fused projection, as one Triton kernel
each: rotary embedding of the q and k heads straight from the fused qkv output, and silu(gate) * up straight from
the fused gate_up output.

Why: with one token per step (decode) those views are contiguous and PyTorch runs them as vectorized kernels, but
with 2+ tokens per step (a speculative verify of K+1 tokens per row) the views are row-strided and PyTorch falls
back to its generic elementwise kernels: on the H200 that made a verify step of SmolLM2-135M ~0.28 ms slower than a
decode step (bench/spec_verify_profile.py, R1: "other" kernels 354 -> 628 us per step). One kernel each also
replaces 5 launches per layer (x*cos, roll, addcmul, silu, mul) by 2 at any token count.
Rounding follows the PyTorch ops they replace (x*cos rounded to the dtype before the add; silu rounded before
the multiply), so the results are the same.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# the model uses these kernels on CUDA; False (or KESTREL_ROPE_SILU=0) = the PyTorch ops (spec_verify_profile A/B)
ENABLED = os.environ.get("KESTREL_ROPE_SILU", "1") != "0"


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, stride_xt, stride_ct, H, D: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    m = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    rot = (offs_d + D // 2) % D  # rotate-half: roll by D/2 (the sign lives in the folded sin table)
    base = x_ptr + t * stride_xt + offs_h[:, None] * D
    x = tl.load(base + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
    xr = tl.load(base + rot[None, :], mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_ct + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_ct + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    a = (x * c[None, :]).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + t * H * D + offs_h[:, None] * D + offs_d[None, :], (a + xr * s[None, :]).to(y_ptr.dtype.element_ty),
             mask=m)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (rows may be strided, heads and dims contiguous), cos / signed sin [T, 1, D] -> contiguous
    [T, H, D] = x * cos + roll(x, D/2) * sin (RotaryEmbedding.apply)."""
    T, H, D = x.shape
    if x.stride(2) != 1 or x.stride(1) != D:
        x = x.contiguous()
    cos, sin = cos.reshape(cos.shape[0], D), sin.reshape(sin.shape[0], D)
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T:
        _rope_kernel[(T,)](x, cos, sin, y, x.stride(0), cos.stride(0), H, D=D, BLOCK_H=triton.next_power_of_2(H),
                           BLOCK_D=triton.next_power_of_2(D))
    return y


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, stride_xt, N, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(x_ptr + t * stride_xt + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_xt + N + offs, mask=m, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + t * N + offs, (s * u).to(y_ptr.dtype.element_ty), mask=m)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2N] = [gate | up] (rows may be strided) -> silu(gate) * up, contiguous [T, N]."""
    T, N2 = x.shape
    N = N2 // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T:
        block = min(1024, triton.next_power_of_2(N))
        _silu_mul_kernel[(T, triton.cdiv(N, block))](x, y, x.stride(0), N, BLOCK=block)
    return y
