"""Draft-tree verification pieces (kestrel/spec/tree.py) against independent references: the tree attention mask of
the paged prefill kernel vs dense float64 attention over each node's own root-to-node sequence, the accept step vs
a brute-force walk of every path, and the KV compaction of an accepted path. Kernels under TRITON_INTERPRET=1."""
import itertools
import math

import pytest
import torch

from kestrel.kernels.attention import paged_prefill_attention, store_kvcache
from kestrel.kernels.attention.torch_paged import torch_paged_prefill_attention
from kestrel.spec.tree import KVCompactor, TreeShape, tree_accept


def test_tree_shape_layout():
    t = TreeShape((2, 3, 1))
    assert t.n == 2 + 6 + 6 and t.D == 3
    assert t.parent[:3] == [-1, 0, 0] and t.parent[3:9] == [1, 1, 1, 2, 2, 2] and t.parent[9:] == list(range(3, 9))
    assert t.depth == [0, 1, 1] + [2] * 6 + [3] * 6
    for j in range(t.n + 1):  # bits = exactly the rows on the walk up from j
        up, x = set(), j
        while x >= 0:
            up.add(x)
            x = t.parent[x]
        assert {i for i in range(t.n + 1) if (t.bits[j] >> i) & 1} == up
        assert [t.depth[x] for x in t.anc_at[j][:t.depth[j] + 1]] == list(range(t.depth[j] + 1))
    assert TreeShape.parse("4-2-1-1-1-1").n == 44
    # an n-gram branch: a chain off the root after the head's levels, deeper than them here
    t = TreeShape.parse("2-1+3")
    assert (t.n_head, t.n, t.D, t.widths, t.ngram) == (4, 7, 3, (2, 1), (3,))
    assert t.parent[5:] == [0, 5, 6] and t.depth[5:] == [1, 2, 3]
    assert t.anc_at[7] == [0, 5, 6, 7] and t.anc_at[3] == [0, 1, 3, 3]
    assert {i for i in range(8) if (t.bits[7] >> i) & 1} == {0, 5, 6, 7}
    t = TreeShape.parse("2-1+3+2")  # a second n-gram branch after the first
    assert (t.n, t.D, t.ngram) == (9, 3, (3, 2)) and t.parent[8:] == [0, 8] and t.depth[8:] == [1, 2]


def _dense_ref(q, k, v, scale):
    """q [Hq, D] one query; k, v [L, Hkv, D] the keys it sees. float64."""
    hq, hkv = q.shape[0], k.shape[1]
    k = k.double().repeat_interleave(hq // hkv, 1)
    v = v.double().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("hd,nhd->hn", q.double(), k) * scale
    return torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v)


