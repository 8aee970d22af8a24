"""Tensor-core WNA16 kernel ("tc", kestrel/kernels/gemm_wna16_tc.py) vs float64 dequantize-then-matmul.

Reference: x.double() @ dequantize(W).double().T (kestrel.quant's CPU reference decode). Tolerance 1e-2 relative
Frobenius for every format: the kernel rounds each scaled weight once to bf16/fp16 (2^-9 / 2^-12) and the output once;
a wrong field, k order, group, zero or scale gives O(1) errors.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from kestrel.kernels.configs import ComputeConfig, LayerConfig, heuristic
from kestrel.kernels.gemm_wna16 import _format_args, gemm_wna16
from kestrel.kernels.gemm_wna16_tc import gemm_wna16_tc
from kestrel.kernels.tuning import FORMATS, MODEL_SHAPES, candidates
from kestrel.quant import QuantSpec, dequantize, from_gptq, quantize
from kestrel.quant.packing import pack_bitstream

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 or a GPU")
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TOL = 1e-2
ALL_FORMATS = [
    QuantSpec("int4", group_size=128), QuantSpec("uint4", has_zero_point=True, group_size=32, scale_dtype="fp16"),
    QuantSpec("int8", group_size=-1), QuantSpec("int3", group_size=64),
    QuantSpec("uint2", has_zero_point=True, group_size=64), QuantSpec("int5", group_size=128),
    QuantSpec("uint8", has_zero_point=True, group_size=-1),
    QuantSpec("fp4_e2m1", group_size=32, scale_dtype="e8m0"),
    QuantSpec("fp4_e2m1", group_size=16, scale_dtype="fp8_e4m3", global_scale=True),
    QuantSpec("fp8_e4m3", group_size=-1, scale_dtype="fp32"), QuantSpec("fp8_e5m2", group_size=128, scale_dtype="fp16"),
    QuantSpec("fp6_e3m2", group_size=32), QuantSpec("fp6_e2m3", group_size=64),
]


def _check(qw, m, cfg, dtype=torch.bfloat16, **kw):
    x = torch.randn(m, qw.shape[1], generator=torch.Generator().manual_seed(m)).to(dtype)
    ref = x.double() @ dequantize(qw).double().t()
    qd = qw.to(DEV)
    y = gemm_wna16_tc(x.to(DEV), qd, cfg, _format_args(qd), **kw).cpu()
    assert y.dtype == dtype and y.shape == (m, qw.shape[0])
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < TOL, f"{qw.spec.name} M={m} cfg={cfg} {kw}: rel err {err:.3g}"


def _weight(spec, n=48, k=256, seed=1):
    return quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), spec)


@pytest.mark.parametrize("spec", ALL_FORMATS, ids=lambda s: s.name)
def test_every_format(spec):
    # N = 48: the second N tile is partial; odd M
    _check(_weight(spec), 37, ComputeConfig("tc", 32, 32, 0, 1, 4, 2))


@pytest.mark.parametrize("cfg,m,kw", [
    (ComputeConfig("tc", 64, 32, 0, 1, 4, 2), 70, {}),             # two M tiles
    (ComputeConfig("tc", 16, 64, 0, 2, 4, 2, swap=True), 17, {}),  # split-K (fp32 atomics), W^T as operand A
    (ComputeConfig("tc", 32, 32, 256, 1, 4, 2), 45, {"swap": False}),  # K step of two planar blocks
    (ComputeConfig("tc", 64, 32, 0, 2, 4, 2), 33, {"swap": True, "layout": 1}),  # gather-rows layout
    # split-K reduced in the kernel (workspace partials, the last split of a tile sums them): 2 M x 4 N tiles,
    # ragged last N tile; swapped; and the two-half 256-wide tile (one counter per half)
    (ComputeConfig("tc", 32, 64, 0, 4, 4, 2, reduce=1), 37, {}),
    (ComputeConfig("tc", 16, 64, 0, 2, 4, 2, swap=True, reduce=1, maxnreg=128), 17, {}),
    (ComputeConfig("tc", 32, 256, 0, 2, 8, 2, reduce=1), 19, {}),
], ids=["noswap", "splitk", "bk256", "gather", "splitk-reduce", "splitk-reduce-swap", "splitk-reduce-halves"])
@pytest.mark.parametrize("spec", [FORMATS["int4"], FORMATS["uint4-zp"], FORMATS["mxfp4"], FORMATS["nvfp4"]],
                         ids=lambda s: s.name)
def test_variants(spec, cfg, m, kw):
    _check(_weight(spec, seed=2), m, cfg, **kw)


@pytest.mark.parametrize("spec", [FORMATS["int4"], FORMATS["mxfp4"], QuantSpec("int8", group_size=-1)],
                         ids=lambda s: s.name)
def test_two_half_tile(spec):
    # block_n 256 runs as two 128-wide halves sharing the x tile; N = 300: full first half, ragged second half
    _check(_weight(spec, n=300, seed=6), 33, ComputeConfig("tc", 32, 256, 0, 1, 8, 2))


@pytest.mark.parametrize("spec", [FORMATS["int4"], FORMATS["nvfp4"]], ids=lambda s: s.name)
def test_heuristic_tile(spec):
    # the heuristic's 8-warp 64x128 tile with N % 128 == 0: on a GPU this runs the paired packed decode (dec 2)
    _check(_weight(spec, n=256, seed=8), 65, ComputeConfig("tc", 64, 128, 0, 1, 8, 3))


@pytest.mark.parametrize("spec", [FORMATS["int4"], FORMATS["mxfp4"], FORMATS["fp8"]], ids=lambda s: s.name)
def test_fp16_activations(spec):
    _check(_weight(spec, seed=3), 21, ComputeConfig("tc", 32, 32, 0, 1, 4, 2), dtype=torch.float16)


@pytest.mark.parametrize("spec", [QuantSpec("int4", group_size=128), QuantSpec("fp4_e2m1", group_size=32,
                                                                              scale_dtype="e8m0")],
                         ids=lambda s: s.name)
def test_k_not_a_multiple_of_the_step(spec):
    # K = 576: packed K 640 = 5 planar blocks, so a 256-wide K step has a half-empty last step (masked)
    _check(_weight(spec, n=40, k=576, seed=4), 19, ComputeConfig("tc", 32, 32, 256, 1, 4, 2))


@pytest.mark.parametrize("cfg,m", [(ComputeConfig("tcg", 64, 128, 0, 1, 8, 4), 37),
                                   (ComputeConfig("tcg", 64, 128, 0, 2, 4, 3), 70),
                                   (ComputeConfig("tcg", 128, 128, 0, 1, 8, 3), 130),
                                   (ComputeConfig("tcg", 64, 128, 0, 1, 8, 4, swap=True), 37),
                                   (ComputeConfig("tcg", 64, 64, 0, 2, 4, 3, swap=True), 70),
                                   (ComputeConfig("tcg", 128, 256, 0, 1, 8, 3, swap=True), 130)],
                         ids=["one", "splitk", "bm128", "swap", "swap-splitk", "swap-bn256"])
def test_gluon_tcg_kernel(cfg, m):
    # the Gluon kernel (GPU, Hopper) or, elsewhere, the tc kernel it falls back to: symmetric int4 g128, whole
    # tiles (N % 128, K % 128), ragged M (TMA zero-fills the missing rows; the store is masked)
    qw = _weight(FORMATS["int4"], n=256, k=512, seed=12)
    lay = LayerConfig(qw.spec, 256, 512)
    assert cfg.valid_for(lay) and not cfg.valid_for(LayerConfig(FORMATS["uint4-zp"], 256, 512))
    assert not ComputeConfig("tcg", 64, 128, 0, 4, 8, 4).valid_for(LayerConfig(qw.spec, 256, 384))  # empty split
    assert not ComputeConfig("tcg", 64, 64, 0, 1, 8, 4, swap=True).valid_for(lay)  # 8 warps need 128 weight rows
    assert not ComputeConfig("tcg", 64, 128, 0, 1, 8, 4, ws=1).valid_for(lay)  # warp specialisation: swap only
    assert not ComputeConfig("tcg", 64, 64, 0, 1, 4, 4, swap=True, ws=2).valid_for(lay)
    # 256 x rows in the swap kernel: 2 stages only (NaN at 3 on the H200)
    assert ComputeConfig("tcg", 256, 128, 0, 1, 8, 2, swap=True).valid_for(lay)
    assert not ComputeConfig("tcg", 256, 128, 0, 1, 8, 3, swap=True).valid_for(lay)
    # fixup_own: only where the ticketed split-K sum runs (reduce, stream-K 1 / 3)
    assert not ComputeConfig("tcg", 128, 128, 0, 2, 8, 4, swap=True, fixup_own=1).valid_for(lay)
    assert not ComputeConfig("tcg", 128, 128, 0, 1, 8, 4, swap=True, streamk=2, fixup_own=1).valid_for(lay)
    assert ComputeConfig("tcg", 128, 128, 0, 2, 8, 4, swap=True, reduce=1, fixup_own=1).valid_for(lay)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).bfloat16()
    ref = x.double() @ dequantize(qw).double().t()
    y = gemm_wna16(x.to(DEV), qw.to(DEV), cfg).cpu()
    assert y.dtype == torch.bfloat16 and ((y.double() - ref).norm() / ref.norm()).item() < TOL


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("cfg,m", [(ComputeConfig("tcg", 128, 128, 0, 3, 8, 4, swap=True, reduce=1), 200),
                                   (ComputeConfig("tcg", 128, 128, 0, 3, 8, 4, swap=True), 130),
                                   (ComputeConfig("tcg", 256, 128, 0, 3, 8, 2, swap=True, reduce=1), 256),
                                   (ComputeConfig("tcg", 128, 256, 0, 2, 8, 3, swap=True, reduce=1), 100),
                                   (ComputeConfig("tcg", 128, 128, 0, 3, 8, 4, swap=True, reduce=1, fixup_own=1), 200)],
                         ids=["split3-reduce", "split3-atomic", "bm256-split3-reduce", "bn256-split2-reduce",
                              "split3-reduce-own"])
def test_gluon_tcg_swap_wave_splits(fmt, cfg, m):
    # the tuner's wave-quantization candidates (tuning.wave_candidates): split 3 of 6 K steps (2 each), the 256-row
    # 2-stage tile and the 256-wide tile with the in-kernel reduction; 3 N tiles
    qw = _weight(FORMATS[fmt], n=384 if cfg.block_n == 128 else 512, k=768, seed=14)
    assert cfg.valid_for(LayerConfig(qw.spec, *qw.shape))
    x = torch.randn(m, 768, generator=torch.Generator().manual_seed(m)).bfloat16()
    ref = x.double() @ dequantize(qw).double().t()
    y = gemm_wna16(x.to(DEV), qw.to(DEV), cfg).cpu()
    assert y.dtype == torch.bfloat16 and ((y.double() - ref).norm() / ref.norm()).item() < TOL


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("k", [128, 384, 640])
def test_gluon_tcg_swap_odd_k_steps(fmt, k):
    # the swap K loop runs two steps per iteration (gemm_wna16_tcg._swap_kloop: each with its own A registers) and
    # one more for an odd count: 1, 3 and 5 K steps, unsplit and in the stream-K schedule
    qw = _weight(FORMATS[fmt], n=256, k=k, seed=17)
    x = torch.randn(130, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    ref = x.double() @ dequantize(qw).double().t()
    for cfg in (ComputeConfig("tcg", 128, 128, 0, 1, 8, 4, swap=True),
                ComputeConfig("tcg", 128, 128, 0, 1, 8, 3, swap=True, streamk=1)):
        assert cfg.valid_for(LayerConfig(qw.spec, *qw.shape))
        y = gemm_wna16(x.to(DEV), qw.to(DEV), cfg).cpu()
        assert y.dtype == torch.bfloat16 and ((y.double() - ref).norm() / ref.norm()).item() < TOL


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("cfg", [ComputeConfig("tcg", 128, 128, 0, 1, 8, 4, swap=True, ws=1),
                                 ComputeConfig("tcg", 128, 256, 0, 1, 8, 3, swap=True, ws=1),
                                 ComputeConfig("tcg", 128, 128, 0, 2, 8, 3, swap=True, ws=1),
                                 ComputeConfig("tcg", 128, 256, 0, 1, 8, 3, swap=True, ws=2)],
                         ids=["ws1-khalf", "ws1-rowhalf", "ws1-split2", "ws2-rowhalf"])
def test_gluon_tcg_swap_ws_loops(fmt, cfg):
    # the loader-warp consumers on _swap_kloop's split-step loop (session 11): K halves (128x128 w8), row halves
    # (128x256 w8, and each 4-warp consumer of ws 2), ring slots handed back on the empty barriers; 5 K steps
    # (odd; 3 + 2 with split 2), 2 N tiles of 256, ragged M
    qw = _weight(FORMATS[fmt], n=512, k=640, seed=19)
    assert cfg.valid_for(LayerConfig(qw.spec, *qw.shape))
    x = torch.randn(130, 640, generator=torch.Generator().manual_seed(19)).bfloat16()
    ref = x.double() @ dequantize(qw).double().t()
    y = gemm_wna16(x.to(DEV), qw.to(DEV), cfg).cpu()
    assert y.dtype == torch.bfloat16 and ((y.double() - ref).norm() / ref.norm()).item() < TOL


@pytest.mark.parametrize("cfg,m", [(ComputeConfig("tcg", 64, 128, 0, 2, 8, 4, swap=True, ws=1), 37),
                                   (ComputeConfig("tcg", 128, 128, 0, 1, 8, 3, swap=True), 130),
                                   (ComputeConfig("tcg", 64, 128, 0, 2, 8, 4, swap=True, ws=2), 70),
                                   (ComputeConfig("tcg", 64, 128, 0, 4, 8, 4, swap=True, reduce=1), 70)],
                         ids=["ws-splitk", "bm128", "ws2-splitk", "reduce"])
def test_gluon_tcg_swap_mxfp4(cfg, m):
    # MXFP4 takes only the swap variant of the Gluon kernel (or, off Hopper, the tc kernel with the same tile)
    qw = _weight(FORMATS["mxfp4"], n=256, k=512, seed=13)
    lay = LayerConfig(qw.spec, 256, 512)
    assert cfg.valid_for(lay) and not ComputeConfig("tcg", 64, 128, 0, 1, 8, 4).valid_for(lay)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).bfloat16()
    ref = x.double() @ dequantize(qw).double().t()
    y = gemm_wna16(x.to(DEV), qw.to(DEV), cfg).cpu()
    assert y.dtype == torch.bfloat16 and ((y.double() - ref).norm() / ref.norm()).item() < TOL


def test_split_k_reduce_leaves_counters_zeroed():
    # the tile counters are allocated once and never cleared by the host: every call must leave them at zero, or
    # the next call's "last split" would be the wrong one (a partial sum: O(1) error) and y would stay unwritten
    from kestrel.kernels.gemm_wna16_tc import _COUNTERS
    qw = _weight(FORMATS["int4"], n=200, seed=11)
    cfg = ComputeConfig("tc", 32, 64, 0, 4, 4, 2, reduce=1)
    for m in (37, 70, 5):  # different grids reuse the same counters
        _check(qw, m, cfg)
    assert _COUNTERS and all(int(b.abs().sum()) == 0 for b in _COUNTERS.values())


def test_through_gemm_wna16_act_order_and_batch_dims():
    g = torch.Generator().manual_seed(5)
    n, k, gs = 48, 256, 64
    q = torch.randint(0, 16, (n, k), generator=g)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[torch.randperm(k, generator=g)] = (torch.arange(k) // gs).to(torch.int32)
    scales = (torch.rand(k // gs, n, generator=g) * 0.1 + 0.01).half()
    zeros = torch.randint(0, 16, (k // gs, n), generator=g)
    qw = from_gptq(pack_bitstream(q, 4, dim=1).t().contiguous(), pack_bitstream((zeros - 1) & 15, 4, dim=1),
                   scales, bits=4, group_size=gs, g_idx=g_idx, sym=False)
    x = torch.randn(3, 9, k, generator=g).bfloat16()
    y = gemm_wna16(x.to(DEV), qw.to(DEV), ComputeConfig("tc", 32, 32, 0, 1, 4, 2)).cpu()
    ref = (x.double().reshape(27, k) @ dequantize(qw).double().t()).reshape(3, 9, n)
    assert y.shape == (3, 9, n) and ((y.double() - ref).norm() / ref.norm()) < TOL


def test_packed_decode_pairs_share_a_field():
    # dec 2 (the paired int4/fp4 PTX decode) reads the field of only the first element of each register pair; the
    # tiles gemm_wna16_tc gives dec 2 must pair along r or n, never along the field dim (dim 2), in the layout this
    # Triton compiles for sm_90 (bench/wna16_tc_sass.py; needs only Triton's bundled ptxas, no GPU, no interpreter)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "..", "bench", "wna16_tc_sass.py")
    r = subprocess.run([sys.executable, script, "--pairs"], capture_output=True, text=True, env=env, timeout=300)
    if r.returncode:
        pytest.skip(f"cannot compile for sm_90 here: {r.stderr[-300:]}")
    pairs = json.loads(r.stdout.strip().splitlines()[-1])
    assert pairs and all(d in (1, 3) for d in pairs.values()), pairs


def _run_ptx(asm: str, ops: list[int], first: int = 1, outs: int = 1):
    """Tiny emulator of the PTX the packed decode uses (b32 registers; bf16x2/f16x2 math rounded like the GPU: the
    products of two 8/11-bit significands are exact in fp32, so one torch rounding is the PTX .rn rounding).
    ops are $first, $first + 1, ...; returns $0 (outs = 1) or [$0 .. $outs-1]."""
    regs = {f"${i}": v & 0xFFFFFFFF for i, v in enumerate(ops, start=first)}
    val = lambda t: regs[t] if t in regs else int(t, 0)

    def halves(v, dt):
        return torch.tensor([v & 0xFFFF, v >> 16], dtype=torch.int32).to(torch.int16).view(dt).float()

    def pack(x, dt):
        h = x.to(dt).view(torch.int16).to(torch.int32) & 0xFFFF
        return int(h[0]) | (int(h[1]) << 16)

    for ins in asm.strip("{} ").split(";"):
        if not ins.strip() or ins.strip().startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        d, *src = [t.strip() for t in args.split(",")]
        v = [val(t) for t in src]
        if op == "shr.u32":
            r = v[0] >> v[1]
        elif op == "shl.b32":
            r = (v[0] << v[1]) & 0xFFFFFFFF
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "mul.lo.u32":
            r = (v[0] * v[1]) & 0xFFFFFFFF
        elif op == "prmt.b32":  # default mode, selectors < 8: byte k of d = byte sel_k of {b, a}
            both = v[0] | (v[1] << 32)
            r = sum(((both >> (8 * ((v[2] >> (4 * k)) & 7))) & 0xFF) << (8 * k) for k in range(4))
        elif op == "lop3.b32":
            r = sum((((v[3] >> (((v[0] >> i) & 1) << 2 | ((v[1] >> i) & 1) << 1 | ((v[2] >> i) & 1))) & 1) << i)
                    for i in range(32))
        elif op.startswith("fma.rn"):  # (the exact small-integer sums of the int4 decode: one rounding)
            dt = torch.bfloat16 if op.endswith("bf16x2") else torch.float16
            r = pack(halves(v[0], dt) * halves(v[1], dt) + halves(v[2], dt), dt)
        else:
            dt = torch.bfloat16 if op.endswith("bf16x2") else torch.float16
            a_, b_ = halves(v[0], dt), halves(v[1], dt)
            r = pack(a_ - b_ if op.startswith("sub") else a_ * b_, dt)
        regs[d] = r
    return regs["$0"] if outs == 1 else [regs[f"${i}"] for i in range(outs)]


@pytest.mark.parametrize("kind", ["int4", "fp4"])
def test_swap_quad_decode_ptx_semantics(kind):
    # the pack-4 PTX of the Gluon swap kernel (gemm_wna16_tcg._ASM_QUAD / _ASM_QUAD_FP4): words w0, w1 (word rows
    # 2c, 2c + 1: adjacent k of the wgmma A fragment), byte j -> $0 = field 2j of (w0, w1), $1 = field 2j + 1,
    # each (code - 8) * s (int4) or e2m1 value * s * 2^62 * 2^-126 (fp4, s carrying the kernel's 2^(126 - 64))
    from kestrel.kernels import gemm_wna16_tcg as tcg
    from kestrel.quant.formats import decode_minifloat
    g = torch.Generator().manual_seed(8)
    bf = torch.bfloat16
    half = lambda x: int(torch.tensor([x]).to(bf).view(torch.int16)) & 0xFFFF
    for _ in range(40):
        w0, w1 = (int(v) & 0xFFFFFFFF for v in torch.randint(-2**31, 2**31 - 1, (2,), generator=g))
        s = float(torch.rand(1, generator=g)) * 0.1 + 0.01
        for j in range(4):
            sel = j | ((j + 4) << 8)
            if kind == "int4":
                sc, zb = half(s) * 0x10001, half(136) * 0x10001
                out = _run_ptx(tcg._ASM_QUAD.value, [w0, w1, w0, w1, sel, sel, sel, sel, zb, zb, sc, sc], first=2,
                               outs=2)
                ref = lambda c: torch.tensor([(c - 8) * float(torch.tensor(s).to(bf))]).to(bf)
            else:
                sc = half(s * 2.0 ** 62) * 0x10001
                out = _run_ptx(tcg._ASM_QUAD_FP4.value, [w0, w1, w0, w1, sel, sel, sel, sel, sc, sc], first=2, outs=2)
                ref = lambda c: (decode_minifloat(torch.tensor([c]), 2, 1) * float(torch.tensor(s * 2.0 ** 62).to(bf))
                                 * 2.0 ** -126).to(bf)
            for h, f in enumerate((2 * j, 2 * j + 1)):
                got = torch.tensor([out[h] & 0xFFFF, out[h] >> 16], dtype=torch.int32).to(torch.int16).view(bf)
                for half_i, w in enumerate((w0, w1)):
                    assert got[half_i] == ref((w >> 4 * f) & 15)[0], (kind, j, f, half_i, got, w0, w1)


def test_swap_decode_layout_is_the_wgmma_a_fragment():
    # the [BN, field, word row] decode layout reshaped to [BN, 128] (k = 16 field + row) must hold the same
    # (register, lane, warp) -> element map as the A fragment, up to the order of the register bases, with the
    # pack-4 asm's (row bit 0, field bit 0) as the first two register bases
    from types import SimpleNamespace
    from kestrel.kernels import gemm_wna16_tcg as tcg
    a = SimpleNamespace(reg_bases=[[0, 1], [8, 0], [0, 8], [0, 16], [0, 32], [0, 64], [128, 0]],
                        lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0], [64, 0]],
                        shape=[256, 128])  # the H200 compile's A layout of a 256-row, 8-warp tile (triton 3.6)
    fn = getattr(tcg._decode_layout, "fn", None) or getattr(tcg._decode_layout, "__wrapped__", tcg._decode_layout)
    lay = fn(a)
    flat = lambda b: [b[0], 16 * b[1] + b[2]]
    assert lay.reg_bases[:2] == [[0, 0, 1], [0, 1, 0]] and lay.shape == [256, 8, 16]
    assert sorted(map(flat, lay.reg_bases)) == sorted(a.reg_bases)
    assert list(map(flat, lay.lane_bases)) == a.lane_bases and list(map(flat, lay.warp_bases)) == a.warp_bases


@pytest.mark.parametrize("kind", ["int4-bf16", "int4-fp16", "fp4-bf16"])
def test_packed_decode_ptx_semantics(kind):
    # the inline PTX of the packed decode (run only on GPUs) against the reference element decode, every field
    from kestrel.kernels import gemm_wna16_tc as tc
    from kestrel.quant.formats import decode_minifloat
    g = torch.Generator().manual_seed(7)
    dt = torch.float16 if kind == "int4-fp16" else torch.bfloat16
    half = lambda x: int(torch.tensor([x]).to(dt).view(torch.int16)) & 0xFFFF
    for _ in range(40):
        w0, w1 = (int(v) & 0xFFFFFFFF for v in torch.randint(-2**31, 2**31 - 1, (2,), generator=g))
        s0, s1 = (float(v) for v in torch.rand(2, generator=g) * 0.1 + 0.01)
        for f0 in range(8):
            for f1, shared in ((f0, True), ((f0 + 3) % 8, False)):
                c0, c1 = (w0 >> 4 * f0) & 15, (w1 >> 4 * f1) & 15
                if kind.startswith("int4"):
                    sc = half(s0) | (half(s1) << 16)
                    zb = half((1024 if dt == torch.float16 else 128) + 8) * 0x10001
                    want = [torch.tensor([(c - 8) * float(torch.tensor(s).to(dt))]).to(dt)
                            for c, s in ((c0, s0), (c1, s1))]
                    asm = (tc._ASM_SH_F16 if dt == torch.float16 else tc._ASM_SH_BF16) if shared else (
                        tc._ASM_F16 if dt == torch.float16 else tc._ASM_BF16)
                else:
                    sc = half(s0 * 2.0 ** 62) | (half(s1 * 2.0 ** 62) << 16)  # * 2^(126 - TILE_EXP)
                    want = [(decode_minifloat(torch.tensor([c]), 2, 1) * float(torch.tensor(s * 2.0 ** 62).to(dt))
                             * 2.0 ** -126).to(dt) for c, s in ((c0, s0), (c1, s1))]
                    asm = tc._ASM_FP4_SH if shared else tc._ASM_FP4
                if shared:
                    j = f0 // 2
                    sel = j | ((j + 4) << 8)
                    ops = [w0, w1, sel, sel, (f0 % 2) * 4, (f0 % 2) * 4, *([zb] if kind.startswith("int4") else []), sc]
                else:
                    ops = [w0, w1, 4 * f0, 4 * f1, *([zb] if kind.startswith("int4") else []), sc]
                out = _run_ptx(asm.value, ops)
                got = torch.tensor([out & 0xFFFF, out >> 16], dtype=torch.int32).to(torch.int16).view(dt)
                assert got[0] == want[0][0] and got[1] == want[1][0], (kind, shared, f0, f1, c0, c1, got, want)


def test_configs_valid_for_llama_shapes():
    # the heuristic and the tuner's m > 16 candidates must be runnable configs on every shape and format
    for spec in (FORMATS["int4"], FORMATS["mxfp4"], FORMATS["nvfp4"], FORMATS["int8"]):
        for n, k in MODEL_SHAPES["llama3-8b"] + MODEL_SHAPES["llama3-70b"] + [(48, 576)]:
            lay = LayerConfig(spec, n, k)
            for m in (17, 32, 64, 128, 256, 512, 1024, 4096):
                assert heuristic(lay, m).valid_for(lay)
            assert any(c.kernel == "tc" for c in candidates(lay, 256))
            assert any(c.kernel == "dequant_mm" and c.chunks > 1 for c in candidates(lay, 1024))
            assert all(c.valid_for(lay) for m in (32, 64, 256, 4096) for c in candidates(lay, m))
    lay = LayerConfig(FORMATS["int4"], 4096, 4096)
    assert not ComputeConfig("tc", 64, 64, 384).valid_for(lay)  # K step not a power-of-two number of blocks
    assert not ComputeConfig("tc", 8, 64, 0).valid_for(lay)


def test_tuner_local_search_reaches_the_measured_winners():
    # `kestrel tune --max-candidates 17` measures the heuristic, then the wave-quantization picks (wave_candidates,
    # the stream-K config among them since session 9), then the candidates nearest the heuristic. At 8B down M = 256
    # the heuristic is the H200 probe winner (swap tcg 128x128 split 2 s4, 57.2 us, session 4 R1) and the first
    # config of each other path (tc, dequant + cuBLAS) must be among the 17; split-K neighbours (x2, /2) come first
    from kestrel.kernels.tuning import compile_key, config_distance, wave_candidates
    lay = LayerConfig(FORMATS["int4"], 4096, 14336)
    first = candidates(lay, 256)[:17]
    assert first[0] == ComputeConfig("tcg", 128, 128, 0, 2, 8, 4, swap=True)
    assert {(c.kernel, c.swap) for c in first} == {("tcg", True), ("tcg", False), ("tc", False),
                                                    ("dequant_mm", False)}
    assert ComputeConfig("tcg", 128, 128, 0, 4, 8, 4, swap=True) in first[:10]
    # 70B qkv M = 256: 160 CTAs of 128x128 on 132 SMs (1.2 waves at split 1, 113 us vs Humming 66 in session 5):
    # split 4 (4.85 waves), 128x256 and the 256-row tile at split 3 (1.8 waves) are measured right after the heuristic
    qkv = LayerConfig(FORMATS["int4"], 10240, 8192)
    wc = wave_candidates(qkv, 256)
    assert wc[0] == ComputeConfig("tcg", 128, 128, 0, 4, 8, 4, swap=True)  # atomics: 93.5 us, reduce 135.4 (R1)
    assert ComputeConfig("tcg", 256, 128, 0, 3, 8, 2, swap=True) in wc
    assert ComputeConfig("tcg", 128, 256, 0, 3, 8, 3, swap=True, reduce=1) in wc
    assert candidates(qkv, 256)[1:1 + len(wc)] == wc
    assert all(c.valid_for(qkv) for c in wave_candidates(qkv, 1024))
    # session 11's (offline-compiled) candidates after the session-10 ones: stream-K without the fold and the
    # 128x256 stream-K tile at 70B qkv M = 256 (160 tiles of 128x128: over a wave), the ws 1 128x256 tile at 1024
    assert wc[-2:] == [ComputeConfig("tcg", 128, 128, 0, 1, 8, 4, swap=True, streamk=3),
                       ComputeConfig("tcg", 128, 256, 0, 1, 8, 3, swap=True, streamk=1)]
    assert ComputeConfig("tcg", 128, 256, 0, 1, 8, 3, swap=True, ws=1) in wave_candidates(qkv, 1024)
    assert not any(c.streamk == 3 for c in wave_candidates(lay, 256))  # 64 tiles: no whole wave to fold
    # the heuristic's split lands each shape near one wave (M = 256) / 1.5 waves (M = 64) of one CTA per SM
    assert heuristic(LayerConfig(FORMATS["int4"], 8192, 8192), 64) == ComputeConfig("tcg", 64, 128, 0, 4, 8, 4,
                                                                                    swap=True)
    assert heuristic(LayerConfig(FORMATS["int4"], 8192, 8192), 256).split_k == 1
    assert heuristic(LayerConfig(FORMATS["mxfp4"], 4096, 14336), 64).swap  # MXFP4: the swap kernel's e2m1 decode
    h = heuristic(lay, 64)
    assert config_distance(ComputeConfig(**{**h.to_dict(), "split_k": h.split_k * 2}), h) == 1
    assert config_distance(ComputeConfig("tcg", 64, 64, 0, h.split_k, 4, 4, swap=True), h) == 2
    assert config_distance(ComputeConfig("tc", 64, 128, 0, h.split_k, 8, 4), h) == 1.25  # another kernel
    # the parallel warm-up compiles each distinct specialisation once: 8B o and 70B o share every tc kernel
    c = ComputeConfig("tc", 64, 128, 0, 4, 8, 3)
    assert compile_key(LayerConfig(FORMATS["int4"], 4096, 4096), 64, c) == compile_key(
        LayerConfig(FORMATS["int4"], 8192, 8192), 64, c)
    assert compile_key(lay, 64, c) != compile_key(LayerConfig(FORMATS["mxfp4"], 4096, 14336), 64, c)


@pytest.mark.parametrize("spec", [FORMATS["int4"], FORMATS["uint4-zp"], FORMATS["mxfp4"], FORMATS["nvfp4"],
                                  QuantSpec("int8", group_size=-1), QuantSpec("fp8_e4m3", group_size=-1,
                                                                              scale_dtype="fp32")],
                         ids=lambda s: s.name)
def test_dequantize_tc_and_streamed(spec):
    # the large-M dequant pass built on the tc decode (_w_tile): columns n0..n1 of W, and the N-chunked
    # dequant + matmul (side-stream column blocks, ragged last one), both vs the float64 reference dequantize
    from kestrel.kernels.gemm_wna16_tc import dequant_matmul_streamed, dequantize_tc
    qw = _weight(spec, n=200, seed=9)
    ref = dequantize(qw).double()
    qd = qw.to(DEV)
    fmt = _format_args(qd)
    w = dequantize_tc(qd, fmt, torch.bfloat16, block_n=64, num_warps=4).cpu().double()
    assert ((w - ref).norm() / ref.norm()).item() < TOL
    w2 = dequantize_tc(qd, fmt, torch.bfloat16, block_n=32, num_warps=4, n0=64, n1=200).cpu().double()
    assert w2.shape == (136, 256) and ((w2 - ref[64:]).norm() / ref[64:].norm()).item() < TOL
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    r = x.double() @ ref.t()
    # the two-stream dequant + matmul (one stream on the CPU): 128-aligned column blocks, ragged last one
    y = dequant_matmul_streamed(x.to(DEV), qd, fmt, 2, block_n=32, num_warps=4).cpu().double()
    assert ((y - r).norm() / r.norm()).item() < TOL


def test_nonempty_split_vs_brute_force():
    """configs.nonempty_split (tail_plan, lowbit_tma.split_parts, gemm_w4a8_tcg): the most splits <= asked whose
    ceil-sized parts all get a K step, against enumerating every split count."""
    from kestrel.kernels.configs import nonempty_split
    for steps in range(1, 40):
        for asked in range(1, 50):
            ok = [s for s in range(1, asked + 1) if all(min(steps, (j + 1) * -(-steps // s)) > j * -(-steps // s)
                                                        for j in range(s))]
            assert nonempty_split(asked, steps) == max(ok), (asked, steps)


def test_tail_plan_splits_only_the_last_partial_wave():
    from kestrel.kernels.gemm_wna16_tcg import tail_plan
    # 70B qkv M = 256, 128x128: 160 tiles on 132 SMs -> 132 unsplit + 28 split in 4 (112 CTAs, one wave)
    assert tail_plan(160, 8, 64, 132) == (132, 28, 4)
    assert tail_plan(448, 8, 32, 132) == (396, 52, 2)  # 8B gate_up M = 256
    assert tail_plan(264, 8, 64, 132) == (264, 0, 1)  # whole waves: nothing to split
    assert tail_plan(80, 3, 64, 132) == (80, 0, 1)  # the tail fills a wave unsplit
    assert tail_plan(6, 4, 6, 4) == (4, 2, 2)
    assert tail_plan(5, 8, 6, 4) == (4, 1, 3)  # split 4 of 6 steps would leave the last split empty


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("bn", [128, 256])
def test_gluon_tcg_swap_tail(fmt, bn, monkeypatch):
    # cfg.tail on a pretend 4-SM GPU: 2 M x 3 N tiles (bn 256: 3 x 2) -> 4 unsplit tiles + 2 split over K with
    # the in-kernel sum; two calls (the tail's counters must be back at zero after the first)
    from kestrel.kernels import gemm_wna16_tcg as tcg
    monkeypatch.setattr(tcg, "_num_sms", lambda device: 4)
    cfg = ComputeConfig("tcg", 128, bn, 0, 3, 8, 4 if bn == 128 else 3, swap=True, reduce=1, tail=1)
    qw = _weight(FORMATS[fmt], n=384 if bn == 128 else 512, k=768, seed=15)
    assert cfg.valid_for(LayerConfig(qw.spec, *qw.shape))
    assert not ComputeConfig("tcg", 128, bn, 0, 3, 8, 4, swap=True, tail=1).valid_for(LayerConfig(qw.spec, *qw.shape))
    x = torch.randn(200 if bn == 128 else 300, 768, generator=torch.Generator().manual_seed(5)).bfloat16()
    ref = x.double() @ dequantize(qw).double().t()
    for _ in range(2):
        y = gemm_wna16(x.to(DEV), qw.to(DEV), cfg).cpu()
        assert y.dtype == torch.bfloat16 and ((y.double() - ref).norm() / ref.norm()).item() < TOL


def test_streamk_plan_spreads_the_leftover_tiles_k_steps():
    from kestrel.kernels.gemm_wna16_tcg_streamk import plan
    # 70B qkv M = 256, 128x128: 160 tiles of 64 K steps on 132 SMs, leftover 28 <= a third of a wave -> all 160
    # stream-K, 78 steps per CTA (at most 2 ranges on a tile)
    assert plan(160, 64, 132) == (132, 0, 78, 2)
    assert plan(320, 64, 132) == (132, 264, 28, 4)  # 70B qkv M = 1024, 128x256: 2 whole waves + 56 tiles
    assert plan(264, 64, 132)[:2] == (132, 264)  # whole waves: all data-parallel
    assert plan(6, 6, 4) == (4, 4, 3, 3)
    assert plan(6, 6, 5) == (5, 0, 8, 2)  # ranges of 8 over tiles of 6: cross tile boundaries
    # cfg.streamk 3 (fold=False): the whole wave stays data-parallel, the 28 leftover tiles' 1792 steps in ranges of
    # 14 (up to 6 on one tile)
    assert plan(160, 64, 132, fold=False) == (132, 132, 14, 6)
    assert plan(320, 64, 132, fold=False) == plan(320, 64, 132)  # a leftover over a third of a wave: no fold anyway
    assert plan(6, 6, 5, fold=False) == (5, 5, 2, 4)  # 1 leftover tile in 3 ranges, 2 programs with none


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("tile", [(128, 8, 1, 0), (128, 8, 2, 0), (256, 8, 1, 0), (128, 4, 1, 0), (128, 8, 3, 0),
                                  (128, 8, 1, 1), (128, 8, 3, 1)])  # (block_n, warps, streamk, fixup_own)
@pytest.mark.parametrize("sms", [3, 4, 5])
def test_gluon_tcg_swap_streamk(fmt, tile, sms, monkeypatch):
    # cfg.streamk on a pretend GPU of 3 / 4 / 5 SMs, 6 tiles of 6 K steps: 3 -> 2 data-parallel tiles per CTA (the
    # ring's phase carried over tiles); 4 -> 4 data-parallel + 2 tiles in 2 ranges each; 5 -> all stream-K, ranges
    # of 8 steps crossing tile boundaries. Two calls (the reduction's counters must be back at zero). 128x128 8 warps
    # ticketed: wrong on the H200 in session 9 (the K loop's register-A race, fixed in session 10). streamk 3 (no
    # fold): 5 -> 5 data-parallel + the 6th tile in 3 ranges. fixup_own: the last range adds its own partial from
    # registers (a dropped or doubled own partial is an O(1) error)
    from kestrel.kernels import gemm_wna16_tcg as tcg
    monkeypatch.setattr(tcg, "_num_sms", lambda device: sms)
    bn, nw, sk, own = tile
    cfg = ComputeConfig("tcg", 128, bn, 0, 1, nw, 4 if bn == 128 else 3, swap=True, streamk=sk, fixup_own=own)
    qw = _weight(FORMATS[fmt], n=384 if bn == 128 else 512, k=768, seed=16)
    lay = LayerConfig(qw.spec, *qw.shape)
    assert cfg.valid_for(lay)
    x = torch.randn(200 if bn == 128 else 300, 768, generator=torch.Generator().manual_seed(6)).bfloat16()
    ref = x.double() @ dequantize(qw).double().t()
    for _ in range(2):
        y = gemm_wna16(x.to(DEV), qw.to(DEV), cfg).cpu()
        assert y.dtype == torch.bfloat16 and ((y.double() - ref).norm() / ref.norm()).item() < TOL
