"""Where the extra device time of a speculative loop step goes (issue #6: a K>0 step costs ~0.35 ms more than K=0
at batch 1 on the H200, K=2 even more), by kernel.

1. Device ms per replay of the loop's captured (batch, K) step graphs (what spec_loop.py runs; n-gram drafter),
   one active row at a ~300-token context (CUDA events around back-to-back replays).
2. The same step run eagerly under torch.profiler: device µs per step and kernel count, by kernel, for each K, and
   the difference to K=0 by kernel class (GEMM / attention / KV store / norm / other). In a graph every kernel
   also costs a launch gap, so the kernel count matters as much as their time.
(R1 of session 3 also timed F.linear alone at the model's shapes: cuBLAS is flat over M = 1..8, 4-5 µs per
projection, 17 µs for the vocabulary readout, and a Triton small-M kernel was no faster: the GEMMs are not it.)
Part 1 also times the same loop captured with PyTorch's rotary / silu*mul ops (kernels/rope_silu.py ENABLED off).

  python bench/spec_verify_profile.py --model $SMOL_GGUF --tokenizer $SMOL_TOK --out step_profile.md
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kestrel.engine.config import EngineConfig  # noqa: E402
from kestrel.engine.llm_engine import LLMEngine  # noqa: E402
from kestrel.spec.config import parse_speculative  # noqa: E402
from kestrel.spec.factory import build_drafter  # noqa: E402
from kestrel.spec.spec_loop import SpecLoop  # noqa: E402

CLASSES = [("gemm", ("gemm", "gemv", "cutlass", "sm90", "sm80", "xmma", "cublas", "splitk", "nvjet")),
           ("attention", ("_prefill_kernel", "_decode_kernel", "reduce_splits")), ("kv store", ("store_kvcache",)),
           ("rmsnorm", ("rms",)), ("argmax/reduce", ("argmax", "reduce", "cumprod", "scan"))]


def kclass(name: str) -> str:
    n = name.lower()
    return next((c for c, keys in CLASSES if any(k in n for k in keys)), "other")


def setup_row(loop: SpecLoop, ctx_len: int, bs: int) -> None:
    """bs active rows at a ctx_len-token context, distinct KV blocks (contents irrelevant for timing)."""
    g = torch.Generator(device=loop.dev).manual_seed(0)
    loop.hist[:bs, :ctx_len].copy_(torch.randint(1000, 2000, (bs, ctx_len), generator=g, device=loop.dev))
    loop.length[:bs].fill_(ctx_len)
    nb = loop.W
    loop.block_tables[:bs].copy_(torch.arange(bs * nb, dtype=torch.int32, device=loop.dev).view(bs, nb)
                                 % loop.k_caches[0].shape[0])
    loop.active[:bs].fill_(True)


def reset_len(loop: SpecLoop, ctx_len: int, bs: int) -> None:
    loop.length[:bs].fill_(ctx_len)  # the step advances lengths: keep the context fixed between runs


def graph_ms(loop, bs, K, ctx_len, reps=50) -> float:
    ev = lambda: torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(3):
        reset_len(loop, ctx_len, bs)
        a, b = ev(), ev()
        a.record()
        for _ in range(reps):
            loop.graphs[(bs, K)].replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / reps)
    return sorted(ts)[1]


def profile_step(loop, bs, K, ctx_len, reps=10) -> dict:
    """{kernel name: (device µs per step, launches per step)} of the eager step."""
    for _ in range(3):
        reset_len(loop, ctx_len, bs)
        loop._step(bs, K)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            reset_len(loop, ctx_len, bs)
            loop._step(bs, K)
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        us = e.cuda_time_total if us is None else us
        if us > 0 and e.count:
            out[e.key] = (us / reps, e.count / reps)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tokenizer:
        import kestrel.model.loader as loader
        from transformers import AutoTokenizer
        loader.load_tokenizer = lambda kind, path: AutoTokenizer.from_pretrained(args.tokenizer)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, device="cuda", dtype=args.dtype, max_num_seqs=64,
                                    kv_cache_gb=1.0, enable_prefix_caching=False, progress=False, cuda_graphs=False))
    from kestrel.kernels import rope_silu
    from kestrel.spec.train_draft import _CausalCtx
    with torch.inference_mode():  # the fused kernels must give the PyTorch ops' numbers (same rounding)
        ids = torch.randint(1000, 20000, (96,), device="cuda")
        pos = torch.arange(96, device="cuda")
        h1 = engine.model(ids, pos, _CausalCtx())
        rope_silu.ENABLED = False
        h0 = engine.model(ids, pos, _CausalCtx())
        rope_silu.ENABLED = True
        same = (engine.model.compute_logits(h1).argmax(-1) == engine.model.compute_logits(h0).argmax(-1)).float().mean()
    lines0 = [f"fused rotary/silu*mul vs PyTorch ops, 96-token forward: max |hidden diff| "
              f"{(h1.float() - h0.float()).abs().max().item():.3g}, same argmax {same.item():.3f}"]
    print(lines0[0], flush=True)
    cfg = parse_speculative("drafter=ngram,k=4")
    drafter = build_drafter(cfg, engine)
    loop = SpecLoop(engine.runner, drafter, "ngram", args.ks, [1, 64], engine.max_model_len)
    setup_row(loop, args.ctx, 64)
    loop.capture()
    setup_row(loop, args.ctx, 64)
    rope_silu.ENABLED = False  # the same loop with PyTorch's rotary / silu*mul ops (before kernels/rope_silu.py)
    torch_ops = SpecLoop(engine.runner, drafter, "ngram", args.ks, [1, 64], engine.max_model_len)
    torch_ops.capture()
    rope_silu.ENABLED = True
    setup_row(torch_ops, args.ctx, 64)
    lines = lines0 + [f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, SmolLM2-135M {args.dtype}, "
             f"context {args.ctx}, n-gram loop step (ready in {time.perf_counter() - t0:.1f}s)", "",
             "| batch | K | graph device ms/step | same with PyTorch rotary + silu*mul ops |", "|---|---|---|---|"]
    ks = [0] + args.ks
    for bs in (1, 64):
        for K in ks:
            lines.append(f"| {bs} | {K} | {graph_ms(loop, bs, K, args.ctx):.3f} | {graph_ms(torch_ops, bs, K, args.ctx):.3f} |")
            print(lines[-1], flush=True)

    prof = {K: profile_step(loop, 1, K, args.ctx) for K in ks}
    lines += ["", "Eager step at batch 1 under torch.profiler, by kernel class: device µs per step (launches)", "",
              "| K | " + " | ".join(c for c, _ in CLASSES) + " | other | total |", "|---" * (len(CLASSES) + 3) + "|"]
    for K in ks:
        cls = defaultdict(lambda: [0.0, 0.0])
        for name, (us, n) in prof[K].items():
            c = cls[kclass(name)]
            c[0] += us
            c[1] += n
        tot = [sum(v[0] for v in cls.values()), sum(v[1] for v in cls.values())]
        cells = [f"{cls[c][0]:.1f} ({cls[c][1]:.0f})" for c, _ in CLASSES + [("other", ())]]
        lines.append(f"| {K} | " + " | ".join(cells) + f" | {tot[0]:.1f} ({tot[1]:.0f}) |")
        print(lines[-1], flush=True)
    for K in ks[1:]:
        lines += ["", f"Kernels of K={K} vs K=0 (batch 1), largest differences of device µs per step:", "",
                  "| kernel | K=0 µs (n) | K µs (n) | diff µs |", "|---|---|---|---|"]
        names = set(prof[0]) | set(prof[K])
        diff = sorted(names, key=lambda n: -abs(prof[K].get(n, (0, 0))[0] - prof[0].get(n, (0, 0))[0]))
        for n in diff[:14]:
            a, b = prof[0].get(n, (0.0, 0.0)), prof[K].get(n, (0.0, 0.0))
            lines.append(f"| {n[:90]} | {a[0]:.1f} ({a[1]:.0f}) | {b[0]:.1f} ({b[1]:.0f}) | {b[0] - a[0]:+.1f} |")
        print("\n".join(lines[-16:]), flush=True)

    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
