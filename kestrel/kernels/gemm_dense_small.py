"""y = x @ W^T for a few rows (M <= 16) and a dense bf16/fp16 weight: one program per BLOCK_N columns streams its
weight rows once, M padded to 16 for the tensor cores.

Why: a speculative verify step at batch 1 runs the model's GEMMs with M = K + 1 = 2..5 rows; cuBLAS' kernels for
those M cost more than its M = 1 GEMV (bench/spec_verify_profile.py measures both side by side), although the
weight bytes read are the same. Candidate for the verify path only, next to cuBLAS in that bench.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _dense_small_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + kk[:, None], mask=n_mask[None, :] & k_mask[:, None],
                    other=0.0)
        acc += tl.dot(x, w)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def dense_small_mm(x: torch.Tensor, w: torch.Tensor, block_n: int = 64, block_k: int = 64,
                   num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """x [M, K] (M <= 16), w [N, K] row-major -> [M, N] in x's dtype (fp32 accumulation)."""
    M, K = x.shape
    N = w.shape[0]
    if M > 16 or w.shape[1] != K:
        raise ValueError(f"dense_small_mm: x {tuple(x.shape)} and w {tuple(w.shape)} (needs M <= 16, same K)")
    x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _dense_small_kernel[(triton.cdiv(N, block_n),)](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                                     BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
                                                     num_warps=num_warps, num_stages=num_stages)
    return y


def _block_n(N: int) -> int:
    # enough programs to fill the SMs on the small projections, wide tiles on the vocabulary readout
    return 32 if N <= 1024 else 64 if N <= 8192 else 128


@contextmanager
def small_m_linears(model, min_m: int = 2, max_m: int = 16):
    """While active, the model's dense bf16/fp16 nn.Linear layers (no bias, CUDA) run dense_small_mm for inputs of
    min_m..max_m rows and F.linear otherwise. Meant around CUDA-graph capture: the graphs keep the kernels chosen
    at capture, the model itself is unchanged afterwards."""
    mods = [m for m in model.modules() if type(m) is torch.nn.Linear and m.bias is None and m.weight.is_cuda
            and m.weight.dtype in (torch.bfloat16, torch.float16)]

    def patched(m):
        def forward(x):
            rows = x.numel() // x.shape[-1]
            if min_m <= rows <= max_m:
                y = dense_small_mm(x.reshape(rows, x.shape[-1]), m.weight, block_n=_block_n(m.weight.shape[0]))
                return y.view(*x.shape[:-1], m.weight.shape[0])
            return F.linear(x, m.weight)
        return forward
    for m in mods:
        m.forward = patched(m)
    try:
        yield len(mods)
    finally:
        for m in mods:
            del m.forward
