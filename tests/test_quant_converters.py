"""Round-trip tests: build each checkpoint format's tensors from a known float weight the way the real tool packs
them, convert to the internal layout, dequantize, and compare with the tool's own dequant formula."""
import numpy as np
import pytest
import torch

from kestrel.quant import (QuantSpec, dequantize, from_awq, from_compressed_tensors, from_fp8, from_gguf, from_gptq,
                           from_mxfp4, from_nvfp4, quantize)

N, K = 48, 256
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _words(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack along the last dim, element i of a word at bit i*bits (the plain per-word loop the tools use)."""
    per = 32 // bits
    v = vals.to(torch.int64).reshape(*vals.shape[:-1], -1, per)
    w = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for i in range(per):
        w |= v[..., i] << (bits * i)
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def _bitstream(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack along the last dim as a continuous little-endian bit stream (GPTQ 3-bit), by explicit bit loop."""
    flat = vals.to(torch.int64).reshape(-1, vals.shape[-1])
    out = torch.zeros(flat.shape[0], -(-vals.shape[-1] * bits // 32), dtype=torch.int64)  # last word padded
    for j in range(vals.shape[-1]):
        for b in range(bits):
            pos = j * bits + b
            out[:, pos // 32] |= ((flat[:, j] >> b) & 1) << (pos % 32)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.reshape(*vals.shape[:-1], -1)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("bits,sym,act_order,fmt", [(4, True, False, "gptq"), (4, False, True, "gptq"),
                                                    (4, True, True, "gptq_v2"), (3, False, False, "gptq"),
                                                    (8, True, True, "gptq"), (2, False, False, "gptq_v2")])
def test_gptq(bits, sym, act_order, fmt):
    g = torch.Generator().manual_seed(bits * 10 + act_order)
    gs = 64
    W = torch.randn(N, K, generator=g)
    order = torch.randperm(K, generator=g) if act_order else torch.arange(K)
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[order] = (torch.arange(K) // gs).to(torch.int32)
    G, maxq = K // gs, 2**bits - 1
    scales, zeros = torch.empty(G, N), torch.empty(G, N, dtype=torch.int64)
    for gi in range(G):
        cols = W[:, g_idx == gi]
        if sym:
            scales[gi] = cols.abs().amax(1) * 2 / maxq
            zeros[gi] = (maxq + 1) // 2
        else:
            lo, hi = cols.amin(1), cols.amax(1)
            scales[gi] = (hi - lo) / maxq
            zeros[gi] = torch.round(-lo / scales[gi]).long()
    scales = scales.half()
    s_k, z_k = scales.float()[g_idx.long()].t(), zeros[g_idx.long()].t()  # [N, K]
    q = torch.clamp(torch.round(W / s_k) + z_k, 0, maxq).long()
    expected = (q - z_k) * s_k
    stored_z = (zeros - 1) & maxq if fmt == "gptq" else zeros
    qweight = _bitstream(q, bits).t().contiguous()  # [K*bits/32, N]
    qzeros = _bitstream(stored_z, bits)
    qw = from_gptq(qweight, qzeros, scales, bits=bits, group_size=gs, g_idx=g_idx if act_order else None,
                   sym=sym, checkpoint_format=fmt)
    assert qw.spec.act_order == act_order and qw.spec.has_zero_point == (not sym)
    assert _rel(dequantize(qw), expected) < 1e-6


def test_gptq_bad_g_idx():
    qw = quantize(torch.randn(N, K), QuantSpec("uint4", group_size=64))
    with pytest.raises(ValueError):
        from_gptq(_bitstream(torch.zeros(N, K, dtype=torch.long), 4).t().contiguous(),
                  _bitstream(torch.zeros(4, N, dtype=torch.long), 4), qw.scales.half(), bits=4, group_size=64,
                  g_idx=torch.zeros(K, dtype=torch.int32))


def test_awq():
    g = torch.Generator().manual_seed(1)
    gs = 64
    W = torch.randn(K, N, generator=g)  # AWQ keeps [in, out]
    Wg = W.reshape(K // gs, gs, N)
    lo, hi = Wg.amin(1), Wg.amax(1)
    s = ((hi - lo) / 15).half()
    z = torch.round(-lo / s.float()).clamp(0, 15).long()
    q = torch.clamp(torch.round(Wg / s.float()[:, None]) + z[:, None], 0, 15).long().reshape(K, N)
    expected = ((q.reshape(K // gs, gs, N) - z[:, None]) * s.float()[:, None]).reshape(K, N).t()
    order = [0, 2, 4, 6, 1, 3, 5, 7]

    def awq_pack(x):
        w = torch.zeros(x.shape[0], x.shape[1] // 8, dtype=torch.int64)
        for c in range(x.shape[1] // 8):
            for j in range(8):
                w[:, c] |= x[:, c * 8 + order[j]] << (4 * j)
        return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)

    qw = from_awq(awq_pack(q), awq_pack(z), s, group_size=gs)
    assert _rel(dequantize(qw), expected) < 1e-6


@pytest.mark.parametrize("sym,gs", [(True, 32), (False, 128), (True, None)])
def test_compressed_tensors(sym, gs):
    g = torch.Generator().manual_seed(2)
    W = torch.randn(N, K, generator=g)
    grp = K if gs is None else gs
    Wg = W.reshape(N, K // grp, grp)
    if sym:
        s = (Wg.abs().amax(-1) / 7).bfloat16()
        zp = torch.zeros_like(s, dtype=torch.int64)
    else:
        lo, hi = Wg.amin(-1), Wg.amax(-1)
        s = ((hi - lo) / 15).bfloat16()
        zp = (torch.round(-lo / s.float()) - 8).clamp(-8, 7).long()
    q = torch.clamp(torch.round(Wg / s.float()[..., None]) + zp[..., None], -8, 7).long()
    expected = ((q - zp[..., None]) * s.float()[..., None]).reshape(N, K)
    packed = _words(q.reshape(N, K) + 8, 4)
    zpp = None if sym else _words((zp + 8).t().contiguous(), 4).t().contiguous()  # packed along N (dim 0)
    qw = from_compressed_tensors(packed, s, zpp, num_bits=4, group_size=gs)
    assert _rel(dequantize(qw), expected) < 1e-6


@pytest.mark.parametrize("dt,per_channel", [(torch.float8_e4m3fn, False), (torch.float8_e4m3fn, True),
                                             (torch.float8_e5m2, True)])
def test_fp8(dt, per_channel):
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(3))
    s = W.abs().amax(1, keepdim=True) / 448 if per_channel else W.abs().max() / 448
    w8 = (W / s).clamp(-448, 448).to(dt)
    expected = w8.float() * s
    assert _rel(dequantize(from_fp8(w8, s)), expected) < 1e-6


def _fp4_codes(x):
    a = x.abs().clamp(max=6.0)
    code = (a[..., None] - E2M1).abs().argmin(-1)
    return code | ((x < 0).long() << 3)


def _fp4_value(code):
    return E2M1[code & 7] * torch.where(code >= 8, -1.0, 1.0)


def test_mxfp4():
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(4))
    Wb = W.reshape(N, K // 32, 32)
    e = torch.floor(torch.log2(Wb.abs().amax(-1))) - 2  # OCP: shared exp = floor(log2(amax)) - emax(e2m1)
    codes = _fp4_codes(Wb / torch.exp2(e)[..., None]).reshape(N, K)
    expected = (_fp4_value(codes).reshape(N, K // 32, 32) * torch.exp2(e)[..., None]).reshape(N, K)
    blocks = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).reshape(N, K // 32, 16)  # gpt-oss layout
    qw = from_mxfp4(blocks, (e + 127).to(torch.uint8))
    assert _rel(dequantize(qw), expected) < 1e-6


@pytest.mark.parametrize("divisor", [True, False])
def test_nvfp4(divisor):
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(5))
    gmul = W.abs().max() / (448 * 6)
    Wb = W.reshape(N, K // 16, 16)
    bs = (Wb.abs().amax(-1) / 6 / gmul).to(torch.float8_e4m3fn)
    eff = bs.float() * gmul
    codes = _fp4_codes(Wb / eff[..., None]).reshape(N, K)
    expected = (_fp4_value(codes).reshape(N, K // 16, 16) * eff[..., None]).reshape(N, K)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    gs = 1.0 / gmul if divisor else gmul
    qw = from_nvfp4(packed, bs, torch.as_tensor(gs), global_scale_is_divisor=divisor)
    assert _rel(dequantize(qw), expected) < 1e-5


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf(qtype):
    gguf = pytest.importorskip("gguf")
    t = getattr(gguf.GGMLQuantizationType, qtype)
    W = np.random.default_rng(6).standard_normal((N, K)).astype(np.float32)
    raw = gguf.quants.quantize(W, t)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, t).reshape(N, K))
    qw = from_gguf(raw, qtype, (N, K))
    assert _rel(dequantize(qw), expected) < 1e-5


def test_gguf_unaligned_k():
    gguf = pytest.importorskip("gguf")
    W = np.random.default_rng(7).standard_normal((N, 96)).astype(np.float32)  # K=96: 3 blocks, not a packed block
    raw = gguf.quants.quantize(W, gguf.GGMLQuantizationType.Q4_0)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0).reshape(N, 96))
    assert _rel(dequantize(from_gguf(raw, "Q4_0", (N, 96))), expected) < 1e-5


def test_bad_inputs():
    with pytest.raises(ValueError):
        QuantSpec("int9")
    with pytest.raises(ValueError):
        quantize(torch.randn(4, 100, 2), QuantSpec("int4", group_size=32))
    with pytest.raises(ValueError):
        from_gguf(np.zeros(10, np.uint8), "Q4_0", (N, K))
