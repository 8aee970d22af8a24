"""Draft trees for greedy tree verification in the device loop (spec_loop.py): the static shape of a tree, the
accept step (longest root-to-leaf path the target agrees with) and the KV compaction of the accepted path.

Why a tree: the draft head's first slot is accepted only ~49% of the time on chat prompts (bench/results/
spec_decode.md, session 8); verifying its top 4 first tokens (and top 2 under each) lifts that to ~71% and the
offline walk from 1.88 to 2.42 tokens per verify, while a 45-token verify costs ~0.1 ms more than a 5-token one at
batch 1 (launch-bound forward).

Layout (`TreeShape(widths)`): chunk row 0 is the root (the last emitted token, not cached yet), then the nodes level
by level; level i holds prod(widths[:i+1]) nodes, node c of level i is child c % widths[i] of node c // widths[i] of
level i-1 (DraftHead.draft_tree(nodes=True) order); an optional n-gram branch (a chain off the root) follows. Chunk row j is stored at cache position ctx + j and gets RoPE
position ctx + depth(j); attention sees the cached context plus its ancestors (the prefill kernel's tree_mask).

Greedy only: a node is valid when its token is the target's argmax after its parent and its parent is valid, so
every valid node's path is what plain greedy decoding emits; the deepest valid node (ties: the lowest row) wins,
and the tokens emitted are the target's argmax along its path (its a drafts + the bonus token). The accepted
nodes' K/V then move from ctx + row to ctx + depth (kv_compact), so the cache holds exactly the greedy sequence.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


class TreeShape:
    """widths: the head's levels; ngram: the lengths of up to two more branches off the root after them (rows
    n_head + 1 .. n), filled with the n-gram lookup's draft (prompt lookup: free candidates where the text repeats
    itself) and, second, the latest match continuing with another first token (ngram_draft_device(exclude=))."""

    def __init__(self, widths, ngram=()):
        self.widths = tuple(int(w) for w in widths)
        self.ngram = tuple(int(x) for x in ((ngram,) if isinstance(ngram, int) else ngram) if int(x))
        if not self.widths or min(self.widths) < 1 or min(self.ngram, default=1) < 1 or len(self.ngram) > 2:
            raise ValueError(f"tree widths must be positive, at most two n-gram branches, got {widths}, {ngram}")
        parent, depth = [-1], [0]  # row 0: the root
        prev = [0]
        self.first_path = []  # the first-choice node of every head level: the chain's own drafts (child 0 = argmax)
        for i, w in enumerate(self.widths):
            self.first_path.append(len(parent))
            level = []
            for c in range(len(prev) * w):
                level.append(len(parent))
                parent.append(prev[c // w])
                depth.append(i + 1)
            prev = level
        self.n_head = len(parent) - 1
        for m in self.ngram:
            for d in range(m):  # an n-gram chain: root -> first -> ...
                parent.append(0 if d == 0 else len(parent) - 1)
                depth.append(d + 1)
        self.n = len(parent) - 1  # draft nodes (rows = n + 1)
        if self.n + 1 > 64:
            raise ValueError(f"a tree of {self.n + 1} rows exceeds the 64 of one mask word")
        self.D = max([len(self.widths), *self.ngram])
        self.parent, self.depth = parent, depth
        # ancestor-or-self bits per row, and the ancestor of every row at each depth (the row itself below it)
        bits, anc_at = [], []
        for j in range(self.n + 1):
            chain, x = [], j
            while x >= 0:
                chain.append(x)
                x = parent[x]
            chain.reverse()  # root .. j
            bits.append(sum(1 << x for x in chain))
            anc_at.append([chain[min(d, len(chain) - 1)] for d in range(self.D + 1)])
        self.bits = [b - (1 << 64) if b >= 1 << 63 else b for b in bits]  # int64 two's complement
        self.anc_at = anc_at

    @staticmethod
    def parse(text: str) -> "TreeShape":
        """'4-2-1-1-1-1' -> TreeShape((4, 2, 1, 1, 1, 1)); '4-1-1-1-1-1+6': and an n-gram branch of 6; '...+6+4':
        and a second one of 4."""
        head, *ng = text.split("+")
        return TreeShape([int(x) for x in head.replace("x", "-").split("-") if x], [int(x) for x in ng])

    def tensors(self, device):
        """(parent [n+1] (root: 0), depth [n+1], bits [n+1] int64, anc_at [n+1, D+1]) on `device`."""
        return (torch.tensor([max(p, 0) for p in self.parent], device=device),
                torch.tensor(self.depth, device=device),
                torch.tensor(self.bits, dtype=torch.int64, device=device),
                torch.tensor(self.anc_at, device=device))


def tree_accept(tokens: torch.Tensor, top: torch.Tensor, shape: TreeShape, parent: torch.Tensor,
                depth: torch.Tensor, anc_at: torch.Tensor, first_path: torch.Tensor | None = None):
    """tokens [B, n+1] (column 0 the root), top [B, n+1] the target's argmax at every row. Returns (a [B] drafts
    accepted, path [B, D+1] rows of the accepted path by depth (past a: the leaf), emitted [B, D+1] = top along
    the path, valid for the first a + 1, leaf [B]) and, given first_path (TreeShape.first_path's rows), chain [B]:
    the drafts the first-choice path alone would have had accepted, i.e. what a chain step of the same head accepts
    (the loop's cost model learns the chains' survival from tree steps with it). No host syncs (capturable)."""
    B, S = tokens.shape
    rows = torch.arange(S, device=tokens.device)
    # node agrees with its parent's argmax (the root always "agrees"); valid = all of its path agrees: one gather
    # over anc_at (a row's entries past its depth repeat the row itself) instead of a pass per level (fewer launches)
    ok = (tokens == top.gather(1, parent[None, :].expand(B, S))) | (rows == 0)[None, :]
    valid = ok.gather(1, anc_at.reshape(1, -1).expand(B, -1)).view(B, S, -1).all(-1)
    score = torch.where(valid, depth[None, :] * S + (S - 1 - rows)[None, :], -1)
    leaf = score.argmax(1)
    a = depth[leaf]
    path = anc_at[leaf]
    if first_path is None:
        return a, path, top.gather(1, path), leaf
    return a, path, top.gather(1, path), leaf, valid[:, first_path].sum(1)  # valid is hereditary: the prefix depth


@triton.jit
def _kv_compact_kernel(ptrs, src_ptr, dst_ptr, D, ROW: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    cache = tl.program_id(0)  # one of the 2 * layers K / V caches
    b = tl.program_id(1)  # one batch row: its D moves in order (below)
    base = tl.load(ptrs + cache).to(tl.pointer_type(DTYPE))
    offs = tl.arange(0, BLOCK)
    m = offs < ROW
    for d in range(D):
        src = tl.load(src_ptr + b * D + d)
        dst = tl.load(dst_ptr + b * D + d)
        if (src >= 0) & (dst >= 0) & (src != dst):
            x = tl.load(base + src * ROW + offs, mask=m)
            tl.store(base + dst * ROW + offs, x, mask=m)
            tl.debug_barrier()  # keep the moves of this row in order (see KVCompactor)


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


class KVCompactor:
    """Moves cache slots src[b, d] -> dst[b, d] in every layer's K and V cache in one launch (the caches are
    separate tensors: their base addresses go in as a table). Moves with src < 0 or src == dst are skipped. A tree
    path's moves (depth d: row path[d] -> position d, path[d] >= d) run in increasing d within a batch row: move d
    writes slot d, which only an earlier move can read (later ones read rows path[d'] >= d' > d), so in order no
    move reads a slot already overwritten."""

    def __init__(self, k_caches, v_caches):
        caches = list(k_caches) + list(v_caches)
        c = caches[0]
        self.caches = caches
        self.row = c.shape[-2] * c.shape[-1]
        self.dtype = c.dtype
        self.ptrs = torch.tensor([x.data_ptr() for x in caches], dtype=torch.int64, device=c.device)
        self.triton = c.is_cuda

    def __call__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        B, D = src.shape
        if not self.triton:  # CPU (tests): the same moves through torch, all reads before the writes
            keep = ((src >= 0) & (dst >= 0) & (src != dst)).reshape(-1)
            s, d = src.reshape(-1)[keep], dst.reshape(-1)[keep]
            for x in self.caches:
                flat = x.view(-1, self.row)
                flat[d] = flat[s].clone()
            return
        _kv_compact_kernel[(len(self.caches), B)](self.ptrs, src.contiguous(), dst.contiguous(), D, ROW=self.row,
                                                  BLOCK=triton.next_power_of_2(self.row), DTYPE=_TL[self.dtype])
