"""Small-M GEMM for the draft head's parallel backbone, with its neighbours fused in: y = epilogue(prologue(x) W^T + b).

Why: the backbone is 15 launches per proposal in PyTorch (gather, cat, norm, linear, slot add, and per MLP block
norm, linear, silu, linear, residual add) at ~5 us each in a CUDA graph; rows are few (batch x k <= 384) so each op
is launch-bound. Fused: 5 launches (in-layer, then up and down per block).
  prologue  CAT: x = [h, embed[x_next]] (the head's input, gathered in place);  RMS: x = rmsnorm(x) * weight
  epilogue  SILU: silu(y);  RESID: y + res;  SLOTS: row m -> KS rows m*KS + s, each y + slot[s]
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _x_tile(x_ptr, x_stride, e_ptr, idx, rows, mr, kk, K, H, CAT: tl.constexpr):
    if CAT:  # columns [0, H) from h, [H, 2H) from the embedding rows idx
        a = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=mr[:, None] & (kk < H)[None, :], other=0.0)
        b = tl.load(e_ptr + idx[:, None] * H + (kk - H)[None, :], mask=mr[:, None] & ((kk >= H) & (kk < K))[None, :],
                    other=0.0)
        return a.to(tl.float32) + b.to(tl.float32)
    return tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :], mask=mr[:, None] & (kk < K)[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _head_gemm_kernel(x_ptr, x_stride, e_ptr, ids_ptr, M, K, H, w_ptr, b_ptr, y_ptr, y_stride, NO,
                      nw_ptr, eps, res_ptr, res_stride, slot_ptr, KS,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CAT: tl.constexpr, RMS: tl.constexpr,
                      SILU: tl.constexpr, RESID: tl.constexpr, SLOTS: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rows = pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    mr, mc = rows < M, cols < NO
    idx = rows
    if CAT:
        idx = tl.load(ids_ptr + rows, mask=mr, other=0).to(tl.int32)
    r = tl.full([BM], 1.0, tl.float32)
    if RMS:
        ss = tl.zeros([BM], dtype=tl.float32)
        for k0 in range(0, K, BK):
            x = _x_tile(x_ptr, x_stride, e_ptr, idx, rows, mr, k0 + tl.arange(0, BK), K, H, CAT)
            ss += tl.sum(x * x, 1)
        r = 1.0 / tl.sqrt(ss / K + eps)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        x = _x_tile(x_ptr, x_stride, e_ptr, idx, rows, mr, kk, K, H, CAT)
        if RMS:
            x = x * r[:, None] * tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
        w = tl.load(w_ptr + cols[:, None] * K + kk[None, :], mask=mc[:, None] & (kk < K)[None, :], other=0.0)
        acc += tl.dot(x.to(w.dtype), tl.trans(w))
    acc += tl.load(b_ptr + cols, mask=mc, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    m2 = mr[:, None] & mc[None, :]
    if RESID:
        acc += tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    if SLOTS:
        for s in range(KS):
            sl = tl.load(slot_ptr + s * NO + cols, mask=mc, other=0.0).to(tl.float32)
            tl.store(y_ptr + (rows[:, None] * KS + s) * y_stride + cols[None, :],
                     (acc + sl[None, :]).to(y_ptr.dtype.element_ty), mask=m2)
    else:
        tl.store(y_ptr + rows[:, None] * y_stride + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=m2)


def head_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, norm_weight=None, eps: float = 0.0,
              embed=None, ids=None, silu: bool = False, residual=None, slots=None) -> torch.Tensor:
    """x [M, K] (or h [M, H] with embed/ids: x = [h, embed[ids]], K = 2H) -> [M, NO] (or [M, KS, NO] with slots
    [KS, NO]), in x's dtype, fp32 accumulation. weight [NO, K] as nn.Linear stores it."""
    M = x.shape[0]
    NO, K = weight.shape
    H = x.shape[1]
    cat = embed is not None
    if x.stride(-1) != 1:
        x = x.contiguous()
    KS = slots.shape[0] if slots is not None else 1
    y = torch.empty((M, KS, NO) if slots is not None else (M, NO), dtype=x.dtype, device=x.device)
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    BM = 16 if M <= 16 else (32 if M <= 32 else 64)
    BN, BK = 32, 64
    dummy = bias
    _head_gemm_kernel[(triton.cdiv(M, BM), triton.cdiv(NO, BN))](
        x, x.stride(0), embed if cat else dummy, ids if cat else dummy, M, K, H, weight, bias, y, NO, NO,
        norm_weight if norm_weight is not None else dummy, eps, residual if residual is not None else dummy,
        residual.stride(0) if residual is not None else 0, slots if slots is not None else dummy, KS,
        BM=BM, BN=BN, BK=BK, CAT=cat, RMS=norm_weight is not None, SILU=silu, RESID=residual is not None,
        SLOTS=slots is not None, num_warps=4)
    return y


def fused_slots(head, h: torch.Tensor, x_next: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    """DraftHead.slots(h, embed[x_next]) in 1 + 2 per block launches: [N, H], [N] -> [N, k, H]."""
    from kestrel.spec.draft_head import _EPS
    N, H = h.shape
    eps = lambda n: n.eps if n.eps is not None else _EPS  # noqa: E731
    z = head_gemm(h, head.fuse.weight, head.fuse.bias, norm_weight=head.in_norm.weight, eps=eps(head.in_norm),
                  embed=embed, ids=x_next, slots=head.slot)
    z = z.view(N * head.k, H)
    for blk in head.backbone:
        u = head_gemm(z, blk.up.weight, blk.up.bias, norm_weight=blk.norm.weight, eps=eps(blk.norm), silu=True)
        z = head_gemm(u, blk.down.weight, blk.down.bias, residual=z)
    return z.view(N, head.k, H)
