"""The fused greedy draft (kestrel/spec/head_fused.py: 3 Triton kernels per slot) against DraftHead.draft_greedy's
PyTorch path over the same draft vocabulary, float32 under TRITON_INTERPRET=1: same tokens, same confidences."""
import os

import pytest
import torch

from kestrel.spec.draft_head import DraftHead

# float32 on a GPU would run tl.dot in TF32 (near-ties flip): bench/spec_head_cost.py checks the bf16 GPU path
interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (CPU)")


@interp
@pytest.mark.parametrize("recurrent,N,k,nsub,fb", [(True, 3, 4, 40, True), (True, 20, 3, 200, True), (False, 2, 4, 40, False)])
def test_fused_greedy_draft_matches_the_pytorch_draft(recurrent, N, k, nsub, fb):
    from kestrel.spec.head_fused import FusedGreedyDraft
    dev = "cpu"
    g = torch.Generator().manual_seed(N)
    H, V = 48, 300  # H not a power of two or a multiple of the 64-wide tiles; nsub=200: two vocabulary blocks
    torch.manual_seed(N)
    head = DraftHead(H, k=4, recurrent=recurrent, refine_rank=24).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() > 1 else 0.2))
    head = head.to(dev)
    embed, lm_head = torch.randn(V, H, generator=g).to(dev), torch.randn(V, H, generator=g).to(dev)
    head.vocab = torch.tensor(sorted(torch.randperm(V, generator=g)[:nsub].tolist()))
    ro = head.subset_readout(embed, lm_head)
    h, x = torch.randn(N, H, generator=g).to(dev), torch.randint(V, (N,), generator=g).to(dev)
    want, want_c = head.draft_greedy(h, x, embed, lm_head, k, readout=ro)
    fused = FusedGreedyDraft(head, embed, lm_head, ro, fuse_backbone=fb)
    got, got_c = head.draft_greedy(h, x, embed, lm_head, k, readout=fused)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_c, want_c, atol=1e-5, rtol=1e-4)
    got2, none = head.draft_greedy(h, x, embed, lm_head, k, want_conf=False, readout=fused)
    assert none is None and torch.equal(got2, want)
    assert bool(torch.isin(got, head.vocab.to(dev)).all())


@interp
@pytest.mark.parametrize("N", [1, 20])
def test_fused_backbone_matches_draft_head_slots(N):
    """head_gemm.fused_slots (gather + cat + norm + linear + slot add, then per block norm + up + silu and down +
    residual, 5 launches) equals DraftHead.slots in float32."""
    from kestrel.spec.head_gemm import fused_slots
    g = torch.Generator().manual_seed(N)
    H, V = 48, 300
    head = DraftHead(H, k=3, recurrent=True, refine_rank=24).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5))
    embed = torch.randn(V, H, generator=g)
    h, x = torch.randn(N, H, generator=g), torch.randint(V, (N,), generator=g)
    with torch.no_grad():
        want = head.slots(h, embed[x])
    torch.testing.assert_close(fused_slots(head, h, x, embed), want, atol=1e-4, rtol=1e-4)
