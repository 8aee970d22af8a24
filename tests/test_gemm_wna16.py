"""WNA16 Triton GEMM vs the reference dequantize-then-matmul, every weight format, on the CPU interpreter.

Tolerance (relative Frobenius error against x.float() @ dequantize(W).T in fp32): 1e-2 for every format. The
kernel's own rounding is the bf16/fp16 output (~2^-9) plus, where the group scale is applied inside the K tile
or for non-integer zeros, bf16 rounding of the scaled weight; a wrong bit, shift, scale or zero gives O(1) errors.
"""
import os

import pytest
import torch

from kestrel.kernels.configs import ComputeConfig
from kestrel.kernels.gemm_wna16 import gemm_wna16
from kestrel.quant import QuantSpec, dequantize, from_gguf, from_gptq, quantize
from kestrel.quant.packing import pack_bitstream

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a GPU")
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
N, K, TOL = 64, 256, 1e-2
FORMATS = [
    QuantSpec("int4", group_size=128), QuantSpec("uint4", has_zero_point=True, group_size=32, scale_dtype="fp16"),
    QuantSpec("int8", group_size=-1), QuantSpec("int3", group_size=64), QuantSpec("uint2", has_zero_point=True, group_size=64),
    QuantSpec("int5", group_size=128),
    QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0"),
    QuantSpec("fp4_e2m1", group_size=16, scale_dtype="fp8_e4m3", global_scale=True),
    QuantSpec("fp8_e4m3", group_size=-1, scale_dtype="fp32"), QuantSpec("fp8_e5m2", group_size=128, scale_dtype="fp16"),
    QuantSpec("fp6_e3m2", group_size=32), QuantSpec("fp6_e2m3", group_size=64),
]


def _check(qw, m, cfg=None, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed + m)
    x = torch.randn(m, qw.shape[1], generator=g).to(dtype)
    ref = x.double() @ dequantize(qw).double().t()
    y = gemm_wna16(x.to(DEV), qw.to(DEV), cfg).cpu()
    assert y.dtype == dtype and y.shape == (m, qw.shape[0])
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < TOL, f"{qw.spec.name} M={m} cfg={cfg}: rel err {err:.3g}"


@pytest.mark.parametrize("spec", FORMATS, ids=lambda s: s.name)
@pytest.mark.parametrize("m", [1, 5, 33, 100, 300])
def test_formats_default_config(spec, m):
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(1))
    _check(quantize(W, spec), m)


