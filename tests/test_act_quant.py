"""Activation quantization kernels (Triton, interpreter on CPU) vs the torch references, and the references vs the
formats' definitions. Run with TRITON_INTERPRET=1."""
import pytest
import torch

from kestrel.kernels import act_quant as aq
from kestrel.kernels.lowbit import FP4_VALUES, pack_nibbles, ref_fp4_decode, ref_fp4_encode, unpack_nibbles

pytestmark = pytest.mark.skipif(not aq.use_triton(torch.empty(0)), reason="needs TRITON_INTERPRET=1 (or a GPU)")


def _x(m, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 8
    x[1, :] = 0.0  # an all-zero token must not produce NaN
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("group", [-1, 64])
def test_fp8_matches_reference_bit_exact(group):
    x = _x(5, 256, 0)
    q, s = aq.quant_fp8(x, group)
    rq, rs = aq.ref_quant_fp8(x, group)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 1 if group == -1 else 4)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    torch.testing.assert_close(s, rs, rtol=0, atol=0)
    # the reference itself: per-element error at most half an e4m3 step (2^-4 relative) of the group max
    deq = aq.dequant_8bit(q, s)
    assert torch.isfinite(deq).all()
    err = (deq - x.float()).abs()
    assert (err <= x.float().abs() * 2 ** -4 + s.repeat_interleave(256 // s.shape[1], 1) * 2 ** -9 + 1e-12).all()


@pytest.mark.parametrize("m,k,chunked", [(5, 384, False), (1, 4096, True), (3, 20480, False)])
def test_fp8_perm_is_reference_in_k_perm128_order(m, k, chunked, monkeypatch):
    """quant_fp8(perm=True) (gemm_w4a8_tcg's PK activations): the reference codes gathered by k_perm128, every
    store path (one trip, column chunks, two passes); the scales unchanged."""
    if not chunked:
        monkeypatch.setattr(aq, "CHUNK_PROGRAMS", 0)
    monkeypatch.setattr(aq, "BLOCK_MAX", 16384)
    assert bool(aq._chunk_block(m, k)) == chunked
    x = _x(max(m, 2), k, 11)[:m]
    q, s = aq.quant_fp8(x, perm=True)
    rq, rs = aq.ref_quant_fp8(x)
    assert torch.equal(q.view(torch.uint8), rq[:, aq.k_perm128(k)].view(torch.uint8)) and torch.equal(s, rs)
    with pytest.raises(ValueError):
        aq.quant_fp8(x[:, :200], perm=True)


def test_fake_quant_fp8_is_dequantized_fp8():
    """fake_quant_fp8 (one launch) == bf16(dequant(quant_fp8(x))): the W4A8 small-M path's activations."""
    x = _x(7, 384, 5)
    y = aq.fake_quant_fp8(x)
    q, s = aq.ref_quant_fp8(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(y, aq.dequant_8bit(q, s).to(torch.bfloat16))
    assert torch.equal(y, aq.ref_fake_quant_fp8(x))
    assert not torch.equal(y, x)  # it did round (x is bf16: finer than e4m3)


def test_int8_matches_reference():
    x = _x(6, 192, 1)
    q, s = aq.quant_int8(x)
    rq, rs = aq.ref_quant_int8(x)
    assert torch.equal(q, rq) and torch.equal(s, rs)
    assert ((aq.dequant_8bit(q, s) - x.float()).abs() <= s * 0.5 + 1e-6).all()


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("k", [20000, 40000])
def test_per_token_8bit_wide_rows(k, chunked, monkeypatch):
    """per-token rows wider than 8192: one program per row (one trip of a block up to 32768 wide (20000), the
    two-pass loop beyond (40000)), or with few rows each row split over column chunks (_chunk_block, every chunk's
    program taking the whole row's amax); all bit-exact with the torch reference."""
    if not chunked:
        monkeypatch.setattr(aq, "CHUNK_PROGRAMS", 0)
    assert bool(aq._chunk_block(2, k)) == chunked
    x = _x(2, k, 3)
    for fn, ref in ((aq.quant_fp8, aq.ref_quant_fp8), (aq.quant_int8, aq.ref_quant_int8)):
        (q, s), (rq, rs) = fn(x), ref(x)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert torch.equal(aq.fake_quant_fp8(x), aq.ref_fake_quant_fp8(x))


def test_fp4_codec_against_value_table():
    vals = torch.tensor(FP4_VALUES)
    x = torch.cat([vals, -vals, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 5.9])])
    dec = ref_fp4_decode(ref_fp4_encode(x))
    # exact on table values, ties to even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4)
    assert torch.equal(dec[:16].abs(), torch.cat([vals, vals]))
    assert dec[16:].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0]
    codes = torch.randint(0, 16, (3, 8), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


def test_mxfp4_matches_reference():
    x = _x(4, 256, 2)
    q, s = aq.quant_mxfp4(x)
    rq, rs = aq.ref_quant_mxfp4(x)
    assert q.shape == (4, 128) and s.shape == (4, 8) and s.dtype == torch.uint8
    assert torch.equal(q, rq) and torch.equal(s, rs)
    # OCP MX: scale = 2^(floor(log2 amax) - 2), so every block's max lands in [4, 8) before the fp4 clamp
    xb = x.float().view(4, 8, 32)
    amax = xb.abs().amax(-1)
    scale = torch.pow(2.0, s.float() - 127)
    nz = amax > 0
    r = amax[nz] / scale[nz]
    assert ((r >= 4) & (r < 8)).all()
    rel = (aq.dequant_mxfp4(q, s) - x.float()).norm() / x.float().norm()
    assert rel < 0.2


def test_nvfp4_matches_reference():
    x = _x(4, 128, 3)
    q, s, gs = aq.quant_nvfp4(x)
    rq, rs, rgs = aq.ref_quant_nvfp4(x)
    assert s.dtype == torch.float8_e4m3fn and s.shape == (4, 8)
    assert torch.equal(q, rq) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8)) and torch.equal(gs, rgs)
    torch.testing.assert_close(gs, x.float().abs().amax().reshape(1) / (6 * 448))
    rel = (aq.dequant_nvfp4(q, s, gs) - x.float()).norm() / x.float().norm()
    assert rel < 0.15
    # a calibrated global scale is used as given
    q2, s2, gs2 = aq.quant_nvfp4(x, torch.tensor([gs.item() * 2]))
    assert gs2.item() == pytest.approx(gs.item() * 2)


def test_silu_mul_and_fused_fp8():
    h = torch.randn(5, 2 * 96)
    torch.testing.assert_close(aq.silu_mul(h), aq.ref_silu_mul(h), rtol=1e-6, atol=1e-6)
    hb = h.to(torch.bfloat16)
    assert torch.equal(aq.silu_mul(hb), aq.ref_silu_mul(hb).to(torch.bfloat16))
    q, s = aq.silu_mul_fp8(h)
    rq, rs = aq.ref_quant_fp8(aq.ref_silu_mul(h))
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    # a last-ulp difference in exp() may flip a rounding: allow at most one e4m3 step on a few elements
    diff = (aq.dequant_8bit(q, s) - aq.dequant_8bit(rq, rs)).abs()
    assert (diff <= aq.ref_silu_mul(h).abs() * 2 ** -3 + 1e-6).all()
    assert (q.view(torch.uint8) != rq.view(torch.uint8)).float().mean() < 0.01


@pytest.mark.parametrize("fn,shape", [(aq.quant_mxfp4, (4, 48)), (aq.quant_nvfp4, (4, 40)), (aq.quant_fp8, (8,))])
def test_bad_shapes_raise(fn, shape):
    with pytest.raises(ValueError):
        fn(torch.randn(*shape))
