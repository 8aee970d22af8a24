"""W4A8 (int4 / MXFP4 / NVFP4 weights x FP8 activations) and W4A4 (MXFP4 / NVFP4 both sides, emulated with bf16 MMA)
vs dequantize-then-matmul on the CPU."""
import pytest
import torch
import triton
import triton.language as tl

from kestrel.kernels import act_quant as aq
from kestrel.kernels.gemm_w4a4 import gemm_w4a4, ref_dequant_act, w4a4_linear
from kestrel.kernels.gemm_w4a8 import gemm_w4a8, quantize_weight_w4, w4a8_linear
from kestrel.kernels.lowbit import unpack_nibbles
from kestrel.kernels.lowbit_gemm import GemmConfig, int4_to_e4m3, int4_to_f32

pytestmark = pytest.mark.skipif(not aq.use_triton(torch.empty(0)), reason="needs TRITON_INTERPRET=1 (or a GPU)")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _data(M, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * 0.05


def test_int4_weight_quantizer_definition():
    _, w = _data(1, 16, 256, 0)
    qw = quantize_weight_w4(w, "int4", 128)
    codes = unpack_nibbles(qw.packed).to(torch.int32)
    vals = (codes ^ 8) - 8
    assert vals.min() >= -8 and vals.max() <= 7
    # symmetric RTN: |w - q*s| <= s/2, scale = group amax / 7
    deq = qw.dequantize()
    s = qw.scale.repeat_interleave(128, 1)
    assert ((deq - w).abs() <= s / 2 + 1e-7).all()
    torch.testing.assert_close(qw.scale, w.view(16, 2, 128).abs().amax(-1) / 7)


@pytest.mark.parametrize("swap", [0, 1])  # 1: C^T = W @ A^T, the int4 -> fp8 weight tile as the MMA's A operand
@pytest.mark.parametrize("fmt,group", [("int4", 128), ("int4", -1), ("int4", 32), ("mxfp4", 32), ("nvfp4", 16)])
def test_w4a8_vs_dequant_matmul(fmt, group, swap):
    M, N, K = 5, 48, 256
    x, w = _data(M, N, K, 1)
    qw = quantize_weight_w4(w, fmt, group)
    a, s = aq.ref_quant_fp8(x)
    y = gemm_w4a8(a, s, qw, torch.float32, GemmConfig(BM=16, BN=32, BK=64, SWAP_AB=swap))
    ref = aq.dequant_8bit(a, s) @ qw.dequantize().t()
    assert _rel(y, ref) < 1e-5
    assert _rel(y, x @ w.t()) < 0.25  # 4-bit weights: sanity bound only


def test_w4a8_linear_split_k_bf16():
    x, w = _data(20, 64, 512, 2)
    qw = quantize_weight_w4(w, "int4", 128)
    y = w4a8_linear(x.to(torch.bfloat16), qw)
    a, s = aq.ref_quant_fp8(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    assert _rel(y, aq.dequant_8bit(a, s) @ qw.dequantize().t()) < 4e-3


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_w4a4_vs_dequant_matmul(fmt):
    M, N, K = 6, 40, 256
    x, w = _data(M, N, K, 3)
    qw = quantize_weight_w4(w, fmt)
    if fmt == "mxfp4":
        a, s = aq.ref_quant_mxfp4(x)
        gs = None
    else:
        a, s, gs = aq.ref_quant_nvfp4(x)
    y = gemm_w4a4(a, s, qw, gs, torch.float32, GemmConfig(BM=16, BN=32, BK=64))
    ref = ref_dequant_act(a, s, gs, fmt) @ qw.dequantize().t()
    assert _rel(y, ref) < 1e-5  # the in-register bf16 conversion is exact
    y2 = w4a4_linear(x, qw, out_dtype=torch.float32)  # with the Triton activation quantizer
    assert _rel(y2, ref) < 1e-5


def test_w4_bad_inputs():
    x, w = _data(4, 32, 128, 4)
    with pytest.raises(ValueError):
        quantize_weight_w4(w, "int3")
    qw = quantize_weight_w4(w, "int4")
    with pytest.raises(ValueError):
        gemm_w4a4(torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 4, dtype=torch.uint8), qw)
    with pytest.raises(ValueError):
        gemm_w4a8(x, torch.ones(4, 1), qw)  # activations must be fp8
    nv = quantize_weight_w4(w, "nvfp4")
    with pytest.raises(ValueError):
        gemm_w4a4(torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 8, dtype=torch.float8_e4m3fn), nv)


