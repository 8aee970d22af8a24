"""The engine's Triton attention backend vs its PyTorch backend on the same metadata (mixed decode + prefill
steps with prefix-cached context, sliding window on and off), under TRITON_INTERPRET=1."""
import pytest
import torch

from kestrel.engine.attention import TorchAttentionBackend, build_metadata
from kestrel.engine.attention_triton import TritonAttentionBackend


@pytest.mark.parametrize("window", [None, 6])
def test_triton_backend_matches_torch_backend(window):
    gen = torch.Generator().manual_seed(11 if window else 7)
    L, nb, bs, H, Hkv, D = 2, 24, 4, 4, 2, 16
    args = (L, nb, bs, H, Hkv, D, torch.float32, "cpu", window)
    ref, tri = TorchAttentionBackend(*args), TritonAttentionBackend(*args)
    # shared random cache contents (the cached prefixes / earlier tokens)
    for layer in range(L):
        for c in ("k_cache", "v_cache"):
            x = torch.randn(nb, bs, Hkv, D, generator=gen)
            getattr(ref, c)[layer].copy_(x)
            getattr(tri, c)[layer].copy_(x)
    perm = torch.randperm(nb, generator=gen).tolist()
    decode = [(9, perm[0:3]), (1, perm[3:4]), (14, perm[4:8])]  # (context_len incl. new token, block table)
    prefill = [(0, 7, perm[8:10]), (5, 6, perm[10:13]), (8, 1, perm[13:16])]  # (cached, new, table)
    for dec, pre in [(decode, []), ([], prefill), (decode, prefill)]:
        meta, positions = build_metadata(dec, pre, bs, window)
        T = len(positions)
        for layer in range(L):
            q = torch.randn(T, H, D, generator=gen)
            k = torch.randn(T, Hkv, D, generator=gen)
            v = torch.randn(T, Hkv, D, generator=gen)
            o_ref = ref.forward(layer, q, k, v, meta)
            o_tri = tri.forward(layer, q, k, v, meta)
            assert o_tri.shape == o_ref.shape
            assert (o_tri - o_ref).norm() / o_ref.norm() < 1e-4
            assert torch.equal(tri.k_cache[layer], ref.k_cache[layer])
