"""The decode "stream" WNA16 kernel (kestrel/kernels/gemm_wna16_stream.py) vs float64 x @ dequantize(W)^T.

Tolerance: relative Frobenius error 1e-2 for every format (the kernel accumulates in fp32; its rounding is the bf16/fp16
output, ~2^-9; a wrong field, shift, zero, scale or split gives O(1) errors). On a GPU the same tests run the inline-PTX
4-bit decode.
"""
import os

import pytest
import torch

from kestrel.kernels.configs import ComputeConfig, LayerConfig, heuristic
from kestrel.kernels.gemm_wna16 import gemm_wna16
from kestrel.quant import QuantSpec, dequantize, quantize

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a GPU")
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TOL = 1e-2
FORMATS = [
    QuantSpec("int4", group_size=128),                                           # GPTQ/AWQ-style symmetric int4
    QuantSpec("uint4", has_zero_point=True, group_size=128),                     # asymmetric, one group per block
    QuantSpec("uint4", has_zero_point=True, group_size=32, scale_dtype="fp16"),  # asymmetric, 4 groups per block
    QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0"),                    # MXFP4
    QuantSpec("fp4_e2m1", group_size=16, scale_dtype="fp8_e4m3", global_scale=True),  # NVFP4
    QuantSpec("int8", group_size=-1),                                            # per channel
    QuantSpec("int2", group_size=64),
]


def _err(qw, m, cfg, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, qw.shape[1], generator=g).to(dtype)
    ref = x.double() @ dequantize(qw).double().t()
    y = gemm_wna16(x.to(DEV), qw.to(DEV), cfg).cpu()
    assert y.dtype == dtype and y.shape == (m, qw.shape[0])
    return ((y.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("spec", FORMATS, ids=lambda s: s.name)
@pytest.mark.parametrize("m,cfg", [
    (1, ComputeConfig("stream", 1, 128, 0, split_k=1, num_warps=1, num_stages=2)),  # one row, prefetch
    (3, ComputeConfig("stream", 4, 128, 0, split_k=2, num_warps=1, num_stages=1)),  # row 4 masked, split 2+1
    (16, ComputeConfig("stream", 4, 64, 0, split_k=2, num_warps=1, num_stages=2)),  # 4 row-blocks, split 2
], ids=["m1", "m3-split2", "m16-split2"])
def test_stream_every_format(spec, m, cfg):
    # N = 200: not a multiple of the tile; K = 384 = 3 planar blocks of 4-bit (split 2: 2 + 1 blocks)
    W = torch.randn(200, 384, generator=torch.Generator().manual_seed(3))
    err = _err(quantize(W, spec), m, cfg)
    assert err < TOL, f"{spec.name} M={m} {cfg}: rel err {err:.3g}"


@pytest.mark.parametrize("spec", FORMATS[:4], ids=lambda s: s.name)
def test_stream_k_not_a_multiple_uneven_split(spec):
    # K = 300 is stored padded to 384; split 2 over 3 blocks gives the splits 2 + 1 blocks
    W = torch.randn(96, 300, generator=torch.Generator().manual_seed(4))
    qw = quantize(W, spec)
    for m in (1, 2):
        err = _err(qw, m, ComputeConfig("stream", m, 128, 0, split_k=2, num_warps=1, num_stages=2))
        assert err < TOL, f"{spec.name} M={m}: rel err {err:.3g}"


def test_stream_fp16_activations_and_repeat_calls():
    # twice in a row: the split-K tile counters must be back at zero after each call
    qw = quantize(torch.randn(130, 256, generator=torch.Generator().manual_seed(5)), FORMATS[0])
    cfg = ComputeConfig("stream", 2, 128, 0, split_k=2, num_warps=1, num_stages=1)
    for _ in range(2):
        assert _err(qw, 2, cfg, torch.float16) < TOL


def test_stream_config_validity():
    layer = LayerConfig(FORMATS[0], 256, 256)
    assert ComputeConfig("stream", 4, 128, 0, 2, 1, 2).valid_for(layer)
    assert not ComputeConfig("stream", 8, 128, 0, 2, 1, 2).valid_for(layer)  # <= 4 rows of x per program
    assert not ComputeConfig("stream", 3, 128, 0, 2, 1, 2).valid_for(layer)  # a power of two (M = 3 runs as 4)
    assert not ComputeConfig("stream", 1, 128, 0, 3, 1, 2).valid_for(layer)  # 2 blocks cannot take 3 splits


def test_tuner_small_m_candidates():
    from kestrel.kernels.tuning import candidates
    for spec in (FORMATS[0], FORMATS[3]):
        layer = LayerConfig(spec, 4096, 4096)
        for m in (1, 3, 4, 8, 16):
            cands = candidates(layer, m)
            assert cands and all(c.valid_for(layer) for c in cands)
            stream = [c for c in cands if c.kernel == "stream"]
            assert bool(stream) == (m <= 4)  # beyond 4 rows mv reads the weights once for all of them
            assert all(c.block_m >= m or c.block_m == 1 for c in stream)
            assert not any(c.prefetch for c in cands)  # measured slower everywhere: not tried
            assert heuristic(layer, m) in cands  # the tuner measures the fallback it would replace
            assert not any(c.kernel == "mvs" for c in cands)  # measured slower (session 5 R1): not tried


def test_prefetch_field_round_trip():
    # tune-cache entries written before the field existed load as prefetch 0; new ones keep it
    old = {"kernel": "mv", "block_m": 16, "block_n": 128, "block_k": 0, "split_k": 4, "num_warps": 2, "num_stages": 3}
    assert ComputeConfig.from_dict(old).prefetch == 0
    cfg = ComputeConfig("mv", 16, 128, 0, 4, 2, 3, prefetch=4)
    assert ComputeConfig.from_dict(cfg.to_dict()) == cfg
    # on the CPU the prefetch is skipped: same result as without it
    qw = quantize(torch.randn(64, 512, generator=torch.Generator().manual_seed(6)), FORMATS[0])  # 4 blocks
    assert _err(qw, 2, cfg) < TOL


def test_tuner_compile_key_merges_split_counts():
    # the split count is a runtime argument: sk 4 and sk 16 of a tile compile once (split > 1 is the constexpr)
    from kestrel.kernels.configs import LayerConfig
    from kestrel.kernels.tuning import compile_key
    lay = LayerConfig(FORMATS[0], 4096, 4096)
    key = lambda c: compile_key(lay, 1, c)
    a, b = ComputeConfig("mv", 16, 128, 0, 4, 2, 3), ComputeConfig("mv", 16, 128, 0, 16, 2, 3)
    assert key(a) == key(b)
    assert key(ComputeConfig("mv", 16, 128, 0, 1, 2, 3)) != key(a)
    assert key(ComputeConfig("mv", 16, 128, 0, 4, 4, 3)) != key(a)
