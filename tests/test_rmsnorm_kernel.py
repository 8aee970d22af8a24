"""Triton RMSNorm vs torch.nn.functional.rms_norm (interpreter)."""
import pytest
import torch

from kestrel.kernels.rmsnorm import rms_norm


@pytest.mark.parametrize("shape,dtype,tol", [((5, 96), torch.float32, 1e-5), ((2, 3, 64), torch.float16, 2e-3)])
def test_rms_norm_matches_torch(shape, dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    y = rms_norm(x, w, 1e-5)
    ref = torch.nn.functional.rms_norm(x.float(), (shape[-1],), w.float(), 1e-5)
    assert y.shape == x.shape and y.dtype == dtype
    assert ((y.float() - ref).norm() / ref.norm()).item() < tol
