"""The fused draft tree (kestrel/spec/head_tree_fused.py: 3 Triton launches per level) against DraftHead.draft_tree's
PyTorch path (nodes=True) over the same draft vocabulary, float32 under TRITON_INTERPRET=1: the same nodes."""
import os

import pytest
import torch

from kestrel.spec.draft_head import DraftHead

interp = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (CPU)")


@interp
@pytest.mark.parametrize("recurrent,N,widths,nsub,fb", [
    (True, 1, (4, 1, 1, 1), 200, True),   # the session-9 shape at batch 1; two vocabulary blocks
    (True, 3, (4, 2, 1), 40, True),       # a branching second level
    (False, 5, (3, 2, 2), 200, False),    # non-recurrent refiner, PyTorch backbone, widths not powers of two
    (True, 2, (1, 1, 1), 40, True),       # all ones: the chain
])
def test_fused_tree_matches_the_pytorch_tree(recurrent, N, widths, nsub, fb):
    from kestrel.spec.head_tree_fused import FusedTreeDraft
    g = torch.Generator().manual_seed(N + len(widths))
    H, V = 48, 300  # H not a power of two or a multiple of the 64-wide tiles
    head = DraftHead(H, k=4, recurrent=recurrent, refine_rank=24).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() > 1 else 0.2))
    embed, lm_head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)
    head.vocab = torch.tensor(sorted(torch.randperm(V, generator=g)[:nsub].tolist()))
    ro = head.subset_readout(embed, lm_head)
    h, x = torch.randn(N, H, generator=g), torch.randint(V, (N,), generator=g)
    want = head.draft_tree(h, x, embed, lm_head, widths, readout=ro, nodes=True)
    got = FusedTreeDraft(head, embed, lm_head, ro, fuse_backbone=fb).tree(head, h, x, embed, widths)
    assert got.shape == want.shape == (N, sum(torch.tensor(widths).cumprod(0).tolist()))
    assert torch.equal(got, want)
    # siblings are distinct tokens (a top-w, not w copies of the argmax)
    first = got[:, :widths[0]]
    assert all(len(set(r.tolist())) == widths[0] for r in first)