@pytest.mark.parametrize("cfg", [
    ComputeConfig("gemv", 1, 32, 0, split_k=2, num_warps=1, num_stages=2),  # split-K GEMV
    ComputeConfig("gemv", 1, 64, 0, split_k=1, num_warps=2, num_stages=1),
    ComputeConfig("dot", 16, 32, 0, split_k=2, num_stages=2),               # split-K tensor-core path
    ComputeConfig("dot", 32, 64, 0, split_k=1, num_stages=1, num_warps=2),
    ComputeConfig("dequant_mm", 1, 32, 64),                                  # Triton dequant + matmul
    ComputeConfig("dequant_mm", 1, 32, 128, num_warps=4, chunks=2),          # column blocks (side stream on GPU)
], ids=lambda c: f"{c.kernel}-bn{c.block_n}-bk{c.block_k}-sk{c.split_k}")
@pytest.mark.parametrize("spec", [QuantSpec("int4", group_size=128),
                                  QuantSpec("uint4", has_zero_point=True, group_size=64, scale_dtype="fp16"),
                                  QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0")], ids=lambda s: s.name)
def test_compute_configs(cfg, spec):
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(2))
    _check(quantize(W, spec), 1 if cfg.kernel == "gemv" else 20, cfg)


MV = ComputeConfig("mv", 16, 32, 0, split_k=1, num_warps=4, num_stages=2)


@pytest.mark.parametrize("spec", FORMATS + [QuantSpec("uint8", has_zero_point=True, group_size=64),
                                            QuantSpec("int2", group_size=16)], ids=lambda s: s.name)
def test_small_m_kernels_every_format(spec):
    # the decode path (tensor-core "mv", swapped "mvs", CUDA-core "gemv") for M = 1..16, one launch with split-K
    W = torch.randn(40, 320, generator=torch.Generator().manual_seed(6))  # N not a tile multiple, K padded
    qw = quantize(W, spec)
    _check(qw, 1, ComputeConfig("gemv", 1, 32, 0, split_k=2, num_warps=1, num_stages=1))
    _check(qw, 3, ComputeConfig("mv", 16, 32, 0, split_k=2, num_warps=4, num_stages=1))  # register prefetch
    _check(qw, 16, ComputeConfig("mvs", 16, 32, 0, split_k=1, num_warps=4, num_stages=2))


@pytest.mark.parametrize("spec", [QuantSpec("int4", group_size=128),
                                  QuantSpec("uint4", has_zero_point=True, group_size=64, scale_dtype="fp16"),
                                  QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0")], ids=lambda s: s.name)
def test_small_m_two_blocks_per_step(spec):
    # block_k = 2 planar blocks per K step; K = 5 blocks so a split ends inside a step (masked tile)
    qw = quantize(torch.randn(48, 5 * spec.k_multiple, generator=torch.Generator().manual_seed(9)), spec)
    bk = 2 * spec.k_multiple
    _check(qw, 1, ComputeConfig("gemv", 1, 32, bk, split_k=2, num_warps=1, num_stages=2))
    _check(qw, 6, ComputeConfig("mv", 16, 32, bk, split_k=2, num_warps=4, num_stages=2))
    _check(qw, 9, ComputeConfig("mvs", 16, 16, bk, split_k=1, num_warps=4, num_stages=2))


@pytest.mark.parametrize("m", list(range(1, 17)))
def test_small_m_every_m(m):
    qw = quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(7)), QuantSpec("int4", group_size=64))
    _check(qw, m, ComputeConfig("mv" if m % 2 else "mvs", 16, 32, 0, split_k=1 + m % 2, num_warps=4, num_stages=2))


def test_split_k_counters_reset_between_calls():
    # the last split of a tile resets its counter: repeated calls (as in CUDA-graph replays) stay correct
    qw = quantize(torch.randn(N, K, generator=torch.Generator().manual_seed(8)), QuantSpec("int4", group_size=128))
    cfg = ComputeConfig("mv", 16, 16, 0, split_k=2, num_warps=4, num_stages=1)
    for seed in range(3):
        _check(qw, 2, cfg, seed=seed)
    _check(qw, 2, cfg, dtype=torch.float16)


@pytest.mark.parametrize("split", [2, 3, 4, 5, 6])
def test_split_k_reduction_every_split_count(split):
    # the last split sums the partials two per step (masked tail): every count of partials, odd and even, K = 6
    # planar blocks so each split gets at least one; a dropped or doubled partial is an O(1) error
    qw = quantize(torch.randn(48, 768, generator=torch.Generator().manual_seed(9)), QuantSpec("int4", group_size=128))
    _check(qw, 3, ComputeConfig("mv", 16, 16, 0, split_k=split, num_warps=4, num_stages=1))


STREAMK_CFGS = [  # (M, config): ComputeConfig.streamk, the persistent stream-K grid of the mv kernel
    (1, ComputeConfig("mv", 16, 32, 0, split_k=1, num_warps=4, num_stages=2, streamk=1)),
    (5, ComputeConfig("mvs", 16, 16, 0, split_k=1, num_warps=1, num_stages=2, streamk=2)),
    (16, ComputeConfig("mv", 16, 16, 0, split_k=1, num_warps=1, num_stages=1, streamk=1)),
    (3, ComputeConfig("mv", 16, 32, 256, split_k=1, num_warps=4, num_stages=2, streamk=1)),  # 2 blocks a step
]


@pytest.mark.parametrize("m, cfg", STREAMK_CFGS, ids=lambda v: f"{v.kernel}-bn{v.block_n}-sk{v.streamk}"
                         if isinstance(v, ComputeConfig) else str(v))
@pytest.mark.parametrize("spec", [QuantSpec("int4", group_size=128),
                                  QuantSpec("uint4", has_zero_point=True, group_size=32, scale_dtype="fp16"),
                                  QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0"),
                                  QuantSpec("int3", group_size=64)], ids=lambda s: s.name)
def test_mv_stream_k(spec, m, cfg):
    """N = 80 (the last N tile partial), K = 640 (4-5 planar blocks a tile), on the CPU's 4 "SMs": programs whose
    block range crosses tiles and tiles cut among 2-3 programs (summed by the ticketed split sum) next to tiles one
    program holds whole (stored directly); a second call checks the counters are left at zero."""
    from kestrel.kernels.gemm_wna16_small import num_sms, streamk_plan
    qw = quantize(torch.randn(80, 640, generator=torch.Generator().manual_seed(12)), spec)
    tiles, blocks = -(-80 // cfg.block_n), -(-640 // spec.k_multiple)
    per, parts, programs = streamk_plan(tiles, blocks, cfg.streamk * num_sms(torch.device("cpu")),
                                        max(1, cfg.block_k // spec.k_multiple))
    assert per % blocks != 0 and programs > 1 and parts >= 2  # really cut / spanning at this size
    _check(qw, m, cfg)
    _check(qw, m, cfg, seed=1)


def test_one_bit_weights():
    W = torch.randn(N, 512, generator=torch.Generator().manual_seed(4))  # 1-bit packing needs K % 512 == 0
    qw = quantize(W, QuantSpec("uint1", has_zero_point=True, group_size=128))
    for m in (1, 5):
        _check(qw, m)
    _check(qw, 4, MV)


@pytest.mark.parametrize("spec", [QuantSpec("int4", group_size=32), QuantSpec("int4", group_size=128),
                                  QuantSpec("uint8", has_zero_point=True, group_size=-1),
                                  QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0")], ids=lambda s: s.name)
def test_k_not_a_multiple_of_the_packed_block(spec):
    # K = 576 (SmolLM2 hidden size): packed K is zero-padded to 640 (int4/fp4) and x is masked; a partial last
    # group (g128) is quantized over its real columns
    W = torch.randn(48, 576, generator=torch.Generator().manual_seed(5))
    qw = quantize(W, spec)
    assert qw.shape == (48, 576) and qw.padded_k % spec.k_multiple == 0
    assert ((dequantize(qw) - W).norm() / W.norm()) < 0.2
    for cfg, m in ((ComputeConfig("gemv", 1, 32, 0, split_k=3, num_warps=1), 1), (None, 1),
                   (ComputeConfig("dot", 16, 32, 0, split_k=2), 6), (ComputeConfig("dequant_mm", 1, 32, 128), 3)):
        _check(qw, m, cfg)


def test_fp16_activations_and_batch_dims():
    qw = quantize(torch.randn(N, K), QuantSpec("int4", group_size=64, scale_dtype="fp16"))
    _check(qw, 3, dtype=torch.float16)
    x = torch.randn(2, 3, K).bfloat16()
    y = gemm_wna16(x.to(DEV), qw.to(DEV)).cpu()
    ref = (x.float().reshape(6, K) @ dequantize(qw).t()).reshape(2, 3, N)
    assert y.shape == (2, 3, N) and ((y.float() - ref).norm() / ref.norm()) < TOL


def test_gptq_act_order_weight():
    g = torch.Generator().manual_seed(3)
    gs, bits = 64, 4
    q = torch.randint(0, 16, (N, K), generator=g)
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[torch.randperm(K, generator=g)] = (torch.arange(K) // gs).to(torch.int32)
    scales = (torch.rand(K // gs, N, generator=g) * 0.1 + 0.01).half()
    zeros = torch.randint(0, 16, (K // gs, N), generator=g)
    qw = from_gptq(pack_bitstream(q, bits, dim=1).t().contiguous(), pack_bitstream((zeros - 1) & 15, bits, dim=1),
                   scales, bits=bits, group_size=gs, g_idx=g_idx, sym=False)
    assert qw.perm is not None
    for m in (1, 7):
        _check(qw, m)


def test_gguf_q4_1_weight():
    gguf = pytest.importorskip("gguf")
    W = torch.randn(N, K).numpy()
    qw = from_gguf(gguf.quants.quantize(W, gguf.GGMLQuantizationType.Q4_1), "Q4_1", (N, K))
    _check(qw, 4)


def test_bad_inputs():
    qw = quantize(torch.randn(N, K), QuantSpec("int4"))
    with pytest.raises(ValueError):
        gemm_wna16(torch.randn(2, K + 32).bfloat16(), qw)
    with pytest.raises(ValueError):
        gemm_wna16(torch.randn(2, K), qw)  # fp32 activations are not WNA16
    with pytest.raises(ValueError):
        gemm_wna16(torch.randn(2, K).bfloat16(), qw, ComputeConfig("dequant_mm", 1, 64, 96))  # K % BLOCK_K != 0
    with pytest.raises(ValueError):
        quantize(torch.randn(2, N, K), QuantSpec("int4", group_size=64))  # not a 2-D weight


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_mv_fp4_decode_ptx_semantics(dt):
    # the inline PTX e2m1 decode of the mv kernel (GPU only) run by the tc test's PTX emulator against the reference
    # minifloat decode: every field of random word pairs, so every code, both nibbles and both halves
    from test_gemm_wna16_tc import _run_ptx
    from kestrel.kernels import gemm_wna16_small as sm
    from kestrel.quant.formats import decode_minifloat
    mul = 0x74007400 if dt == torch.float16 else 0x7E807E80
    g = torch.Generator().manual_seed(11)
    for _ in range(24):
        w0, w1 = (int(v) & 0xFFFFFFFF for v in torch.randint(-2**31, 2**31 - 1, (2,), generator=g))
        for f in range(8):
            b = f // 2
            sel = ((4 + b) << 12) | ((4 + b) << 8) | (b << 4) | b
            fp16 = dt == torch.float16
            asm = {(0, 0): sm._ASM_FP4_EVEN_BF16, (1, 0): sm._ASM_FP4_ODD_BF16,
                   (0, 1): sm._ASM_FP4_EVEN_F16, (1, 1): sm._ASM_FP4_ODD_F16}[(f % 2, int(fp16))]
            out = _run_ptx(asm.value, [w0, w1, sel, sel, mul, mul])
            got = torch.tensor([out & 0xFFFF, out >> 16], dtype=torch.int32).to(torch.int16).view(dt).float()
            want = decode_minifloat(torch.tensor([(w0 >> 4 * f) & 15, (w1 >> 4 * f) & 15]), 2, 1).float()
            assert torch.equal(got, want), (f, hex(w0), hex(w1), got, want)


@pytest.mark.parametrize("spec", [QuantSpec("int4", group_size=128),
                                  QuantSpec("uint4", has_zero_point=True, group_size=32, scale_dtype="fp16"),
                                  QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0"),
                                  QuantSpec("fp4_e2m1", group_size=16, scale_dtype="fp8_e4m3", global_scale=True)],
                         ids=lambda s: s.name)
@pytest.mark.parametrize("m", [1, 5, 8, 11])
def test_mvs_block_m_8(spec, m):
    # mvs with x as an 8-wide MMA N side (M <= 8 in one row block; M = 11 takes two), split-K, 2 blocks per step
    qw = quantize(torch.randn(40, 5 * spec.k_multiple, generator=torch.Generator().manual_seed(12)), spec)
    _check(qw, m, ComputeConfig("mvs", 8, 32, 0, split_k=2, num_warps=1, num_stages=3))
    _check(qw, m, ComputeConfig("mvs", 8, 16, 2 * spec.k_multiple, split_k=2, num_warps=2, num_stages=2))


@pytest.mark.parametrize("fold", [True, False], ids=["fold", "nofold"])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mag", [1e-4, 1.0, 300.0])
def test_mxfp4_scale_fold(fold, dt, mag, monkeypatch):
    # e8m0 scales folded into the decoded weights (mv / mvs, bf16; fp16 keeps the per-group scale) vs not, over
    # scales from ~2^-20 to ~2^6 (inside the exact range of FOLD_EXP), split-K and a masked two-block step; the
    # folded path reads the 4 codes of a block from one word (SCALE_WORDS: fails with a wrong byte)
    from kestrel.kernels import gemm_wna16_small as sm
    monkeypatch.setattr(sm, "FOLD_E8M0", fold)  # (default off until GPU-measured)
    spec = QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0")
    qw = quantize(torch.randn(48, 5 * 128, generator=torch.Generator().manual_seed(13)) * mag, spec)
    fmt = {"IS_INT": False, "SCALE_KIND": 1, "PER_CHANNEL": False, "EXP_BITS": 2, "MAN_BITS": 1, "GROUP_SIZE": 32,
           "R": 16}
    assert sm.fold_e8m0(fmt, dt) == (fold and dt == torch.bfloat16)
    assert sm.scale_words({**fmt, "EPW": 8}, sm.fold_e8m0(fmt, dt)) == (fold and dt == torch.bfloat16)  # e8m0_words
    _check(qw, 3, ComputeConfig("mv", 16, 32, 256, split_k=2, num_warps=4, num_stages=2), dtype=dt)
    _check(qw, 7, ComputeConfig("mvs", 8, 16, 0, split_k=3, num_warps=1, num_stages=3), dtype=dt)
    _check(qw, 2, ComputeConfig("mv", 16, 16, 0, split_k=1, num_warps=1, num_stages=1), dtype=dt)


def test_mv_fp4_fold_multiplier_ptx_semantics():
    # the folded multiplier (bf16 2^(e-1-FOLD_EXP)) in the e2m1 PTX gives value * 2^(e-127) * 2^-FOLD_EXP exactly
    from test_gemm_wna16_tc import _run_ptx
    from kestrel.kernels import gemm_wna16_small as sm
    from kestrel.quant.formats import decode_minifloat
    g = torch.Generator().manual_seed(14)
    fe = sm.FOLD_EXP.value
    for e in (fe - 5, 100, 120, 127, 135, fe + 128):
        mb = min(max(e + 126 - fe, 1), 254) << 7
        for _ in range(6):
            w0, w1 = (int(v) & 0xFFFFFFFF for v in torch.randint(-2**31, 2**31 - 1, (2,), generator=g))
            for f in range(8):
                b = f // 2
                sel = ((4 + b) << 12) | ((4 + b) << 8) | (b << 4) | b
                asm = sm._ASM_FP4_ODD_BF16 if f % 2 else sm._ASM_FP4_EVEN_BF16
                out = _run_ptx(asm.value, [w0, w1, sel, sel, mb | (mb << 16), mb | (mb << 16)])
                got = torch.tensor([out & 0xFFFF, out >> 16], dtype=torch.int32).to(torch.int16).view(
                    torch.bfloat16).double()
                want = decode_minifloat(torch.tensor([(w0 >> 4 * f) & 15, (w1 >> 4 * f) & 15]), 2, 1).double()
                assert torch.equal(got, want * 2.0 ** (e - 127 - fe)), (e, f, got, want)


def test_mv_fp4_fold_pair_multipliers_ptx_semantics():
    # the two elements of a pair (adjacent registers of whatever layout Triton decodes in) need not share a column:
    # with the manual register prefetch (num_stages 1) the first fields are decoded in the word load's blocked
    # layout (a pair = columns n, n + 1). MUL16 (Triton packs the pair's two 16-bit multipliers into $5) gives each
    # element its own scale; the int32 form (each multiplier twice, the asm reads $5 only) gave the second column
    # the first one's scale, the H200's rel err 0.2 at s1 (session 10): that form must fail here
    from test_gemm_wna16_tc import _run_ptx
    from kestrel.kernels import gemm_wna16_small as sm
    from kestrel.kernels.configs import ComputeConfig
    from kestrel.quant.formats import decode_minifloat
    assert sm.pair_multipliers(ComputeConfig("mv", 16, 16, 0, split_k=1, num_warps=1, num_stages=1))
    n_in = lambda cons: cons.value.count(",")  # inputs after "=r"
    assert n_in(sm._FP4_CONS_MUL16) == 5 and n_in(sm._FP4_CONS) == 6
    g = torch.Generator().manual_seed(19)
    fe = sm.FOLD_EXP.value
    mbits = lambda e: min(max(e + 126 - fe, 1), 254) << 7
    for e0, e1 in ((120, 127), (127, 100), (fe - 5, 135), (130, 130)):
        for _ in range(4):
            w0, w1 = (int(v) & 0xFFFFFFFF for v in torch.randint(-2**31, 2**31 - 1, (2,), generator=g))
            for f in range(8):
                b = f // 2
                sel = ((4 + b) << 12) | ((4 + b) << 8) | (b << 4) | b
                want = decode_minifloat(torch.tensor([(w0 >> 4 * f) & 15, (w1 >> 4 * f) & 15]), 2, 1).double()
                want = want * torch.tensor([2.0 ** (e0 - 127 - fe), 2.0 ** (e1 - 127 - fe)], dtype=torch.float64)
                for imad in (0, 2):
                    asm = ((sm._ASM_FP4_ODD_BF16_IMAD if imad else sm._ASM_FP4_ODD_BF16) if f % 2 else
                           (sm._ASM_FP4_EVEN_BF16_IMAD if imad else sm._ASM_FP4_EVEN_BF16))
                    for mul16 in (True, False):
                        muls = ([mbits(e0) | (mbits(e1) << 16)] if mul16 else
                                [mbits(e0) * 0x10001, mbits(e1) * 0x10001])
                        out = _run_ptx(asm.value, [w0, w1, sel, sel] + muls)
                        got = torch.tensor([out & 0xFFFF, out >> 16], dtype=torch.int32).to(torch.int16).view(
                            torch.bfloat16).double()
                        ok = torch.equal(got, want)
                        if mul16 or e0 == e1 or not want[1]:
                            assert ok, (e0, e1, f, imad, mul16, got, want)
                        else:  # the int32 form: element 1 scaled by element 0's multiplier
                            assert not ok and got[1] == want[1] * 2.0 ** (e0 - e1), (e0, e1, f, imad, got, want)


@pytest.mark.parametrize("m", [2, 16])
@pytest.mark.parametrize("split", [1, 2])
def test_mxfp4_scale_fold_stages_1(m, split, monkeypatch):
    # FOLD with the manual register prefetch (num_stages 1; FOLD_S1, off by default) vs x @ dequant(W)^T: the
    # session 10 H200 failure's shape (48 x 640, scales ~2^-14 .. 2^3) on every column pairing; on the GPU this
    # runs the MUL16 PTX (the interpreter: the plain Triton fold)
    from kestrel.kernels import gemm_wna16_small as sm
    monkeypatch.setattr(sm, "FOLD_E8M0", True)
    monkeypatch.setattr(sm, "FOLD_S1", True)
    spec = QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0")
    W = torch.randn(48, 5 * 128, generator=torch.Generator().manual_seed(20))
    W = W * torch.logspace(-4, 1, 48).view(48, 1)  # per-column scale spread: a shared multiplier is wrong
    qw = quantize(W, spec)
    for bn, w in ((16, 1), (32, 2)):
        _check(qw, m, ComputeConfig("mv", 16, bn, 0, split_k=split, num_warps=w, num_stages=1), seed=split)


@pytest.mark.parametrize("mul16", [False, True], ids=["mul32", "mul16"])
@pytest.mark.parametrize("mag", [1e-4, 1.0, 300.0])
def test_mxfp4_fold_bias_words(mag, mul16, monkeypatch):
    # FOLD_BIAS_WORDS: the scale words hold clamp(e + 126 - FOLD_EXP, 1, 254) (fold_words), byte j of word (b, n)
    # for group 4b + j; vs x @ dequant(W)^T over scales ~2^-20 .. 2^9, mv (split-K, a masked two-block step, and
    # num_stages 1 with FOLD_S1) and mvs, with the int32 or the 16-bit (MUL16) PTX multipliers on the GPU; fails
    # with a wrong byte, bias or clamp. The PTX multiplier (byte * 0x00800080) is checked below
    from kestrel.kernels import gemm_wna16_small as sm
    monkeypatch.setattr(sm, "FOLD_E8M0", True)
    monkeypatch.setattr(sm, "FOLD_BIAS_WORDS", True)
    monkeypatch.setattr(sm, "FOLD_S1", True)
    monkeypatch.setattr(sm, "MUL16", mul16)
    spec = QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0")
    qw = quantize(torch.randn(48, 5 * 128, generator=torch.Generator().manual_seed(21)) * mag, spec)
    fw = sm.fold_words(qw).view(torch.uint8).view(-1, 48, 4)  # [G / 4, N, group in block]
    want = (qw.scales.to(torch.int32) + 126 - sm.FOLD_EXP.value).clamp(1, 254)
    assert torch.equal(fw.permute(0, 2, 1).reshape(-1, 48).to(torch.int32), want)
    _check(qw, 3, ComputeConfig("mv", 16, 32, 256, split_k=2, num_warps=4, num_stages=2))
    _check(qw, 16, ComputeConfig("mv", 16, 16, 0, split_k=3, num_warps=1, num_stages=3))
    _check(qw, 7, ComputeConfig("mvs", 8, 16, 0, split_k=2, num_warps=1, num_stages=3))
    _check(qw, 2, ComputeConfig("mv", 16, 32, 0, split_k=2, num_warps=2, num_stages=1))


def test_mv_fp4_fold_bias_multiplier_ptx_semantics():
    # FOLD_BIAS_WORDS's multiplier register: fold_words byte c times 0x00800080 (c << 7 in both halves) in the
    # e2m1 PTX gives value * 2^(e - 127 - FOLD_EXP) for the e8m0 code e, as the unbiased form does
    from test_gemm_wna16_tc import _run_ptx
    from kestrel.kernels import gemm_wna16_small as sm
    from kestrel.quant.formats import decode_minifloat
    g = torch.Generator().manual_seed(22)
    fe = sm.FOLD_EXP.value
    for e in (fe - 5, 100, 120, 127, 135, fe + 128):
        c = int((torch.tensor([e], dtype=torch.int16) + (126 - fe)).clamp(1, 254))  # as fold_words stores it
        for _ in range(4):
            w0, w1 = (int(v) & 0xFFFFFFFF for v in torch.randint(-2**31, 2**31 - 1, (2,), generator=g))
            for f in range(8):
                b = f // 2
                sel = ((4 + b) << 12) | ((4 + b) << 8) | (b << 4) | b
                asm = sm._ASM_FP4_ODD_BF16_IMAD if f % 2 else sm._ASM_FP4_EVEN_BF16_IMAD
                out = _run_ptx(asm.value, [w0, w1, sel, sel, c * 0x00800080, c * 0x00800080])
                got = torch.tensor([out & 0xFFFF, out >> 16], dtype=torch.int32).to(torch.int16).view(
                    torch.bfloat16).double()
                want = decode_minifloat(torch.tensor([(w0 >> 4 * f) & 15, (w1 >> 4 * f) & 15]), 2, 1).double()
                assert torch.equal(got, want * 2.0 ** (e - 127 - fe)), (e, f, got, want)


@pytest.mark.parametrize("spec", [QuantSpec("int4", group_size=128), QuantSpec("int4", group_size=32),
                                  QuantSpec("int8", group_size=-1), QuantSpec("int3", group_size=64),
                                  QuantSpec("uint4", has_zero_point=True, group_size=32, scale_dtype="fp16")],
                         ids=lambda s: s.name + f"-g{s.group_size}")
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_mv_int_xsum(spec, dt, monkeypatch):
    # INT_XSUM: the x sum of each group from an MMA of x with a ones tile (d's layout), OFF + c kept by the decode,
    # the offset corrected once per group; mv and mvs, split-K with a masked two-block step, one-stage register
    # prefetch, N not a tile multiple, K padded, x with a nonzero mean (large x sums), zero points (per-column
    # correction). Fails with the correction's offset or sign wrong
    from kestrel.kernels import gemm_wna16_small as sm
    monkeypatch.setattr(sm, "INT_XSUM", True)
    W = torch.randn(40, 5 * spec.k_multiple - (16 if spec.k_multiple > 16 else 0),
                    generator=torch.Generator().manual_seed(24))
    qw = quantize(W, spec)
    for m, cfg in ((1, ComputeConfig("mv", 16, 32, 256, split_k=2, num_warps=4, num_stages=2)),
                   (16, ComputeConfig("mv", 16, 16, 0, split_k=3, num_warps=1, num_stages=1)),
                   (5, ComputeConfig("mvs", 8, 16, 0, split_k=2, num_warps=1, num_stages=3))):
        g = torch.Generator().manual_seed(m)
        x = (torch.randn(m, qw.shape[1], generator=g) + 2.0).to(dt)
        ref = x.double() @ dequantize(qw).double().t()
        y = gemm_wna16(x.to(DEV), qw.to(DEV), cfg).cpu()
        err = ((y.double() - ref).norm() / ref.norm()).item()
        assert err < TOL, f"{spec.name} M={m} cfg={cfg}: rel err {err:.3g}"


def test_mv_fp4_imad_decode_ptx_semantics():
    # the FMA-pipe e2m1 PTX (E2M1_IMAD): value exactly (times the 2^126 multiplier) for every field of random word
    # pairs, so every code, both nibbles and both halves
    from test_gemm_wna16_tc import _run_ptx
    from kestrel.kernels import gemm_wna16_small as sm
    from kestrel.quant.formats import decode_minifloat
    g = torch.Generator().manual_seed(18)
    for _ in range(24):
        w0, w1 = (int(v) & 0xFFFFFFFF for v in torch.randint(-2**31, 2**31 - 1, (2,), generator=g))
        for f in range(8):
            b = f // 2
            sel = ((4 + b) << 12) | ((4 + b) << 8) | (b << 4) | b
            asm = sm._ASM_FP4_ODD_BF16_IMAD if f % 2 else sm._ASM_FP4_EVEN_BF16_IMAD
            out = _run_ptx(asm.value, [w0, w1, sel, sel, 0x7E807E80, 0x7E807E80])
            got = torch.tensor([out & 0xFFFF, out >> 16], dtype=torch.int32).to(torch.int16).view(
                torch.bfloat16).double()
            want = decode_minifloat(torch.tensor([(w0 >> 4 * f) & 15, (w1 >> 4 * f) & 15]), 2, 1).double()
            assert torch.equal(got, want), (f, got, want)


@pytest.mark.parametrize("spec", [QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0"),
                                  QuantSpec("fp4_e2m1", group_size=16, scale_dtype="fp8_e4m3", global_scale=True),
                                  QuantSpec("fp6_e3m2", group_size=32), QuantSpec("int4", group_size=32)],
                         ids=lambda s: s.name)
def test_mv_group_rows(spec, monkeypatch):
    # GROUP_ROWS: the scale groups of a planar block on the mv tile's spare rows (M <= 16 / groups), with split-K
    # (a split ending inside a two-block step), one-stage register prefetch, N not a tile multiple, K padded; M
    # past the limit (and int formats) take the usual path
    from kestrel.kernels import gemm_wna16_small as sm
    monkeypatch.setattr(sm, "GROUP_ROWS", True)
    monkeypatch.setattr(sm, "FOLD_E8M0", False)  # (FOLD takes precedence over GROUP_ROWS for bf16 MXFP4)
    monkeypatch.setattr(sm, "GROUP_ROWS_PARTIAL", False)
    qw = quantize(torch.randn(40, 5 * 128 - 16, generator=torch.Generator().manual_seed(17)), spec)
    g = 128 // spec.group_size
    fmt = {"R": 16, "EPW": 8, "GROUP_SIZE": spec.group_size, "PER_CHANNEL": False, "IS_INT": spec.name == "int4"}
    cfg = ComputeConfig("mv", 16, 32, 256, split_k=2, num_warps=4, num_stages=2)
    assert sm.group_rows(fmt, cfg, 16 // g) == (0 if fmt["IS_INT"] else g)
    assert sm.group_rows(fmt, cfg, 16 // g + 1) == 0
    for m in (1, 16 // g, 16 // g + 1):
        _check(qw, m, cfg, seed=m)
        _check(qw, m, ComputeConfig("mv", 16, 16, 0, split_k=3, num_warps=1, num_stages=1), seed=m)


@pytest.mark.parametrize("spec", [QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0"),
                                  QuantSpec("fp4_e2m1", group_size=16, scale_dtype="fp8_e4m3", global_scale=True)],
                         ids=lambda s: s.name)
def test_mv_group_rows_partial(spec, monkeypatch):
    # GROUP_ROWS_PARTIAL: M past 16 / groups takes the most groups per pass that fit (several passes per block),
    # with split-K, one-stage register prefetch, N not a tile multiple, K padded; M = 9..16 the usual path
    from kestrel.kernels import gemm_wna16_small as sm
    monkeypatch.setattr(sm, "GROUP_ROWS", True)
    monkeypatch.setattr(sm, "FOLD_E8M0", False)  # (FOLD takes precedence over GROUP_ROWS for bf16 MXFP4)
    monkeypatch.setattr(sm, "GROUP_ROWS_PARTIAL", True)
    qw = quantize(torch.randn(40, 5 * 128 - 16, generator=torch.Generator().manual_seed(19)), spec)
    g = 128 // spec.group_size
    fmt = {"R": 16, "EPW": 8, "GROUP_SIZE": spec.group_size, "PER_CHANNEL": False, "IS_INT": False}
    cfg = ComputeConfig("mv", 16, 32, 256, split_k=2, num_warps=4, num_stages=2)
    want = {16 // g: g, 16 // g + 1: g // 2, 8: 2, 9: 0, 16: 0}
    assert {m: sm.group_rows(fmt, cfg, m) for m in want} == want
    for m in (16 // g + 1, 8, 9):
        _check(qw, m, cfg, seed=m)
        _check(qw, m, ComputeConfig("mv", 16, 16, 0, split_k=3, num_warps=1, num_stages=1), seed=m)


@pytest.mark.parametrize("m", [1, 4, 7, 16])
def test_mv_scale_prefetch(m, monkeypatch):
    # SCALE_PREFETCH: the next block's 4 e8m0 scale rows packed into one int32 per column, unpacked per group (plain
    # passes at M = 16, GROUP_ROWS_PARTIAL at M = 7; off where GROUP_ROWS puts all 4 groups on the rows, M = 1 / 4,
    # and on mvs), split-K, N not a tile multiple, K padded
    from kestrel.kernels import gemm_wna16_small as sm
    monkeypatch.setattr(sm, "SCALE_PREFETCH", True)
    monkeypatch.setattr(sm, "FOLD_E8M0", False)  # (SCALE_PREFETCH is the path without FOLD)
    monkeypatch.setattr(sm, "GROUP_ROWS_PARTIAL", True)
    spec = QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0")
    qw = quantize(torch.randn(40, 5 * 128 - 16, generator=torch.Generator().manual_seed(21)), spec)
    fmt = {"R": 16, "EPW": 8, "GROUP_SIZE": 32, "PER_CHANNEL": False, "SCALE_KIND": 1}
    cfg = ComputeConfig("mv", 16, 32, 0, split_k=2, num_warps=4, num_stages=2)
    assert sm.prefetch_scales(fmt, cfg, 1) and not sm.prefetch_scales(fmt, cfg, 2)
    assert sm.prefetch_scales(fmt, cfg, 1, 2) and not sm.prefetch_scales(fmt, cfg, 1, 4)  # off with all 4 groups
    _check(qw, m, cfg, seed=m)
    _check(qw, m, ComputeConfig("mv", 16, 16, 0, split_k=3, num_warps=1, num_stages=3), seed=m + 1)


@pytest.mark.parametrize("m", [1, 4, 7, 8, 16])
def test_mv_scale_words_group_rows(m, monkeypatch):
    # SCALE_WORDS_GROW: the GROUP_ROWS passes (all 4 groups on the rows at M <= 4, 2 per pass at M = 5..8) read the
    # block's 4 e8m0 codes from one int32 of e8m0_words; M = 16 (no GROUP_ROWS) keeps the scale rows. Split-K, one-
    # stage register prefetch, N not a tile multiple, K padded; fails with a wrong byte
    from kestrel.kernels import gemm_wna16_small as sm
    monkeypatch.setattr(sm, "SCALE_WORDS_GROW", True)
    monkeypatch.setattr(sm, "GROUP_ROWS", True)
    monkeypatch.setattr(sm, "FOLD_E8M0", False)  # (FOLD takes precedence over GROUP_ROWS for bf16 MXFP4)
    monkeypatch.setattr(sm, "GROUP_ROWS_PARTIAL", True)
    spec = QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0")
    qw = quantize(torch.randn(40, 5 * 128 - 16, generator=torch.Generator().manual_seed(23)), spec)
    fmt = {"R": 16, "EPW": 8, "GROUP_SIZE": 32, "PER_CHANNEL": False, "SCALE_KIND": 1}
    assert sm.scale_words(fmt, False, 2) and sm.scale_words(fmt, False, 4) and not sm.scale_words(fmt, False, 0)
    _check(qw, m, ComputeConfig("mv", 16, 32, 0, split_k=2, num_warps=4, num_stages=2), seed=m)
    _check(qw, m, ComputeConfig("mv", 16, 16, 0, split_k=3, num_warps=1, num_stages=1), seed=m + 1)


def test_pair_halves_round_trip():
    # the pair word order (packing.pair_halves, QuantizedWeight.pair_words): its own inverse, the layout the
    # pair-order PTX reads (word row 2p: nibble j of its low / high half = field j of planar rows 2p / 2p + 1; row
    # 2p + 1: fields 4 + j), and the reference dequantize of a repacked weight equal to the planar one's
    from kestrel.quant.packing import adjacent_pairs, pair_halves
    from kestrel.quant.weight import with_pair_words
    g = torch.Generator().manual_seed(30)
    w = torch.randint(-2**31, 2**31 - 1, (32, 24), generator=g, dtype=torch.int64).to(torch.int32)
    p = pair_halves(w)
    assert not torch.equal(p, w) and torch.equal(pair_halves(p), w)
    u = lambda t: t.to(torch.int64) & 0xFFFFFFFF
    for j in range(4):
        for row, half, f in ((0, 0, j), (0, 1, j), (1, 0, 4 + j), (1, 1, 4 + j)):
            got = (u(p[row::2]) >> (16 * half + 4 * j)) & 15
            assert torch.equal(got, (u(w[half::2]) >> (4 * f)) & 15), (j, row, half)
    a = adjacent_pairs(w)  # flat position (r // 2) * 2N + 2n + r % 2 holds word (r, n)
    r, n = torch.meshgrid(torch.arange(32), torch.arange(24), indexing="ij")
    assert torch.equal(a.flatten()[(r // 2) * 48 + 2 * n + r % 2], w) and torch.equal(adjacent_pairs(a, True), w)
    for spec in (QuantSpec("int4", group_size=128), QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0")):
        qw = quantize(torch.randn(40, 256, generator=g), spec)
        qp, qa = with_pair_words(qw), with_pair_words(qw, adjacent=True)
        assert qp.pair_words and not qw.pair_words and not torch.equal(qp.qweight, qw.qweight)
        assert qa.pair_adjacent and torch.equal(qa.qweight, adjacent_pairs(qp.qweight))
        assert torch.equal(dequantize(qp), dequantize(qw)) and torch.equal(dequantize(qa), dequantize(qw))
        with pytest.raises(ValueError):
            with_pair_words(qp, adjacent=True)
    with pytest.raises(ValueError):
        with_pair_words(quantize(torch.randn(40, 256, generator=g), QuantSpec("int8", group_size=-1)))


@pytest.mark.parametrize("spec", [QuantSpec("int4", group_size=128),
                                  QuantSpec("uint4", has_zero_point=True, group_size=32, scale_dtype="fp16"),
                                  QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0"),
                                  QuantSpec("fp4_e2m1", group_size=16, scale_dtype="fp8_e4m3", global_scale=True)],
                         ids=lambda s: s.name + f"-g{s.group_size}")
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("adj", [False, True], ids=["halves", "adjacent"])
def test_mv_pair_words(spec, dt, adj):
    # a pair-order weight (with_pair_words) through mv / mvs vs x @ dequant(W)^T of the planar weight: split-K with
    # a masked two-block step, num_stages 1 / 2 / 3, N not a tile multiple, K padded (MXFP4 bf16: FOLD). On the CPU
    # the kernel takes the words back to planar (PAIRW 1); on the GPU at num_stages 2 / 3 the pair-order PTX
    # (PAIRW 2, checked below). adjacent: the pair's two words stored next to each other (the [R / 2, 2 BN] tile
    # load, ADJ). Fails if the kernel reads the words in the planar order or storage; gemv / dot refuse them
    from kestrel.kernels import gemm_wna16_small as sm
    from kestrel.quant.weight import with_pair_words
    qw = quantize(torch.randn(40, 5 * 128 - 16, generator=torch.Generator().manual_seed(31)), spec)
    qp = with_pair_words(qw, adjacent=adj)
    fmt = {"IS_INT": spec.is_int}
    for m, cfg in ((3, ComputeConfig("mv", 16, 32, 256, split_k=2, num_warps=4, num_stages=2)),
                   (16, ComputeConfig("mv", 16, 16, 0, split_k=3, num_warps=1, num_stages=3)),
                   (5, ComputeConfig("mvs", 8, 16, 0, split_k=2, num_warps=1, num_stages=3)),
                   (2, ComputeConfig("mv", 16, 32, 0, split_k=2, num_warps=2, num_stages=1))):
        assert sm.pair_words_mode(qp, fmt, cfg, True, dt) == (
            2 if cfg.num_stages > 1 and (spec.is_int or dt == torch.bfloat16) else 1)
        assert sm.pair_words_mode(qw, fmt, cfg, True, dt) == 0
        g = torch.Generator().manual_seed(m)
        x = torch.randn(m, qw.shape[1], generator=g).to(dt)
        ref = x.double() @ dequantize(qw).double().t()
        y = gemm_wna16(x.to(DEV), qp.to(DEV), cfg).cpu()
        err = ((y.double() - ref).norm() / ref.norm()).item()
        assert err < TOL, f"{spec.name} M={m} cfg={cfg}: rel err {err:.3g}"
    for cfg in (ComputeConfig("gemv", 1, 32, 0, split_k=1, num_warps=1, num_stages=2),
                ComputeConfig("dot", 16, 32, 0, split_k=1, num_stages=2)):
        with pytest.raises(ValueError):
            gemm_wna16(torch.randn(1, qw.shape[1]).to(dt).to(DEV), qp.to(DEV), cfg)


def test_mv_pair_order_ptx_semantics():
    # the pair-order PTX (PAIRW 2, GPU only) by the tc test's emulator on pair_halves of random planar word pairs
    # vs the reference decode of the planar fields: e2m1 (bf16, int32 and 16-bit pair multipliers, FOLD's scales)
    # and int4 (OFF + c, and c - 8 by the packed FMA; bf16 / fp16). Fails with a wrong word, nibble or shift
    from test_gemm_wna16_tc import _run_ptx
    from kestrel.kernels import gemm_wna16_small as sm
    from kestrel.quant.formats import decode_minifloat
    from kestrel.quant.packing import pair_halves
    g = torch.Generator().manual_seed(32)
    fe = sm.FOLD_EXP.value
    mbits = lambda e: min(max(e + 126 - fe, 1), 254) << 7
    halves = lambda out, dt: torch.tensor([out & 0xFFFF, out >> 16], dtype=torch.int32).to(torch.int16).view(
        dt).double()
    for _ in range(16):
        w = torch.randint(-2**31, 2**31 - 1, (2, 1), generator=g, dtype=torch.int64).to(torch.int32)
        p0, p1 = (int(v) & 0xFFFFFFFF for v in pair_halves(w).flatten())
        w0, w1 = (int(v) & 0xFFFFFFFF for v in w.flatten())
        e0, e1 = (int(v) for v in torch.randint(fe - 5, fe + 128, (2,), generator=g))
        for f in range(8):
            codes = torch.tensor([(w0 >> 4 * f) & 15, (w1 >> 4 * f) & 15])
            want = decode_minifloat(codes, 2, 1).double()
            out = _run_ptx(sm._ASM_FP4_PAIR.value[f], [p0, p1, 0x7E807E80, 0x7E807E80])
            assert torch.equal(halves(out, torch.bfloat16), want), (f, hex(w0), hex(w1))
            out = _run_ptx(sm._ASM_FP4_PAIR.value[f], [p0, p1, mbits(e0) | (mbits(e1) << 16)])  # MUL16
            scaled = want * torch.tensor([2.0 ** (e0 - 127 - fe), 2.0 ** (e1 - 127 - fe)], dtype=torch.float64)
            assert torch.equal(halves(out, torch.bfloat16), scaled), (f, e0, e1)
            for fp16 in (False, True):
                dt, off = (torch.float16, 1024) if fp16 else (torch.bfloat16, 128)
                magic, one = (0x64006400, 0x3C003C00) if fp16 else (0x43004300, 0x3F803F80)
                for sub in (-1, 8):
                    neg = (0xE400 if fp16 else 0xC300) | max(sub, 0)
                    asm = sm._ASM_INT4_PAIR.value[(2 * fp16 + (sub >= 0)) * 8 + f]  # the kernel's table entry
                    assert asm == sm._asm_int4_pair_order(f, fp16, sub)
                    out = _run_ptx(asm,
                                   [p0, p1, magic, magic, one, one, neg * 0x10001, neg * 0x10001])
                    want_i = codes.double() + (off if sub < 0 else -sub)
                    assert torch.equal(halves(out, dt), want_i), (f, fp16, sub, hex(w0), hex(w1))
