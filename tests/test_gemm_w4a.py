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
from kestrel.kernels.lowbit_gemm import A_FP8, GemmConfig, Operand, int4_to_e4m3, int4_to_f32, max_block_k

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
    y = w4a8_linear(x.to(torch.bfloat16), qw, bf16_max_m=0)  # the fp8 kernels (not the small-M WNA16 path)
    a, s = aq.ref_quant_fp8(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    assert _rel(y, aq.dequant_8bit(a, s) @ qw.dequantize().t()) < 4e-3


@pytest.mark.parametrize("group,layout", [(128, "halves"), (128, "pairs"), (256, "halves"), (-1, "pairs")])
def test_w4a8_small_m_runs_on_wna16(group, layout):
    """M <= BF16_MAX_M: W4Weight.wna16() is the same weight (planar codes, bf16 scales), and w4a8_linear /
    gemm_w4a8 on it give the W4A8 product (fp8-grid activations) up to bf16 roundings."""
    from kestrel.kernels import gemm_w4a8 as g4
    from kestrel.quant import dequantize
    M, N, K = 6, 64, 512
    x, w = _data(M, N, K, 7)
    qw = quantize_weight_w4(w, "int4", group)
    if layout == "halves":
        qw = qw.kernel_layout()
    tw = qw.wna16()
    assert tw is qw.wna16()  # made once
    assert tw.spec.weight_dtype == "int4" and tw.spec.group_size == (-1 if group == -1 else group)
    assert torch.equal(dequantize(tw).float(), (qw.dequantize() / qw.scale.repeat_interleave(
        K // qw.scale.shape[1], 1)).round() * qw.scale.to(torch.bfloat16).float().repeat_interleave(
        K // qw.scale.shape[1], 1))  # codes exact, scales rounded to bf16
    xb = x.to(torch.bfloat16)
    a, s = aq.ref_quant_fp8(xb)
    ref = aq.dequant_8bit(a, s) @ qw.dequantize().t()
    assert g4.use_wna16(M, qw)
    y = w4a8_linear(xb, qw)
    assert y.dtype == torch.bfloat16 and _rel(y, ref) < 8e-3
    assert _rel(gemm_w4a8(a, s, qw, torch.float32), ref) < 8e-3
    assert not g4.use_wna16(M, quantize_weight_w4(w, "int4", 32))
    assert not g4.use_wna16(M, quantize_weight_w4(w, "nvfp4"))
    assert not g4.use_wna16(g4.BF16_MAX_M + 1, qw)


def test_w4a8_mxfp4_small_m_runs_on_wna16():
    """MXFP4 at M <= BF16_MAX_M: the WNA16 twin holds the same e2m1 codes and e8m0 scales (dequantizes to exactly
    W4Weight.dequantize()), and w4a8_linear / gemm_w4a8 give the W4A8 product (fp8-grid activations)."""
    from kestrel.kernels import gemm_w4a8 as g4
    from kestrel.quant import dequantize
    M, N, K = 5, 48, 384
    x, w = _data(M, N, K, 11)
    qw = quantize_weight_w4(w, "mxfp4")
    tw = qw.wna16()
    assert tw is qw.wna16() and tw.spec.weight_dtype == "fp4_e2m1" and tw.spec.scale_dtype == "e8m0"
    assert torch.equal(dequantize(tw).float(), qw.dequantize())
    xb = x.to(torch.bfloat16)
    a, s = aq.ref_quant_fp8(xb)
    ref = aq.dequant_8bit(a, s) @ qw.dequantize().t()
    assert g4.use_wna16(M, qw)
    assert _rel(w4a8_linear(xb, qw), ref) < 8e-3
    assert _rel(gemm_w4a8(a, s, qw, torch.float32), ref) < 8e-3
    assert not g4.use_wna16(M, quantize_weight_w4(w[:, :320], "mxfp4"))  # K not a multiple of 128


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


def test_mxfp4_fold_is_exact_and_the_w4a8_fold_path(monkeypatch):
    """lowbit_tma.mxfp4_fold_to_fp8: every e2m1 code times 2^0 .. 2^-8 (the fold's whole range, each group's
    exponent 0..8 under its channel's largest) becomes an e4m3 value that, times the channel scale, equals
    dequantize() bit for bit. Through gemm_w4a8 (KESTREL_W4A8_FOLD_MIN_M on) the product equals the FP8 matmul of
    the dequantized weight; a weight with a group 9 binades down is not folded (fold_base None) and takes the old
    path, which still matches."""
    import kestrel.kernels.gemm_w4a8 as g4
    import kestrel.kernels.lowbit_tma as lt

    M, N, K = 40, 16, 16 * 32  # 16 groups per channel: relative exponents 0, -1, ..., -8, 0, -1, ...
    codes = torch.arange(N * K) % 16  # every code (both signs) in every group
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).view(N, K // 2)
    top = 120 + torch.arange(N)[:, None]  # the channel's largest exponent, different per channel
    scale = (top - torch.arange(16)[None, :] % 9).to(torch.uint8)
    w = g4.W4Weight("mxfp4", packed, scale, 32)
    down, chan = w.fold_base()
    fold = lt.mxfp4_fold_to_fp8
    w8 = fold(w.packed, down)
    assert torch.equal(w8.float() * chan[:, None], w.dequantize())
    x = torch.randn(M, K)
    a_q, a_s = aq.ref_quant_fp8(x)
    ref = aq.dequant_8bit(a_q, a_s) @ w.dequantize().t()
    monkeypatch.setattr(g4, "FOLD_MIN_M", 16)
    monkeypatch.setattr(g4, "BF16_MAX_M", 0)  # (else M = 40 takes the WNA16 kernels)
    calls = []
    monkeypatch.setattr(lt, "mxfp4_fold_to_fp8", lambda *a: calls.append(1) or fold(*a))
    y = gemm_w4a8(a_q, a_s, w, torch.float32)
    assert calls and _rel(y, ref) < 1e-5
    # the in-register fold of the Triton W4A8 kernel (lowbit_gemm.S_FOLD), both orientations, 128-deep K tiles
    monkeypatch.setattr(g4, "FOLD_KERNEL", True)
    for swap in (0, 1):
        cfg = GemmConfig(BM=16 if swap else 32, BN=16, BK=128, num_warps=4, num_stages=2, SWAP_AB=swap)
        assert max_block_k(Operand(A_FP8, a_q, a_s), w.operand(fold=True), K) == 128  # (32 unfolded)
        assert _rel(gemm_w4a8(a_q, a_s, w, torch.float32, config=cfg), ref) < 1e-5, swap
    wide = g4.W4Weight("mxfp4", packed.clone(), torch.cat([scale[:, :8], scale[:, 8:] - 1], 1), 32)
    assert wide.fold_base() is None
    y2 = gemm_w4a8(a_q, a_s, wide, torch.float32)
    assert len(calls) == 1
    assert _rel(y2, aq.dequant_8bit(a_q, a_s) @ wide.dequantize().t()) < 1e-5


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


@pytest.mark.parametrize("layout", ["halves", "pairs"])
@pytest.mark.parametrize("bm,split", [(64, 1), (64, 2), (64, 4), (32, 1), (32, 4)])
def test_w4a8_m64_split_and_small_tiles(bm, split, layout):
    """the M = 64 options for W4A8's under-filled grid (KESTREL_W4A8_SPLIT, the tune candidates): swapped 64- or
    32-row tiles, K split in up to 4 fp32-atomic parts (each part whole 128-groups), bf16 out, vs dequant-matmul."""
    M, N, K = 64, 128, 1024
    x, w = _data(M, N, K, 11)
    qw = quantize_weight_w4(w, "int4", 128)
    if layout == "halves":
        qw = qw.kernel_layout()
    a, s = aq.ref_quant_fp8(x)
    ref = aq.dequant_8bit(a, s) @ qw.dequantize().t()
    cfg = GemmConfig(BM=bm, BN=64, BK=128, SPLIT_K=split, num_warps=4, num_stages=4, SWAP_AB=1)
    assert _rel(gemm_w4a8(a, s, qw, torch.float32, cfg), ref) < 1e-5
    y = gemm_w4a8(a, s, qw, torch.bfloat16, cfg)
    assert y.dtype == torch.bfloat16 and _rel(y, ref) < 4e-3


def test_w4a8_split_heuristic(monkeypatch):
    """KESTREL_W4A8_SPLIT (lowbit_gemm.W4A8_SPLIT): off (1, the default) the session-10 M = 64 tile; on, K parts
    only while the grid is under one wave (grid_fill_split), and never a part of fewer than four 128-groups."""
    from kestrel.kernels import lowbit_gemm as lg
    h = lambda M, N, K: lg.heuristic_config(M, N, K, lg.A_FP8, lg.W_INT4)
    monkeypatch.setattr(lg, "W4A8_SPLIT", 1)
    assert (h(64, 4096, 14336).BM, h(64, 4096, 14336).BN, h(64, 4096, 14336).SPLIT_K) == (64, 64, 1)
    monkeypatch.setattr(lg, "W4A8_SPLIT", 4)
    assert h(64, 4096, 14336).SPLIT_K == 4  # 64 CTAs -> 128 -> 256: stops past one wave
    assert h(64, 8192, 28672).SPLIT_K == 2  # 128 CTAs -> 256
    assert h(64, 28672, 4096).SPLIT_K == 1  # 448 CTAs: no split
    assert h(64, 256, 1024).SPLIT_K == 2  # K 1024: parts of 512 at most two
    assert h(1024, 4096, 14336).SPLIT_K == 1  # large M: the 128 x 128 tile, no split
    x, w = _data(64, 128, 1024, 12)
    qw = quantize_weight_w4(w, "int4", 128).kernel_layout()
    a, s = aq.ref_quant_fp8(x)
    cfg = h(64, 128, 1024)
    assert cfg.SPLIT_K == 2
    assert _rel(gemm_w4a8(a, s, qw, torch.float32, cfg), aq.dequant_8bit(a, s) @ qw.dequantize().t()) < 1e-5


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


def _run_w4a8_ptx(asm: str, word: int) -> tuple[int, int]:
    regs = run_ptx(asm, {"$2": word})
    return regs["$0"], regs["$1"]


def run_ptx(asm: str, regs: dict) -> dict:
    """Tiny emulator of the decode PTX (lowbit_gemm._int4x4_asm, gemm_w4a8_tcg's e4m3 decodes), following the PTX
    ISA: lop3 by its truth table, f16x2 math rounded once (exact here), cvt .f16x2 -> e4m3x2 puts the upper half's
    byte in the upper byte, prmt picks byte sel_k of {b, a} (a = bytes 0..3), mov {lo, hi} packs lo in the low
    half. regs: the operands ($1 ...); returns every register."""
    regs = dict(regs)

    def val(t):
        return regs[t] if t in regs else int(t, 0)

    def f16(v):
        return torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16).view(torch.float16).float()

    def pack16(x):
        h = x.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
        return int(h[0]) | (int(h[1]) << 16)

    body = asm.strip().strip("{}")
    for ins in (i.strip() for i in body.replace("\n", ";").split(";")):
        if not ins or ins.startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        if "{" in args:  # mov.b32 d, {lo, hi}
            d, rest = args.split(",", 1)
            lo, hi = (t.strip() for t in rest.strip().strip("{}").split(","))
            regs[d.strip()] = val(lo) | (val(hi) << 16)
            continue
        d, *src = [t.strip() for t in args.split(",")]
        v = [val(t) for t in src]
        if op == "mov.b32":
            r = v[0]
        elif op in ("shr.b32", "shr.u32"):
            r = v[0] >> v[1]
        elif op == "shl.b32":
            r = v[0] << v[1]
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "xor.b32":
            r = v[0] ^ v[1]
        elif op == "not.b32":
            r = ~v[0]
        elif op == "mul.lo.u32":
            r = v[0] * v[1]
        elif op == "mad.lo.u32":
            r = v[0] * v[1] + v[2]
        elif op == "mul.rn.f16x2":
            r = pack16(f16(v[0]) * f16(v[1]))
        elif op in ("sub.rn.f16x2",):
            r = pack16(f16(v[0]) - f16(v[1]))
        elif op == "lop3.b32":
            r = sum((((v[3] >> (((v[0] >> i) & 1) << 2 | ((v[1] >> i) & 1) << 1 | ((v[2] >> i) & 1))) & 1) << i)
                    for i in range(32))
        elif op == "sub.f16x2":
            r = pack16(f16(v[0]) - f16(v[1]))
        elif op == "fma.rn.f16x2":
            r = pack16(f16(v[0]) * f16(v[1]) + f16(v[2]))
        elif op == "cvt.rn.satfinite.e4m3x2.f16x2":
            e = f16(v[0]).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
            r = int(e[0]) | (int(e[1]) << 8)
        elif op == "prmt.b32":
            both = v[0] | (v[1] << 32)
            r = sum(((both >> (8 * ((v[2] >> (4 * k)) & 7))) & 0xFF) << (8 * k) for k in range(4))
        else:
            raise AssertionError(f"emulator lacks {op}")
        regs[d] = r & 0xFFFFFFFF
    return regs


def test_w4a8_asm_decode_ptx_semantics():
    """DECODE_ASM variant 1 (byte order 0x3120) decodes 4 packed bytes to the e4m3 codes of their signed nibbles;
    variant 2 (0x2031) would be right only if cvt packed the halves the other way round, which the ISA rules out."""
    from kestrel.kernels import lowbit_gemm
    g = torch.Generator().manual_seed(5)
    for word in [0, 0xFFFFFFFF, 0x87654321] + [int(v) & 0xFFFFFFFF for v in torch.randint(-2**31, 2**31 - 1, (64,), generator=g)]:
        nib = [(word >> (4 * i)) & 15 for i in range(8)]
        e4m3 = lambda c: int(torch.tensor([float((c ^ 8) - 8)]).to(torch.float8_e4m3fn).view(torch.uint8))  # noqa: E731
        want_lo = sum(e4m3(nib[2 * b]) << (8 * b) for b in range(4))  # low nibble of byte b -> byte b of $0
        want_hi = sum(e4m3(nib[2 * b + 1]) << (8 * b) for b in range(4))
        assert _run_w4a8_ptx(lowbit_gemm._int4x4_asm("0x3120"), word) == (want_lo, want_hi), hex(word)
        if word not in (0, 0xFFFFFFFF):
            assert _run_w4a8_ptx(lowbit_gemm._int4x4_asm("0x2031"), word) != (want_lo, want_hi)
