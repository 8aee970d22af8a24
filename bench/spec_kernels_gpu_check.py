"""GPU smoke check of spec's Triton kernels against their PyTorch references (rotary, silu*mul, device n-gram, also with exclude=),
run by the H200 job before anything relies on them. Prints one line per kernel and exits 1 on a mismatch.

  python bench/spec_kernels_gpu_check.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kestrel.kernels.rope_silu import rope, silu_mul  # noqa: E402
from kestrel.model.rope import RotaryEmbedding  # noqa: E402


def main() -> int:
    import kestrel.spec.ngram as ng
    dev, ok = "cuda", True
    g = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(5, 960, device=dev, generator=g).to(torch.bfloat16)
    x = qkv[:, :768].view(5, 12, 64)
    emb = RotaryEmbedding(64, 8192, 100000.0, None)
    emb.build(dev, torch.bfloat16)
    cs = emb.lookup(torch.arange(300, 305, device=dev))
    for name, got, ref in [("rope", rope(x, *cs), RotaryEmbedding.apply(x, cs)),
                           ("rope T=1", rope(x[:1], cs[0][:1], cs[1][:1]), RotaryEmbedding.apply(x[:1], (cs[0][:1], cs[1][:1]))),
                           ("silu_mul", silu_mul(qkv[:, :768]), torch.nn.functional.silu(qkv[:, :384]) * qkv[:, 384:768])]:
        err = (got.float() - ref.float()).abs().max().item()
        exact = torch.equal(got, ref)
        ok &= err < 2e-2
        print(f"{name}: max |diff| {err:.3g}, bit-identical {exact}", flush=True)
    hist = torch.randint(0, 5, (64, 8200), device=dev, generator=g)
    length = torch.randint(1, 8200, (64,), device=dev, generator=g)
    os.environ["KESTREL_NGRAM_TRITON"] = "0"
    ref = ng.ngram_draft_device(hist, length, 4, return_n=True)
    os.environ["KESTREL_NGRAM_TRITON"] = "1"
    got = ng.ngram_draft_device(hist, length, 4, return_n=True)
    same = all(torch.equal(a, b) for a, b in zip(got, ref))
    ok &= same
    print(f"ngram triton == tensor ops: {same}", flush=True)
    x = ref[0][:, 0]  # exclude= (a draft tree's second n-gram branch): another first token than the first lookup's
    hist[:8, :50] = 7  # rows whose only 1-gram continuation is the excluded token: no match left
    length[:8] = 40
    x[:8] = 7
    os.environ["KESTREL_NGRAM_TRITON"] = "0"
    ref = ng.ngram_draft_device(hist, length, 4, return_n=True, exclude=x)
    os.environ["KESTREL_NGRAM_TRITON"] = "1"
    got = ng.ngram_draft_device(hist, length, 4, return_n=True, exclude=x)
    same = all(torch.equal(a, b) for a, b in zip(got, ref)) and not bool(ref[1][:8].any()) and bool(ref[1][8:].all())
    ok &= same
    print(f"ngram exclude= triton == tensor ops: {same}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
