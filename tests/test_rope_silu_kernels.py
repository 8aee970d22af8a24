"""The fused rotary / silu-mul kernels against the PyTorch ops they replace, on strided views of a fused output
(what a multi-token verify step feeds them) and on single rows."""
import pytest
import torch

from kestrel.kernels.rope_silu import rope, silu_mul
from kestrel.model.rope import RotaryEmbedding


@pytest.mark.parametrize("T", [1, 5])
def test_rope_matches_rotary_apply_on_a_qkv_slice(T):
    g = torch.Generator().manual_seed(T)
    nq, nkv, D = 3, 1, 16
    qkv = torch.randn(T, (nq + 2 * nkv) * D, generator=g)
    x = qkv[:, :(nq + nkv) * D].view(T, nq + nkv, D)  # row-strided view, as in LlamaAttention
    emb = RotaryEmbedding(D, 64, 10000.0, None)
    cs = emb.lookup(torch.arange(7, 7 + T))
    torch.testing.assert_close(rope(x, *cs), RotaryEmbedding.apply(x, cs), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("T", [1, 3])
def test_silu_mul_matches_torch_on_a_gate_up_output(T):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 2 * 48, generator=g)
    gate, up = x.split(48, dim=-1)
    torch.testing.assert_close(silu_mul(x), torch.nn.functional.silu(gate) * up, atol=1e-6, rtol=1e-5)
