"""GPU correctness of the draft-tree pieces (kestrel/spec/tree.py) in the dtypes the loop runs: the paged prefill
kernel's tree mask vs dense float64 attention over each node's own root-to-node keys, and KVCompactor's
pointer-table Triton kernel vs the same moves in torch; with --time-head, the fused tree drafter
(head_tree_fused.py) vs the PyTorch one against a float32 reference and the tree step's parts timed in CUDA graphs.
Prints max errors / agreement; exits 1 on a failure.

  python bench/spec_tree_gpu_check.py --tree 4-2-1-1-1-1 --time-head head.safetensors
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
    from kestrel.spec.head_tree_fused import FusedTreeDraft
    from kestrel.spec.tree import tree_accept

    dev, dt = "cuda", torch.bfloat16
    head = DraftHead.load(head_path, dev).to(dt)
    embed = (torch.randn(V, H, device=dev) * 0.02).to(dt)
    sub = head.subset_readout(embed, embed)
    fused = FusedGreedyDraft(head, embed, embed, sub)
    h = torch.randn(1, H, device=dev, dtype=dt)
    x = torch.tensor([5], device=dev)
    tfused = FusedTreeDraft(head, embed, embed, sub)
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
        ms_f = _graph_ms(lambda: tfused.tree(head, h, x, embed, t.widths, z=z))
        ms_fb = _graph_ms(lambda: tfused.tree(head, h, x, embed, t.widths))
        print(f"tree {tr} ({t.n} nodes): draft levels (backbone given) PyTorch {ms:.3f} ms, fused {ms_f:.3f} ms; "
              f"fused with its backbone {ms_fb:.3f} ms; accept {ms_a:.3f} ms")


@torch.inference_mode()
def fused_tree_check(head_path: str, trees, V=49152, H=576, dev="cuda", low=torch.bfloat16) -> bool:
    """The fused tree drafter (head_tree_fused.py) against the PyTorch one in bf16 on the GPU, both scored against
    a float32 PyTorch reference (the proposals need not match bit for bit, only be as close): the share of nodes
    equal to the reference's, at batch 1 and 64 (SmolLM2-shaped random embedding, the real head's weights).
    Fails when the fused drafts are clearly further from the reference than the PyTorch bf16 ones."""
    from kestrel.spec.draft_head import DraftHead
    from kestrel.spec.head_tree_fused import FusedTreeDraft

    g = torch.Generator(device="cpu").manual_seed(3)
    ref_head = DraftHead.load(head_path, dev).float()
    head = DraftHead.load(head_path, dev).to(low)
    embed32 = (torch.randn(V, H, generator=g) * 0.05).to(dev)
    embed = embed32.to(low)
    embed32 = embed.float()  # the same values in both
    sub32, sub = ref_head.subset_readout(embed32, embed32), head.subset_readout(embed, embed)
    tf = FusedTreeDraft(head, embed, embed, sub)
    ok = True
    for tr in trees:
        t = TreeShape.parse(tr)
        for N in (1, 64):
            hs = torch.randn(N, H, generator=g).to(dev) * 2.0
            x = torch.randint(0, V, (N,), generator=g).to(dev)
            ref = ref_head.draft_tree(hs, x, embed32, embed32, t.widths, readout=sub32, nodes=True)
            pt = head.draft_tree(hs.to(low), x, embed, embed, t.widths, readout=sub, nodes=True)
            fu = tf.tree(head, hs.to(low), x, embed, t.widths)
            w0 = t.widths[0]
            a_pt, a_fu = (pt == ref).float().mean().item(), (fu == ref).float().mean().item()
            l0_pt, l0_fu = ((pt[:, :w0] == ref[:, :w0]).float().mean().item(),
                            (fu[:, :w0] == ref[:, :w0]).float().mean().item())
            good = a_fu >= a_pt - 0.05 and bool(torch.isin(fu, sub[0]).all())
            ok &= good
            print(f"fused tree {tr} batch {N}: nodes equal to the fp32 reference: fused {a_fu:.3f}, PyTorch bf16 "
                  f"{a_pt:.3f} (level 0: {l0_fu:.3f} / {l0_pt:.3f}); fused == PyTorch bf16 "
                  f"{(fu == pt).float().mean().item():.3f} ({'ok' if good else 'FAIL'})")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", nargs="+", default=["4-2-1-1-1-1", "2-1-1-1-1-1", "8-2-1-1"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--time-head", default=None, help="a draft head: also check the fused tree drafter against the "
                    "PyTorch one and time the tree step's parts (CUDA graphs)")
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
    if args.time_head:
        ok &= fused_tree_check(args.time_head, args.tree)
    print("ALL OK" if ok else "FAILURES")
    if args.time_head:
        time_parts(args.time_head, args.tree)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
