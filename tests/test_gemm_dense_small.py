"""The small-M dense GEMM (verify-step candidate) against torch's matmul, ragged M/N/K included."""
import pytest
import torch

from kestrel.kernels.gemm_dense_small import dense_small_mm


@pytest.mark.parametrize("M,N,K,bn", [(1, 100, 70, 32), (3, 576, 576, 64), (5, 960, 576, 128), (16, 33, 1536, 32)])
def test_dense_small_mm_matches_matmul(M, N, K, bn):
    g = torch.Generator().manual_seed(M * N)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    torch.testing.assert_close(dense_small_mm(x, w, block_n=bn), x @ w.T, atol=1e-3, rtol=1e-4)


def test_dense_small_mm_rejects_large_m():
    with pytest.raises(ValueError):
        dense_small_mm(torch.zeros(17, 8), torch.zeros(4, 8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only (the patch touches CUDA bf16/fp16 linears)")
def test_small_m_linears_patch_matches_and_restores_cuda():
    from kestrel.kernels.gemm_dense_small import small_m_linears
    lin = torch.nn.Linear(576, 960, bias=False).cuda().to(torch.bfloat16)
    x = torch.randn(3, 576, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ lin.weight.float().T
    with small_m_linears(lin) as n:
        assert n == 1
        torch.testing.assert_close(lin(x).float(), ref, atol=2e-2, rtol=2e-2)
    assert "forward" not in lin.__dict__
