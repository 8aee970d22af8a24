"""W8A8 GEMM (FP8 / INT8, per-channel and DeepSeek-style block scales) vs dequantize-then-matmul on the CPU."""
import pytest
import torch

from kestrel.kernels import act_quant as aq
from kestrel.kernels.gemm_w8a8 import gemm_w8a8, quantize_weight_w8a8, ref_gemm_w8a8, w8a8_linear
from kestrel.kernels.lowbit_gemm import GemmConfig

pytestmark = pytest.mark.skipif(not aq.use_triton(torch.empty(0)), reason="needs TRITON_INTERPRET=1 (or a GPU)")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
@pytest.mark.parametrize("M,N,K,cfg", [
    (5, 48, 256, None),  # decode-sized: heuristic config, N not a multiple of the tile
    (33, 64, 256, GemmConfig(BM=32, BN=32, BK=64, SPLIT_K=2)),  # ragged M, split-K (atomic fp32 reduction)
    (5, 48, 256, GemmConfig(BM=16, BN=32, BK=64, SWAP_AB=1)),  # swapped: C^T = W @ A^T
    (33, 64, 256, GemmConfig(BM=16, BN=64, BK=64, SPLIT_K=2, SWAP_AB=1)),
    (130, 96, 320, GemmConfig(BM=64, BN=32, BK=64, TMA=1)),  # TMA kernel, ragged M / N tiles
    (130, 96, 320, GemmConfig(BM=64, BN=32, BK=64, TMA=2)),  # persistent: 4 "SMs" on the CPU walk 15 tiles
    # TMA with K parts summed in the kernel (5 K tiles: parts 3 + 2; SPLIT_K 4 -> 3 parts 2 + 2 + 1)
    (130, 96, 320, GemmConfig(BM=64, BN=32, BK=64, SPLIT_K=2, TMA=1)),
    (130, 96, 320, GemmConfig(BM=64, BN=32, BK=64, SPLIT_K=4, TMA=1)),
])
def test_w8a8_vs_dequant_matmul(dtype, M, N, K, cfg):
    g = torch.Generator().manual_seed(M + N)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.05
    wq, ws = quantize_weight_w8a8(w, dtype)
    a, s = aq.ref_quant_int8(x) if dtype == "int8" else aq.ref_quant_fp8(x)
    y = gemm_w8a8(a, s, wq, ws, torch.float32, cfg)
    ref = ref_gemm_w8a8(a, s, wq, ws)
    assert y.shape == (M, N)
    assert _rel(y, ref) < 1e-5  # fp32 accumulation, identical inputs
    assert _rel(y, x @ w.t()) < (0.08 if dtype == "fp8" else 0.03)  # quantization error is small (sanity)


def test_w8a8_bf16_out_and_linear():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 4, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(64, 128, generator=g) * 0.05
    wq, ws = quantize_weight_w8a8(w, "fp8")
    y = w8a8_linear(x, wq, ws)
    assert y.shape == (3, 4, 64) and y.dtype == torch.bfloat16
    a, s = aq.ref_quant_fp8(x.reshape(-1, 128))
    assert _rel(y.reshape(-1, 64), ref_gemm_w8a8(a, s, wq, ws)) < 4e-3  # one bf16 rounding of the output


def test_tma_split_k_in_kernel_reduction(monkeypatch):
    """lowbit_tma SPLIT: K parts summed by the tile's last part (slabs + ticket counters): right for bf16 out, again
    on a second call (the counters reset themselves), part counts without an empty part; KESTREL_W8A8_SPLIT
    (lowbit_gemm.W8A8_SPLIT) off by default, on it splits only under-filled grids."""
    from kestrel.kernels import lowbit_gemm as lg
    from kestrel.kernels.lowbit_tma import split_parts
    g = torch.Generator().manual_seed(21)
    M, N, K = 64, 96, 1024
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.05
    wq, ws = quantize_weight_w8a8(w, "fp8")
    a, s = aq.ref_quant_fp8(x)
    ref = ref_gemm_w8a8(a, s, wq, ws)
    cfg = GemmConfig(BM=64, BN=32, BK=128, SPLIT_K=4, num_stages=6, TMA=1)
    for _ in range(2):
        y = gemm_w8a8(a, s, wq, ws, torch.bfloat16, cfg)
        assert y.dtype == torch.bfloat16 and _rel(y, ref) < 4e-3
    assert _rel(gemm_w8a8(a, s, wq, ws, torch.float32, cfg), ref) < 1e-5
    assert [split_parts(GemmConfig(SPLIT_K=sk, TMA=t), K, 128) for sk, t in ((1, 1), (4, 1), (8, 1), (4, 2))] == [
        1, 4, 8, 1]
    assert split_parts(GemmConfig(SPLIT_K=4, TMA=1), 640, 128) == 3  # 5 tiles: 2 + 2 + 1, not an empty 4th
    h = lambda M, N, K: lg.heuristic_config(M, N, K, lg.A_FP8, lg.W_FP8)
    monkeypatch.setattr(lg, "W8A8_SPLIT", 1)
    assert (h(64, 4096, 14336).BN, h(64, 4096, 14336).SPLIT_K, h(64, 4096, 14336).TMA) == (64, 1, 1)
    monkeypatch.setattr(lg, "W8A8_SPLIT", 4)
    assert h(64, 4096, 14336).SPLIT_K == 4 and h(64, 8192, 28672).SPLIT_K == 2 and h(64, 28672, 4096).SPLIT_K == 1
    assert h(1024, 4096, 14336).SPLIT_K == 1


def test_fp8_block_scales_with_group_activations():
    g = torch.Generator().manual_seed(3)
    M, N, K = 7, 256, 256
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.05
    w[:128, :128] *= 20  # blocks with very different ranges: a wrong block index would show
    wq, ws = quantize_weight_w8a8(w, "fp8", block=128)
    assert ws.shape == (2, 2)
    a, s = aq.ref_quant_fp8(x, 128)
    y = gemm_w8a8(a, s, wq, ws, torch.float32)
    assert _rel(y, ref_gemm_w8a8(a, s, wq, ws)) < 1e-5
    assert _rel(y, x @ w.t()) < 0.08
    ys = gemm_w8a8(a, s, wq, ws, torch.float32, GemmConfig(BM=16, BN=64, BK=128, SWAP_AB=1, TMA=1))  # TMA: n/a here
    assert _rel(ys, ref_gemm_w8a8(a, s, wq, ws)) < 1e-5


def test_w8a8_bad_inputs():
    a = torch.zeros(4, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError):
        gemm_w8a8(a, torch.ones(4, 1), torch.zeros(8, 32, dtype=torch.float8_e4m3fn), torch.ones(8))
    with pytest.raises(ValueError):
        gemm_w8a8(a, torch.ones(4, 1), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8))
    with pytest.raises(ValueError):
        quantize_weight_w8a8(torch.randn(8, 64), "fp6")


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
def test_w8a16_bf16_activations_vs_dequant(dtype):
    """decode path without activation quant: bf16 x [M, K] @ dequantized 8-bit weight (fp32 reference)."""
    from kestrel.kernels.gemm_w8a8 import gemm_w8a16
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    wq, ws = quantize_weight_w8a8(torch.randn(40, 256, generator=g) * 0.05, dtype)
    ref = x.float() @ (wq.float() * ws.reshape(-1, 1)).t()
    for cfg in (None, GemmConfig(BM=16, BN=32, BK=128, SPLIT_K=2)):
        assert _rel(gemm_w8a16(x, wq, ws, torch.float32, cfg), ref) < 1e-5
