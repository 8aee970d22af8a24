"""FP8 W8A8 GEMM with fused per-(token, 128) activation quantization vs a float64 reference on the CPU."""
import pytest
import torch

from kestrel.kernels import act_quant as aq
from kestrel.kernels.gemm_w8a8 import quantize_weight_w8a8, w8a8_linear
from kestrel.kernels.gemm_w4a8 import quantize_weight_w4, w4a8_linear
from kestrel.kernels.gemm_w8a8_fused import (FusedConfig, fused_config, gemm_w4a8_fused, gemm_w8a8_fused,
                                             ref_act_groups, ref_w8a8_fused)

pytestmark = pytest.mark.skipif(not aq.use_triton(torch.empty(0)), reason="needs TRITON_INTERPRET=1 (or a GPU)")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("M,N,K,cfg", [
    (1, 48, 256, FusedConfig(BM=16, BN=32, SPLIT_K=1, SWAP=1)),  # decode, N not a multiple of the tile
    (3, 64, 512, FusedConfig(BM=16, BN=32, SPLIT_K=2, SWAP=1)),  # in-launch split-K, swapped operands
    (5, 64, 384, FusedConfig(BM=16, BN=64, SPLIT_K=2, SWAP=0)),  # 3 K tiles over 2 splits (uneven)
    (33, 40, 256, FusedConfig(BM=32, BN=32, SPLIT_K=1, SWAP=0)),  # ragged M
])
def test_fused_vs_float64(M, N, K, cfg):
    g = torch.Generator().manual_seed(M * 7 + N)
    x = torch.randn(M, K, generator=g)
    x[:, :128] *= 30  # groups with very different ranges: one scale per row would blur them
    w = torch.randn(N, K, generator=g) * 0.05
    wq, ws = quantize_weight_w8a8(w, "fp8")
    xb = x.to(torch.bfloat16)
    y = gemm_w8a8_fused(xb, wq, ws, torch.float32, cfg)
    ref = ref_w8a8_fused(xb.float(), wq, ws)
    assert y.shape == (M, N)
    assert _rel(y, ref) < 1e-4  # the same quantized values, fp32 accumulation
    assert _rel(y, x.to(torch.bfloat16).double() @ w.double().t()) < 0.08  # quantization error (sanity)


@pytest.mark.parametrize("group", [128, 256, -1])
@pytest.mark.parametrize("M,N,K,cfg", [
    (1, 48, 256, FusedConfig(BM=16, BN=32, SPLIT_K=1, SWAP=1)),
    (3, 64, 512, FusedConfig(BM=16, BN=32, SPLIT_K=2, SWAP=1)),
    (5, 64, 768, FusedConfig(BM=16, BN=64, SPLIT_K=2, SWAP=0)),  # 6 K tiles over 2 splits, unswapped
    (33, 40, 512, FusedConfig(BM=32, BN=32, SPLIT_K=1, SWAP=0)),  # ragged M and N
])
def test_fused_w4a8_vs_float64(M, N, K, cfg, group):
    """int4 (halves packing, group scales) x fp8 activations quantized in the kernel vs the float64 product of the
    group-quantized activations and the dequantized weight."""
    g = torch.Generator().manual_seed(M * 5 + N + group)
    x = torch.randn(M, K, generator=g)
    x[:, :128] *= 30
    qw = quantize_weight_w4(torch.randn(N, K, generator=g) * 0.05, "int4", group).kernel_layout()
    assert qw.layout == "halves"
    xb = x.to(torch.bfloat16)
    y = gemm_w4a8_fused(xb, qw, torch.float32, cfg)
    ref = ref_act_groups(xb.float()) @ qw.dequantize().double().t()
    assert y.shape == (M, N)
    assert _rel(y, ref) < 1e-4


def test_fused_w4a8_is_the_decode_path_of_w4a8_linear():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    qw = quantize_weight_w4(torch.randn(64, 256, generator=g) * 0.05, "int4", 128).kernel_layout()
    y = w4a8_linear(x, qw, bf16_max_m=0)  # (default: up to gemm_w4a8.BF16_MAX_M tokens the WNA16 path goes first)
    assert y.dtype == torch.bfloat16
    assert _rel(y, ref_act_groups(x.float()) @ qw.dequantize().double().t()) < 4e-3  # one bf16 rounding


def test_fused_is_the_decode_path_of_w8a8_linear():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 256, generator=g).to(torch.bfloat16)
    wq, ws = quantize_weight_w8a8(torch.randn(64, 256, generator=g) * 0.05, "fp8")
    y = w8a8_linear(x, wq, ws)
    assert y.dtype == torch.bfloat16
    assert _rel(y, ref_w8a8_fused(x.float(), wq, ws)) < 4e-3  # one bf16 rounding of the output


def test_fused_config_and_bad_inputs():
    assert fused_config(1, 8192, 8192).SPLIT_K >= 2 and fused_config(1, 8192, 8192).SWAP == 1
    assert fused_config(64, 8192, 8192).BM == 64
    wq, ws = quantize_weight_w8a8(torch.randn(32, 200) * 0.05, "fp8")
    with pytest.raises(ValueError):
        gemm_w8a8_fused(torch.randn(1, 200).to(torch.bfloat16), wq, ws)