@triton.jit
def _int4_to_e4m3_kernel(src, dst):
    i = tl.arange(0, 16)
    tl.store(dst + i, int4_to_e4m3(tl.load(src + i)).to(tl.uint8, bitcast=True))


def test_int4_to_e4m3_all_nibbles():
    codes = torch.arange(16, dtype=torch.uint8)
    out = torch.empty(16, dtype=torch.uint8)
    _int4_to_e4m3_kernel[(1,)](codes, out)
    want = (((codes.int() ^ 8) - 8).float().to(torch.float8_e4m3fn)).view(torch.uint8)  # two's complement values
    assert torch.equal(out, want)


@triton.jit
def _int4_to_f32_kernel(src, dst):
    i = tl.arange(0, 16)
    tl.store(dst + i, int4_to_f32(tl.load(src + i)))


def test_int4_to_f32_all_nibbles():
    """the I2F-free nibble -> fp32 decode of the 16-bit-MMA (WNA16 / MoE int4) path: every code, exact."""
    codes = torch.arange(16, dtype=torch.uint8)
    out = torch.empty(16, dtype=torch.float32)
    _int4_to_f32_kernel[(1,)](codes, out)
    assert torch.equal(out, ((codes.int() ^ 8) - 8).float())


@pytest.mark.parametrize("group,tma", [(128, 1), (-1, 2), (256, 1)])
def test_w4a8_large_m_path_expand_then_tma(group, tma):
    """large-M W4A8: int4 -> fp8 expansion (exact) + the TMA kernel with per-K-tile group scales, ragged M / N."""
    from kestrel.kernels.lowbit_tma import int4_to_fp8
    M, N, K = 130, 96, 512
    x, w = _data(M, N, K, 3)
    qw = quantize_weight_w4(w, "int4", group)
    codes = unpack_nibbles(qw.packed).int()
    assert torch.equal(int4_to_fp8(qw.packed).float(), ((codes ^ 8) - 8).float())
    a, s = aq.ref_quant_fp8(x)
    y = gemm_w4a8(a, s, qw, torch.float32, GemmConfig(BM=64, BN=32, BK=128, TMA=tma))
    assert _rel(y, aq.dequant_8bit(a, s) @ qw.dequantize().t()) < 1e-5


@pytest.mark.parametrize("group", [128, -1])
def test_w4a8_halves_packing(group):
    """kernel_layout(): the "halves" repack dequantizes to the same weight and every GEMM path reads it right."""
    from kestrel.kernels.gemm_w4a8 import from_halves, to_halves
    M, N, K = 5, 48, 512
    x, w = _data(M, N, K, 4)
    qw = quantize_weight_w4(w, "int4", group)
    kl = qw.kernel_layout()
    assert kl.layout == "halves" and torch.equal(from_halves(kl.packed), qw.packed)
    assert torch.equal(to_halves(qw.packed), kl.packed) and torch.equal(kl.dequantize(), qw.dequantize())
    a, s = aq.ref_quant_fp8(x)
    ref = aq.dequant_8bit(a, s) @ qw.dequantize().t()
    for cfg in (GemmConfig(BM=16, BN=32, BK=64), GemmConfig(BM=16, BN=32, SPLIT_K=2, SWAP_AB=1),
                GemmConfig(BM=64, BN=32, TMA=1)):
        assert _rel(gemm_w4a8(a, s, kl, torch.float32, cfg), ref) < 1e-5
    assert quantize_weight_w4(w, "int4", 32).kernel_layout().layout == "pairs"  # groups < 128: unchanged


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX decode runs on the GPU only")
def test_w4a8_asm_decode_matches_reference():
    """DECODE_ASM (inline-PTX int4 -> e4m3 of the swapped halves path) vs float64 dequantize-then-matmul."""
    from kestrel.kernels import act_quant, lowbit_gemm
    from kestrel.kernels.gemm_w4a8 import gemm_w4a8
    torch.manual_seed(0)
    w = torch.randn(256, 512, device="cuda") * 0.02
    qw = quantize_weight_w4(w, "int4", 128).kernel_layout()
    a, s = act_quant.quant_fp8(torch.randn(24, 512, device="cuda"))
    ref = act_quant.dequant_8bit(a, s).double() @ qw.dequantize().double().t()
    old, lowbit_gemm.DECODE_ASM = lowbit_gemm.DECODE_ASM, 1
    try:
        y = gemm_w4a8(a, s, qw, out_dtype=torch.float32).double()
    finally:
        lowbit_gemm.DECODE_ASM = old
    assert ((y - ref).norm() / ref.norm()).item() < 1e-5
