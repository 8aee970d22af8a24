"""RTN quantize() and packing: every format reproduces W within its quantization error, pack/unpack are inverse."""
import pytest
import torch

from kestrel.quant import QuantSpec, dequantize, quantize
from kestrel.quant.packing import pack_bitstream, pack_codes, unpack_bitstream, unpack_codes

SPECS = {  # spec -> max relative Frobenius error of RTN on Gaussian weights (well above the measured value)
    QuantSpec("int4"): 0.15, QuantSpec("uint4", has_zero_point=True, scale_dtype="fp16"): 0.13,
    QuantSpec("int8", group_size=-1): 0.01, QuantSpec("int3", group_size=32): 0.28,
    QuantSpec("uint2", has_zero_point=True, group_size=64): 0.55, QuantSpec("int5", group_size=64): 0.07,
    QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0"): 0.15,
    QuantSpec("fp4_e2m1", group_size=16, scale_dtype="fp8_e4m3", global_scale=True): 0.12,
    QuantSpec("fp8_e4m3", group_size=-1, scale_dtype="fp32"): 0.035, QuantSpec("fp8_e5m2", group_size=-1, scale_dtype="fp32"): 0.07,
    QuantSpec("fp6_e3m2", group_size=32): 0.06, QuantSpec("fp6_e2m3", group_size=32): 0.035,
}


@pytest.mark.parametrize("spec", list(SPECS), ids=lambda s: s.name)
def test_rtn_error(spec):
    W = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    qw = quantize(W, spec)
    err = ((dequantize(qw) - W).norm() / W.norm()).item()
    assert err < SPECS[spec]
    # re-quantizing the dequantized weight is (almost) a fixed point: catches scale/zero bookkeeping errors
    assert ((dequantize(quantize(dequantize(qw), spec)) - dequantize(qw)).norm() / W.norm()).item() < SPECS[spec] / 3


def test_unaligned_k_pads():
    c = torch.randint(0, 16, (5, 200), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    words = pack_codes(c, 4)
    assert words.shape == (256 // 8, 5) and torch.equal(unpack_codes(words, 4, 200), c)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_pack_roundtrip(bits):
    g = torch.Generator().manual_seed(bits)
    c = torch.randint(0, 2**bits, (16, 512), generator=g, dtype=torch.int32)
    cb = bits if bits in (1, 2, 4, 8) else (4 if bits == 3 else 8)
    assert torch.equal(unpack_codes(pack_codes(c, cb), cb, 512), c)
    assert torch.equal(unpack_bitstream(pack_bitstream(c, bits, dim=1), bits, dim=1), c)


def test_planar_layout_definition():
    # word row b*16 + r, bit field i holds k = b*(16*epw) + i*16 + r (packing.py); checked bit by bit
    c = torch.randint(0, 16, (3, 256), generator=torch.Generator().manual_seed(9), dtype=torch.int32)
    words = pack_codes(c, 4)
    for n in range(3):
        for k in (0, 5, 16, 37, 127, 128, 200, 255):
            b, rem = divmod(k, 128)
            i, r = divmod(rem, 16)
            assert (int(words[b * 16 + r, n]) >> (4 * i)) & 0xF == int(c[n, k])
