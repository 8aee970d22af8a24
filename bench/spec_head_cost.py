"""Device time of one draft-head proposal (what the head adds to a speculative loop step), by batch and k, replayed
from CUDA graphs as HeadGraphs / spec_loop run it: readout over the full vocabulary vs the head's draft vocabulary
(DraftHead.subset_readout; a head without one is timed with the first --subset token ids, for cost only), the
same over the fused kernels of kestrel/spec/head_fused.py (checked against the PyTorch draft first), and the
eager kernel count per proposal (each kernel in a graph also costs a launch gap). Session 3 R2 measured the head
loop step 0.23 ms above the n-gram one at K=4, batch 1; session 4 R1: Triton vs PyTorch norm 0.228 / 0.234 ms.

  python bench/spec_head_cost.py --model smol.gguf --tokenizer tok --head head.safetensors
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kestrel.spec.draft_head import DraftHead  # noqa: E402


def replay_ms(head, embed, lm_head, bs, k, readout=None, reps=200) -> float:
    h = torch.randn(bs, embed.shape[1], device=embed.device, dtype=embed.dtype)
    x = torch.randint(0, embed.shape[0], (bs,), device=embed.device)
    for _ in range(2):
        head.draft_greedy(h, x, embed, lm_head, k, want_conf=False, readout=readout)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        head.draft_greedy(h, x, embed, lm_head, k, want_conf=False, readout=readout)
    for _ in range(10):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def kernels(head, embed, lm_head, k, readout=None) -> int:
    h = torch.randn(1, embed.shape[1], device=embed.device, dtype=embed.dtype)
    x = torch.zeros(1, dtype=torch.long, device=embed.device)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        head.draft_greedy(h, x, embed, lm_head, k, want_conf=False, readout=readout)
        torch.cuda.synchronize()
    return sum(e.count for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)


@torch.inference_mode()
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--head", required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--subset", type=int, default=8192)
    args = ap.parse_args(argv)
    if args.tokenizer:
        import kestrel.model.loader as loader
        from transformers import AutoTokenizer
        loader.load_tokenizer = lambda kind, path: AutoTokenizer.from_pretrained(args.tokenizer)
    from kestrel.model import load_model
    m = load_model(args.model, dtype=getattr(torch, args.dtype), device="cuda", progress=False).model
    embed, lm_head = m.embed_tokens.weight, m.lm_head.weight
    head = DraftHead.load(args.head, device="cuda").to(embed.dtype)
    ks = sorted({1, 4, head.k})
    if head.vocab is None:
        head.vocab = torch.arange(args.subset)
    ro = head.subset_readout(embed, lm_head)
    from kestrel.spec.head_fused import FusedGreedyDraft
    fused = FusedGreedyDraft(head, embed, lm_head, ro, fuse_backbone=True)
    fused_slots_only = FusedGreedyDraft(head, embed, lm_head, ro, fuse_backbone=False)  # PyTorch backbone
    print(f"draft vocabulary {len(head.vocab)} of {embed.shape[0]}")
    # numerics: the PyTorch bf16 draft and the fused bf16 draft, each against the same head in float32 (PyTorch ops,
    # same draft vocabulary) on the same inputs: drafts are greedy chains, so one flipped near-tie changes every
    # later slot of its row; the fused readout keeps fp32 logits where PyTorch rounds them to bf16 first
    g = torch.Generator(device="cuda").manual_seed(0)
    import copy
    h32 = copy.deepcopy(head).float()
    e32, l32 = embed.float(), lm_head.float()
    ro32 = h32.subset_readout(e32, l32)
    for bs in sorted(set(args.batch) | {256}):
        h = torch.randn(bs, embed.shape[1], device="cuda", generator=g).to(embed.dtype)
        x = torch.randint(0, embed.shape[0], (bs,), device="cuda", generator=g)
        ref, cref = h32.draft_greedy(h.float(), x, e32, l32, head.k, readout=ro32)
        a, ca = head.draft_greedy(h, x, embed, lm_head, head.k, readout=ro)
        for name, r in (("fused backbone+slots", fused), ("fused slots", fused_slots_only)):
            b, cb = head.draft_greedy(h, x, embed, lm_head, head.k, readout=r)
            print(f"batch {bs} {name}: vs PyTorch bf16 tokens equal {(a == b).float().mean().item():.4f} (slot 1 "
                  f"{(a[:, 0] == b[:, 0]).float().mean().item():.4f}); vs float32 reference: fused "
                  f"{(b == ref).float().mean().item():.4f} (slot 1 {(b[:, 0] == ref[:, 0]).float().mean().item():.4f}), "
                  f"PyTorch bf16 {(a == ref).float().mean().item():.4f} (slot 1 "
                  f"{(a[:, 0] == ref[:, 0]).float().mean().item():.4f}); rows whose whole chain equals the reference: "
                  f"fused {(b == ref).all(1).float().mean().item():.3f}, PyTorch bf16 "
                  f"{(a == ref).all(1).float().mean().item():.3f}", flush=True)
    print("| batch | k | full-vocab readout ms | draft-vocab readout ms | fused slots, PyTorch backbone ms | fused all ms "
          "| kernels (same order) |\n|---|---|---|---|---|---|---|")
    for bs in args.batch:
        for k in ks:
            row = [(replay_ms(head, embed, lm_head, bs, k, r), kernels(head, embed, lm_head, k, r))
                   for r in (None, ro, fused_slots_only, fused)]
            print(f"| {bs} | {k} | " + " | ".join(f"{t:.3f}" for t, _ in row) + " | "
                  + " / ".join(str(n) for _, n in row) + " |", flush=True)


if __name__ == "__main__":
    main()
