"""QuantizedWeight (kestrel.quant, any converter) -> low-bit kernel layouts: the converted weight dequantizes to
exactly kestrel.quant.dequantize(qw), and the W8A8 / W4A8 / W4A4 kernels on it match dequantize-then-matmul."""
import pytest
import torch

from kestrel.kernels import act_quant as aq
from kestrel.kernels.gemm_w4a4 import gemm_w4a4
from kestrel.kernels.gemm_w4a8 import W4Weight, gemm_w4a8
from kestrel.kernels.gemm_w8a8 import gemm_w8a8
from kestrel.kernels.lowbit_convert import from_quantized_weight
from kestrel.quant import QuantSpec, dequantize, quantize

pytestmark = pytest.mark.skipif(not aq.use_triton(torch.empty(0)), reason="needs TRITON_INTERPRET=1 (or a GPU)")

SPECS = {
    "fp8": QuantSpec("fp8_e4m3", group_size=-1, scale_dtype="fp32"),
    "int8": QuantSpec("int8", group_size=-1, scale_dtype="bf16"),
    "int4": QuantSpec("int4", group_size=128, scale_dtype="bf16"),
    "mxfp4": QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0"),
    "nvfp4": QuantSpec("fp4_e2m1", group_size=16, scale_dtype="fp8_e4m3", global_scale=True),
}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("name", list(SPECS))
def test_converted_weight_runs_on_low_bit_kernels(name):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 256, generator=g) * 0.05
    x = torch.randn(5, 256, generator=g)
    qw = quantize(w, SPECS[name])
    ref_w = dequantize(qw)
    conv = from_quantized_weight(qw)
    if isinstance(conv, W4Weight):
        assert torch.equal(conv.dequantize(), ref_w)
        if name in ("mxfp4", "nvfp4"):  # W4A4
            q, s, gs = aq.ref_quant_nvfp4(x) if name == "nvfp4" else (*aq.ref_quant_mxfp4(x), None)
            xd = aq.dequant_nvfp4(q, s, gs) if name == "nvfp4" else aq.dequant_mxfp4(q, s)
            assert _rel(gemm_w4a4(q, s, conv, gs, torch.float32), xd @ ref_w.t()) < 1e-5
        a, s = aq.ref_quant_fp8(x)  # W4A8
        ref = aq.dequant_8bit(a, s) @ ref_w.t()
        assert _rel(gemm_w4a8(a, s, conv, torch.float32, bf16_max_m=0), ref) < 1e-5  # the fp8 kernels
        assert _rel(gemm_w4a8(a, s, conv, torch.float32), ref) < 8e-3  # small M int4: WNA16 (bf16 scales)
    else:
        wq, ws = conv
        assert torch.equal(wq.float() * ws[:, None], ref_w)
        a, s = aq.ref_quant_fp8(x) if name == "fp8" else aq.ref_quant_int8(x)
        assert _rel(gemm_w8a8(a, s, wq, ws, torch.float32), aq.dequant_8bit(a, s) @ ref_w.t()) < 1e-5


def test_unsupported_layouts_raise():
    w = torch.randn(32, 256) * 0.05
    with pytest.raises(ValueError):
        from_quantized_weight(quantize(w, QuantSpec("uint4", group_size=128, has_zero_point=True)))
    with pytest.raises(ValueError):
        from_quantized_weight(quantize(w, QuantSpec("int3", group_size=128)))
