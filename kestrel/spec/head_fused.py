"""The draft head's greedy proposal over its draft vocabulary in 3 Triton kernels per slot instead of ~9 launches.

Why: a k=4 proposal was 46 launches, 0.228 ms on an H200 (session 4 R1), ~5.5 us per launch in a CUDA graph and
almost no work in each. Per slot the eager path runs cat, addmm, silu, addmm, add (refiner), matmul, argmax (readout),
gather (next embedding). Here:
  pick+refine_in : argmax over the previous slot's readout partials -> token, its confidence, and the refiner's
                   first layer silu(W1 z_i + b + P[j] + W3 s_{i-1}), where W1 z_i + b is one GEMM for all slots up
                   front and P = E_sub W2^T is a table over the draft vocabulary made once (the embedding half of
                   the concatenated input needs no GEMV per slot)
  refine_out     : s_i = z_i + W_out u + b_out
  readout        : per (row block, vocabulary block) the max and first argmax of s_i . L_sub (tensor cores;
                   out_norm's weight is folded into L_sub, DraftHead.subset_readout)
Greedy drafts are proposals: they need not match the eager path bit for bit (fp32 logits here, bf16 there) to stay
lossless; tests/test_spec_head_fused.py checks them against the eager draft in float32 under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kestrel.spec.head_gemm import fused_slots


@triton.jit
def _logit_tile(s_ptr, s_stride, lm_ptr, rows, cols, mr, mc, H, BN: tl.constexpr, BV: tl.constexpr,
                BH: tl.constexpr):
    """[BN, BV] fp32 logits s[rows] . L_sub[cols] (tensor cores), -inf past the draft vocabulary (mc false)."""
    acc = tl.zeros([BN, BV], dtype=tl.float32)
    for h0 in range(0, H, BH):
        oh = h0 + tl.arange(0, BH)
        mh = oh < H
        s = tl.load(s_ptr + rows[:, None] * s_stride + oh[None, :], mask=mr[:, None] & mh[None, :], other=0.0)
        w = tl.load(lm_ptr + cols[:, None] * H + oh[None, :], mask=mc[:, None] & mh[None, :], other=0.0)
        acc += tl.dot(s, tl.trans(w.to(s.dtype)))
    return tl.where(mc[None, :], acc, float("-inf"))


@triton.jit
def _readout_kernel(s_ptr, s_stride, lm_ptr, pmax_ptr, pidx_ptr, N, V, H, NB,
                    BN: tl.constexpr, BV: tl.constexpr, BH: tl.constexpr):
    pn, pv = tl.program_id(0), tl.program_id(1)
    rows = pn * BN + tl.arange(0, BN)
    cols = pv * BV + tl.arange(0, BV)
    mr = rows < N
    acc = _logit_tile(s_ptr, s_stride, lm_ptr, rows, cols, mr, cols < V, H, BN, BV, BH)
    m = tl.max(acc, 1)
    i = tl.argmax(acc, 1)  # first maximum, as torch.argmax
    tl.store(pmax_ptr + rows * NB + pv, m, mask=mr)
    tl.store(pidx_ptr + rows * NB + pv, pv * BV + i, mask=mr)


@triton.jit
def _pick_refine_in_kernel(pmax_ptr, pidx_ptr, NB, sub_ptr, tok_ptr, tok_stride, col,
                           sp_ptr, sp_stride, cw_ptr, cb_ptr, conf_ptr, conf_stride,
                           zw_ptr, zw_stride, p_ptr, w3_ptr, u_ptr, R, H,
                           BNB: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
                           WANT_CONF: tl.constexpr, REFINE: tl.constexpr, RECURRENT: tl.constexpr):
    n, rb = tl.program_id(0), tl.program_id(1)
    ob = tl.arange(0, BNB)
    pm = tl.load(pmax_ptr + n * NB + ob, mask=ob < NB, other=float("-inf"))
    best = tl.argmax(pm, 0)  # first block holding the maximum: the lowest index among equal logits
    j = tl.load(pidx_ptr + n * NB + best)
    if rb == 0:
        tl.store(tok_ptr + n * tok_stride + col, tl.load(sub_ptr + j))
        if WANT_CONF:
            c = tl.zeros([BH], dtype=tl.float32)
            for h0 in range(0, H, BH):
                oh = h0 + tl.arange(0, BH)
                mh = oh < H
                s = tl.load(sp_ptr + n * sp_stride + oh, mask=mh, other=0.0).to(tl.float32)
                c += s * tl.load(cw_ptr + oh, mask=mh, other=0.0).to(tl.float32)
            c_logit = tl.sum(c, 0) + tl.load(cb_ptr).to(tl.float32)
            tl.store(conf_ptr + n * conf_stride + col, 1.0 / (1.0 + tl.exp(-c_logit)))
    if REFINE:
        _refine_in(zw_ptr + n * zw_stride, p_ptr + j * R, w3_ptr, sp_ptr + n * sp_stride, u_ptr + n * R, R, H, rb,
                   BR, BH, RECURRENT)


@triton.jit
def _refine_in(zw_row, p_row, w3_ptr, sp_row, u_row, R, H, rb, BR: tl.constexpr, BH: tl.constexpr,
               RECURRENT: tl.constexpr):
    """Row block rb of the refiner's first layer u = silu(W1 z + b + P[j] + W3 s_prev) for one draft row: zw_row,
    p_row (P[j]), sp_row (s_prev) and u_row point at that row (the chain's batch row, or a tree node and its
    parent)."""
    orr = rb * BR + tl.arange(0, BR)
    mr = orr < R
    acc = tl.load(zw_row + orr, mask=mr, other=0.0).to(tl.float32)
    acc += tl.load(p_row + orr, mask=mr, other=0.0).to(tl.float32)
    if RECURRENT:
        for h0 in range(0, H, BH):
            oh = h0 + tl.arange(0, BH)
            mh = oh < H
            s = tl.load(sp_row + oh, mask=mh, other=0.0).to(tl.float32)
            w = tl.load(w3_ptr + orr[:, None] * H + oh[None, :], mask=mr[:, None] & mh[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(w * s[None, :], 1)
    tl.store(u_row + orr, acc / (1.0 + tl.exp(-acc)), mask=mr)  # silu


@triton.jit
def _refine_out_kernel(u_ptr, R, wo_ptr, bo_ptr, z_ptr, z_stride, s_ptr, s_stride, H, rep,
                       BH: tl.constexpr, BR: tl.constexpr):
    # rep: rows per slot-state row (a draft tree's level: its rep branches of one batch row share z; the chain: 1)
    n, hb = tl.program_id(0), tl.program_id(1)
    oh = hb * BH + tl.arange(0, BH)
    mh = oh < H
    acc = tl.zeros([BH], dtype=tl.float32)
    for r0 in range(0, R, BR):
        orr = r0 + tl.arange(0, BR)
        mr = orr < R
        u = tl.load(u_ptr + n * R + orr, mask=mr, other=0.0)
        w = tl.load(wo_ptr + oh[:, None] * R + orr[None, :], mask=mh[:, None] & mr[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * u[None, :], 1)
    acc += tl.load(bo_ptr + oh, mask=mh, other=0.0).to(tl.float32)
    acc += tl.load(z_ptr + (n // rep) * z_stride + oh, mask=mh, other=0.0).to(tl.float32)
    tl.store(s_ptr + n * s_stride + oh, acc.to(s_ptr.dtype.element_ty), mask=mh)


class FusedGreedyDraft:
    """DraftHead.draft_greedy over a draft vocabulary, with the refine + readout of each slot in the 3 kernels
    above and the parallel backbone in head_gemm.py's 5 (fuse_backbone=False: PyTorch's 15; None: fused up to 16 rows). Pass it as
    draft_greedy's `readout`. Weights are snapshotted here: build it after the head is trained / loaded."""

    BV, BH, BR = 128, 64, 16

    def __init__(self, head, embed: torch.Tensor, lm_head: torch.Tensor, readout, fuse_backbone: bool | None = None):
        sub, emb_s, lm_s = readout
        H = embed.shape[1]
        W = head.refine_in.weight.detach()
        self.recurrent = head.recurrent
        self.R = W.shape[0]
        self.sub, self.lm_s = sub.to(embed.device), lm_s.contiguous()
        self.w1 = W[:, :H].contiguous()
        self.b1 = head.refine_in.bias.detach()
        # the embedding half of refine_in's input, over the draft vocabulary: one table row per token
        self.P = (emb_s.float() @ W[:, H:2 * H].float().t()).contiguous()
        self.w3 = W[:, 2 * H:3 * H].contiguous() if self.recurrent else self.P  # (unused when not recurrent)
        self.wo = head.refine_out.weight.detach().contiguous()
        self.bo = head.refine_out.bias.detach()
        self.cw = head.conf.weight.detach()[0].contiguous()
        self.cb = head.conf.bias.detach()
        self.V, self.H = lm_s.shape
        # the backbone through head_gemm.py's fused GEMMs (5 launches, not 15); None = only up to 16 rows (R1 of
        # session 5, k=4: batch 1 0.083 -> 0.077 ms, batch 64 0.094 -> 0.124 ms: its 16-64 x 32 tiles lose to cuBLAS)
        self.fuse_backbone = fuse_backbone

    def __call__(self, head, h, x_next, embed, k, want_conf: bool = True):
        k = min(k, head.k)
        fb = self.fuse_backbone if self.fuse_backbone is not None else h.shape[0] <= 16
        z = fused_slots(head, h, x_next, embed) if fb else head.slots(h, embed[x_next])  # [N, k_h, H]
        N, H, R, V, dev = z.shape[0], self.H, self.R, self.V, z.device
        NB = triton.cdiv(V, self.BV)
        BN = 16 if N <= 16 else (32 if N <= 32 else 64)
        toks = torch.empty(N, k, dtype=torch.long, device=dev)
        conf = torch.empty(N, k, dtype=torch.float32, device=dev)
        pmax = torch.empty(N, NB, dtype=torch.float32, device=dev)
        pidx = torch.empty(N, NB, dtype=torch.int32, device=dev)
        u = torch.empty(N, R, dtype=torch.float32, device=dev)
        states = torch.empty(N, k, H, dtype=z.dtype, device=dev)
        zw = F.linear(z, self.w1, self.b1) if k > 1 else u  # [N, k_head, R]: all slots (z[:, 1:k] would copy)
        grid_ro = (triton.cdiv(N, BN), NB)
        prev = z[:, 0]
        _readout_kernel[grid_ro](prev, prev.stride(0), self.lm_s, pmax, pidx, N, V, H, NB,
                                 BN=BN, BV=self.BV, BH=self.BH, num_warps=4)
        for i in range(1, k + 1):
            refine = i < k
            zwi = zw[:, i] if refine else u
            _pick_refine_in_kernel[(N, triton.cdiv(R, self.BR) if refine else 1)](
                pmax, pidx, NB, self.sub, toks, toks.stride(0), i - 1, prev, prev.stride(0), self.cw, self.cb,
                conf, conf.stride(0), zwi, zwi.stride(0), self.P, self.w3, u, R, H,
                BNB=triton.next_power_of_2(NB), BR=self.BR, BH=self.BH * 2, WANT_CONF=want_conf, REFINE=refine,
                RECURRENT=self.recurrent, num_warps=4)
            if refine:
                zi, si = z[:, i], states[:, i]
                _refine_out_kernel[(N, triton.cdiv(H, self.BH))](u, R, self.wo, self.bo, zi, zi.stride(0), si,
                                                                 si.stride(0), H, 1, BH=self.BH, BR=32, num_warps=4)
                prev = si
                _readout_kernel[grid_ro](prev, prev.stride(0), self.lm_s, pmax, pidx, N, V, H, NB,
                                         BN=BN, BV=self.BV, BH=self.BH, num_warps=4)
        return toks, conf if want_conf else None