@pytest.mark.parametrize("torch_form", [False, True], ids=["triton", "torch"])
def test_tree_attention_matches_per_path_reference(torch_form):
    """The tree mask in the kernel and in its torch form (what a CPU engine's verify runs, torch_paged.py)."""
    gen = torch.Generator().manual_seed(0)
    t = TreeShape((3, 2, 1))
    S, Hq, Hkv, D, bs = t.n + 1, 4, 2, 16, 4
    ctxs = [5, 0, 13]  # cached tokens before the chunk per sequence
    nblk = [math.ceil((c + S) / bs) for c in ctxs]
    perm = torch.randperm(sum(nblk) + 2, generator=gen)
    kc = torch.randn(sum(nblk) + 2, bs, Hkv, D, generator=gen)
    vc = torch.randn_like(kc)
    tables = torch.zeros(len(ctxs), max(nblk), dtype=torch.int32)
    i = 0
    for b, nb in enumerate(nblk):
        tables[b, :nb] = perm[i:i + nb].to(torch.int32)
        i += nb
    T = len(ctxs) * S
    k = torch.randn(T, Hkv, D, generator=gen)
    v = torch.randn(T, Hkv, D, generator=gen)
    q = torch.randn(T, Hq, D, generator=gen)
    slots = torch.cat([tables[b, (c + torch.arange(S)) // bs].long() * bs + (c + torch.arange(S)) % bs
                       for b, c in enumerate(ctxs)])
    store_kvcache(k, v, kc, vc, slots)
    cu = torch.arange(len(ctxs) + 1, dtype=torch.int32) * S
    seq_lens = torch.tensor([c + S for c in ctxs], dtype=torch.int32)
    mask = torch.tensor(t.bits, dtype=torch.int64).repeat(len(ctxs))
    scale = D ** -0.5
    attend = torch_paged_prefill_attention if torch_form else paged_prefill_attention
    out = attend(q, kc, vc, tables, cu, seq_lens, scale, max_q_len=S, tree_mask=mask)
    causal = paged_prefill_attention(q, kc, vc, tables, cu, seq_lens, scale, max_q_len=S)
    for b, c in enumerate(ctxs):
        pos = torch.arange(c)
        ck, cv = kc[tables[b, pos // bs].long(), pos % bs], vc[tables[b, pos // bs].long(), pos % bs]
        for j in range(S):
            anc = [x for x in range(S) if (t.bits[j] >> x) & 1]  # root .. j
            r = b * S + j
            ref = _dense_ref(q[r], torch.cat([ck, k[b * S + torch.tensor(anc)]]),
                             torch.cat([cv, v[b * S + torch.tensor(anc)]]), scale)
            assert (out[r].double() - ref).abs().max() < 1e-4, (b, j)
    assert (out - causal).abs().max() > 1e-2  # the mask is not the causal one


@pytest.mark.parametrize("shape", ["3-2-1-1", "3-2-1+5", "3-2-1+5+2"])
def test_tree_accept_matches_brute_force(shape):
    gen = torch.Generator().manual_seed(1)
    t = TreeShape.parse(shape)
    S, B = t.n + 1, 400
    parent, depth, _, anc = t.tensors("cpu")
    tokens = torch.randint(0, 3, (B, S), generator=gen)  # tiny vocab: many matches, duplicate siblings too
    top = torch.randint(0, 3, (B, S), generator=gen)
    a, path, emitted, leaf, chain = tree_accept(tokens, top, t, parent, depth, anc,
                                                first_path=torch.tensor(t.first_path))
    # the first-choice path: child 0 of child 0 ... (the head's greedy chain), one node per head level
    assert [t.parent[x] for x in t.first_path] == [0] + t.first_path[:-1]
    assert [t.depth[x] for x in t.first_path] == list(range(1, len(t.widths) + 1))
    deep = 0
    for b in range(B):
        best = (0, 0)  # (depth, -row) of the deepest valid node, lowest row first
        for j in range(1, S):
            x, ok = j, True
            while x > 0:
                ok &= bool(tokens[b, x] == top[b, t.parent[x]])
                x = t.parent[x]
            if ok and (t.depth[j], -j) > (best[0], -best[1]):
                best = (t.depth[j], j)
        assert int(a[b]) == best[0] and int(leaf[b]) == best[1]
        p = t.anc_at[best[1]]
        assert path[b].tolist() == p
        # emitted: the greedy tokens along the path (drafts equal them up to depth a)
        assert emitted[b, :best[0] + 1].tolist() == [int(top[b, p[d]]) for d in range(best[0] + 1)]
        assert all(int(tokens[b, p[d]]) == int(emitted[b, d - 1]) for d in range(1, best[0] + 1))
        deep += best[0] >= 2
        c = 0  # what a chain step with the first-choice drafts accepts: its leading matches
        while c < len(t.first_path) and int(tokens[b, t.first_path[c]]) == int(top[b, t.parent[t.first_path[c]]]):
            c += 1
        assert int(chain[b]) == c
    assert deep > 10
    assert 0 < int((chain < a).sum()) < B  # the tree's other branches beat the chain in some rows, not all
    assert torch.equal(tree_accept(tokens, top, t, parent, depth, anc)[0], a)  # without first_path: the 4 outputs


def test_kv_compact_moves_the_path_in_every_cache():
    gen = torch.Generator().manual_seed(2)
    caches = [torch.randn(6, 4, 2, 8, generator=gen) for _ in range(3)]
    vcaches = [torch.randn(6, 4, 2, 8, generator=gen) for _ in range(3)]
    before = [c.clone() for c in caches + vcaches]
    # row 0: moves 9 -> 1, 12 -> 2, 2 -> 2 (skip); row 1: -1 (nothing), 20 -> 17
    src = torch.tensor([[9, 12, 2], [-1, 20, -1]])
    dst = torch.tensor([[1, 2, 2], [16, 17, 18]])
    KVCompactor(caches, vcaches)(src, dst)
    for c, c0 in zip(caches + vcaches, before):
        f, f0 = c.view(-1, 16), c0.view(-1, 16)
        want = f0.clone()
        for s, d in [(9, 1), (12, 2), (20, 17)]:
            want[d] = f0[s]
        assert torch.equal(f, want)


def test_kv_compact_triton_kernel_matches_torch():
    """The Triton kernel (pointer table over the layers' caches) under the interpreter vs the torch moves."""
    import kestrel.spec.tree as tree

    gen = torch.Generator().manual_seed(3)
    a = [torch.randn(5, 4, 2, 8, generator=gen) for _ in range(4)]
    b = [x.clone() for x in a]
    src = torch.tensor([[7, 9, 3], [12, -1, 14]])
    dst = torch.tensor([[1, 2, 3], [10, 11, 12]])
    KVCompactor(a[:2], a[2:])(src, dst)
    c = KVCompactor(b[:2], b[2:])
    c.triton = True
    c(src, dst)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and tree is not None
