"""GPU correctness of the draft-tree pieces (kestrel/spec/tree.py) in the dtypes the loop runs: the paged prefill
kernel's tree mask vs dense float64 attention over each node's own root-to-node keys, and KVCompactor's
pointer-table Triton kernel vs the same moves in torch. Prints max errors; exits 1 on a failure.

  python bench/spec_tree_gpu_check.py --tree 4-2-1-1-1-1
"""
from __future__ import annotations

import argparse
import sys

import torch

from kestrel.kernels.attention import paged_prefill_attention, store_kvcache
from kestrel.spec.tree import KVCompactor, TreeShape


def attention_check(t: TreeShape, dtype, dev, B=5, Hq=9, Hkv=3, D=64, bs=16) -> float:
    g = torch.Generator(device="cpu").manual_seed(0)
    S = t.n + 1
    ctxs = [0, 7, 100, 333, 64][:B]
    nb = [-(-(c + S) // bs) for c in ctxs]
    perm = torch.randperm(sum(nb) + 3, generator=g)
    kc = torch.randn(sum(nb) + 3, bs, Hkv, D, generator=g).to(dev, dtype)
    vc = torch.randn_like(kc)
    tables = torch.zeros(B, max(nb), dtype=torch.int32)
    i = 0
    for b, n in enumerate(nb):
        tables[b, :n] = perm[i:i + n].to(torch.int32)
        i += n
    tables = tables.to(dev)
    T = B * S
    k, v = (torch.randn(T, Hkv, D, generator=g).to(dev, dtype) for _ in range(2))
    q = torch.randn(T, Hq, D, generator=g).to(dev, dtype)
    ar = torch.arange(S, device=dev)
    slots = torch.cat([tables[b, (c + ar) // bs].long() * bs + (c + ar) % bs for b, c in enumerate(ctxs)])
    store_kvcache(k, v, kc, vc, slots)
    cu = (torch.arange(B + 1, dtype=torch.int32) * S).to(dev)
    seq_lens = torch.tensor([c + S for c in ctxs], dtype=torch.int32, device=dev)
    mask = torch.tensor(t.bits, dtype=torch.int64, device=dev).repeat(B)
    out = paged_prefill_attention(q, kc, vc, tables, cu, seq_lens, D ** -0.5, max_q_len=S, tree_mask=mask)
    worst = 0.0
    for b, c in enumerate(ctxs):
        p = torch.arange(c, device=dev)
        blk = tables[b, p // bs].long()
        ck, cv = kc[blk, p % bs], vc[blk, p % bs]
        for j in range(S):
            anc = torch.tensor([x for x in range(S) if (t.bits[j] >> x) & 1], device=dev) + b * S
            kk = torch.cat([ck, k[anc]]).double().repeat_interleave(Hq // Hkv, 1)
            vv = torch.cat([cv, v[anc]]).double().repeat_interleave(Hq // Hkv, 1)
            s = torch.einsum("hd,nhd->hn", q[b * S + j].double(), kk) * D ** -0.5
            ref = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vv)
            worst = max(worst, (out[b * S + j].double() - ref).abs().max().item())
    return worst


def compact_check(dtype, dev, layers=30) -> bool:
    g = torch.Generator(device="cpu").manual_seed(1)
    a = [torch.randn(40, 16, 3, 64, generator=g).to(dev, dtype) for _ in range(2 * layers)]
    b = [x.clone() for x in a]
    src = torch.tensor([[17, 25, 3, -1, 40, 41], [100, 101, 102, 103, -1, -1]], device=dev)
    dst = torch.tensor([[1, 2, 3, 4, 5, 6], [90, 91, 92, 93, 94, 95]], device=dev)
    KVCompactor(a[:layers], a[layers:])(src, dst)  # the Triton kernel (CUDA)
    c = KVCompactor(b[:layers], b[layers:])
    c.triton = False  # the torch moves
    c(src, dst)
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _graph_ms(fn, reps=200) -> float:
    """Device ms of one replay of fn captured in a CUDA graph (as the loop runs it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / reps


@torch.inference_mode()
def time_parts(head_path: str, trees, V=49152, H=576) -> None:
    """Where a tree step's time goes at batch 1 (timing only: random target embedding / lm_head of SmolLM2's shape,
    the real head's weights): fused chain k=6 vs the PyTorch tree drafting, and the accept step."""
    from kestrel.spec.draft_head import DraftHead
    from kestrel.spec.head_fused import FusedGreedyDraft
    from kestrel.spec.head_gemm import fused_slots
    from kestrel.spec.tree import tree_accept

    dev, dt = "cuda", torch.bfloat16
    head = DraftHead.load(head_path, dev).to(dt)
    embed = (torch.randn(V, H, device=dev) * 0.02).to(dt)
    sub = head.subset_readout(embed, embed)
    fused = FusedGreedyDraft(head, embed, embed, sub)
    h = torch.randn(1, H, device=dev, dtype=dt)
    x = torch.tensor([5], device=dev)
    print(f"fused chain k=6 draft: {_graph_ms(lambda: head.draft_greedy(h, x, embed, embed, 6, False, fused)):.3f} ms")
    print(f"fused backbone (fused_slots): {_graph_ms(lambda: fused_slots(head, h, x, embed)):.3f} ms")
    for tr in trees:
        t = TreeShape.parse(tr)
        z = fused_slots(head, h, x, embed)
        ms = _graph_ms(lambda: head.draft_tree(h, x, embed, embed, t.widths, readout=sub, nodes=True, z=z))
        parent, depth, _, anc = t.tensors(dev)
        tok = torch.randint(0, 50, (1, t.n + 1), device=dev)
        top = torch.randint(0, 50, (1, t.n + 1), device=dev)
        ms_a = _graph_ms(lambda: tree_accept(tok, top, t, parent, depth, anc))
        print(f"tree {tr} ({t.n} nodes): draft levels (PyTorch, backbone given) {ms:.3f} ms, accept {ms_a:.3f} ms")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", nargs="+", default=["4-2-1-1-1-1", "2-1-1-1-1-1", "8-2-1-1"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--time-head", default=None, help="a draft head: also time the tree step's parts (CUDA graphs)")
    args = ap.parse_args()
    dev = args.device
    ok = True
    for dtype, tol in ((torch.bfloat16 if dev == "cuda" else torch.float16, 3e-2), (torch.float32, 5e-3)):
        for tr in args.tree:
            err = attention_check(TreeShape.parse(tr), dtype, dev)
            print(f"tree attention {tr} {dtype}: max |err| vs float64 {err:.2e} ({'ok' if err < tol else 'FAIL'})")
            ok &= err < tol
        c = compact_check(dtype, dev)
        print(f"kv compaction {dtype}: Triton == torch: {c}")
        ok &= c
    print("ALL OK" if ok else "FAILURES")
    if args.time_head:
        time_parts(args.time_head, args.tree)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
