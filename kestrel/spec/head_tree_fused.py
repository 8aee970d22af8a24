"""The draft head's greedy draft tree (DraftHead.draft_tree(nodes=True) over a draft vocabulary) in 3 Triton launches
per level instead of ~12 PyTorch ops.

Why: session 9 R2 timed the tree's levels in PyTorch ops at 0.29 ms per step at batch 1 whatever the widths
(launch-bound) against 0.10 ms for the fused chain k=6 (head_fused.py), which made the tree 4-1-1-1-1-1 lose to the
chain (1.48x vs 1.53x) although it verifies 2.23 tokens per step against 1.84.

Level i holds N * P_i rows (P_0 = 1, P_i = prod(widths[:i])); row r of level i is branch r % P_i of batch row
r // P_i. Per level, the chain's kernels (head_fused.py) with a top-w pick instead of an argmax:
  readout_topw : per (row block, vocabulary block) the w largest logits of s . L_sub and their columns
  pick_topw    : node r' of level i + 1 is child c = r' % w of row r' // w: the c-th largest of its parent's
                 candidates (the order of torch.topk: child 0 is the argmax) -> its token, and the refiner's first
                 layer for it, silu(W1 z + b + P[j] (+ W3 s_parent)), as the chain's pick_refine_in
  refine_out   : s = z + W_out u + b_out, z of the node's batch row (head_fused._refine_out_kernel, rep = P_i)
Proposals only: fp32 logits here, bf16 in the PyTorch path; tests/test_spec_tree_fused.py checks them equal in
float32 under TRITON_INTERPRET=1, bench/spec_tree_gpu_check.py against a float32 reference in bf16 on the GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kestrel.spec.head_fused import FusedGreedyDraft, _logit_tile, _refine_in, _refine_out_kernel
from kestrel.spec.head_gemm import fused_slots


@triton.jit
def _readout_topw_kernel(s_ptr, s_stride, lm_ptr, pval_ptr, pidx_ptr, N, V, H, NC,
                         BN: tl.constexpr, BV: tl.constexpr, BH: tl.constexpr, W: tl.constexpr):
    pn, pv = tl.program_id(0), tl.program_id(1)
    rows = pn * BN + tl.arange(0, BN)
    lc = tl.arange(0, BV)
    cols = pv * BV + lc
    mr = rows < N
    acc = _logit_tile(s_ptr, s_stride, lm_ptr, rows, cols, mr, cols < V, H, BN, BV, BH)
    for t in tl.static_range(W):  # the block's w largest, largest first (each taken out before the next)
        m = tl.max(acc, 1)
        i = tl.argmax(acc, 1)
        tl.store(pval_ptr + rows * NC + pv * W + t, m, mask=mr)
        tl.store(pidx_ptr + rows * NC + pv * W + t, pv * BV + i, mask=mr)
        acc = tl.where(lc[None, :] == i[:, None], float("-inf"), acc)


@triton.jit
def _pick_topw_kernel(pval_ptr, pidx_ptr, NC, V, sub_ptr, node_ptr, n_nodes, off, PN,
                      sp_ptr, sp_stride, zw_ptr, zw_stride, p_ptr, w3_ptr, u_ptr, R, H,
                      W: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
                      REFINE: tl.constexpr, RECURRENT: tl.constexpr):
    r2, rb = tl.program_id(0), tl.program_id(1)  # node row of the new level, refiner row block
    par, c = r2 // W, r2 % W
    oc = tl.arange(0, BC)
    v = tl.load(pval_ptr + par * NC + oc, mask=oc < NC, other=float("-inf"))
    b = tl.argmax(v, 0)
    best = b
    for t in tl.static_range(1, W):  # the c-th largest candidate of the parent: take out the largest c times
        v = tl.where(oc == b, float("-inf"), v)
        b = tl.argmax(v, 0)
        best = tl.where(c >= t, b, best)
    j = tl.minimum(tl.load(pidx_ptr + par * NC + best), V - 1)
    n = r2 // PN  # the node's batch row
    if rb == 0:
        tl.store(node_ptr + n * n_nodes + off + r2 % PN, tl.load(sub_ptr + j))
    if REFINE:  # the node's refiner input: its batch row's slot, its token, its parent's state
        _refine_in(zw_ptr + n * zw_stride, p_ptr + j * R, w3_ptr, sp_ptr + par * sp_stride, u_ptr + r2 * R, R, H,
                   rb, BR, BH, RECURRENT)


class FusedTreeDraft(FusedGreedyDraft):
    """FusedGreedyDraft's weights (draft vocabulary, refiner tables) drafting a greedy tree: tree(...) returns
    DraftHead.draft_tree(..., readout=subset, nodes=True)'s nodes [N, n] with no host syncs (capturable)."""

    def tree(self, head, h, x_next, embed, widths, z=None):
        widths = tuple(widths)[:head.k]
        if z is None:
            fb = self.fuse_backbone if self.fuse_backbone is not None else h.shape[0] <= 16
            z = fused_slots(head, h, x_next, embed) if fb else head.slots(h, embed[x_next])  # [N, k_h, H]
        N, H, R, V, dev = z.shape[0], self.H, self.R, self.V, z.device
        D = len(widths)
        counts = [1]
        for w in widths:
            counts.append(counts[-1] * w)  # rows per batch row at each level (level D: the leaves)
        n_nodes = sum(counts[1:])
        NB = triton.cdiv(V, self.BV)
        Wm = max(widths)
        nodes = torch.empty(N, n_nodes, dtype=torch.long, device=dev)
        pval = torch.empty(N * counts[D - 1] * NB * Wm, dtype=torch.float32, device=dev)
        pidx = torch.empty(N * counts[D - 1] * NB * Wm, dtype=torch.int32, device=dev)
        u = torch.empty(N * max(counts[1:D] or [1]), R, dtype=torch.float32, device=dev)
        zw = F.linear(z, self.w1, self.b1) if D > 1 else u  # [N, k_head, R]: all slots at once
        s = z[:, 0]  # level 0's states: the first slot, one row per batch row
        off = 0
        for i, w in enumerate(widths):
            rows = N * counts[i]
            NC = NB * w
            BN = 16 if rows <= 16 else (32 if rows <= 32 else 64)
            _readout_topw_kernel[(triton.cdiv(rows, BN), NB)](s, s.stride(0), self.lm_s, pval, pidx, rows, V, H, NC,
                                                            BN=BN, BV=self.BV, BH=self.BH, W=w, num_warps=4)
            refine = i + 1 < D
            zwi = zw[:, i + 1] if refine else u
            rows2 = N * counts[i + 1]
            _pick_topw_kernel[(rows2, triton.cdiv(R, self.BR) if refine else 1)](
                pval, pidx, NC, V, self.sub, nodes, n_nodes, off, counts[i + 1], s, s.stride(0), zwi, zwi.stride(0),
                self.P, self.w3, u, R, H, W=w, BC=triton.next_power_of_2(NC), BR=self.BR, BH=self.BH * 2,
                REFINE=refine, RECURRENT=self.recurrent, num_warps=4)
            off += counts[i + 1]
            if refine:
                zi = z[:, i + 1]
                s = torch.empty(rows2, H, dtype=z.dtype, device=dev)
                _refine_out_kernel[(rows2, triton.cdiv(H, self.BH))](u, R, self.wo, self.bo, zi, zi.stride(0), s,
                                                                     s.stride(0), H, counts[i + 1], BH=self.BH,
                                                                     BR=32, num_warps=4)
        return nodes
