"""The Gluon W4A8 kernel (gemm_w4a8_tcg.py: int4 planar twin decoded to e4m3 in registers, fp8 wgmma, two consumer
warpgroups) vs dequantize-then-matmul. Gluon runs only on a Hopper GPU: skipped elsewhere (the offline compile,
bench/w4a8_tcg_compile.py, checks that it builds)."""
import pytest
import torch

from kestrel.kernels import act_quant as aq
from kestrel.kernels.gemm_w4a8 import gemm_w4a8, quantize_weight_w4, w4a8_linear
from kestrel.quant import dequantize

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                                reason="Gluon wgmma kernel: Hopper GPU only")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


_SHAPES = [(300, 128, 128, 1, 0), (64, 128, 64, 1, 0), (200, -1, 128, 1, 0), (130, 256, 128, 3, 0), (1, 128, 64, 2, 0),
           # 256-token tiles in two halves: a masked second half (300), an all-masked one (130), split K, per channel
           (300, 128, 256, 1, 128), (130, 128, 256, 2, 128), (600, -1, 256, 3, 128)]
# (kh, pp, pk): the K-halves consumer, the consumers' wgmma issues in turn (named barriers), the permuted-K decode
# (activations from quant_fp8(perm=True)); the combinations on a subset of the shapes
_VARIANTS = ([(s, False, False, False) for s in _SHAPES] + [(s, True, False, False) for s in _SHAPES if s[4]]
             + [(s, kh, pp, pk) for s in (_SHAPES[0], _SHAPES[3], _SHAPES[5], _SHAPES[7])
                for kh, pp, pk in ((False, True, False), (False, False, True), (False, True, True), (True, True, False))
                if s[4] or not kh])


_OPTS = {(False, False, False): "plain", (True, False, False): "kh", (False, True, False): "pp",
         (False, False, True): "pk", (False, True, True): "pppk", (True, True, False): "khpp"}


def _vid(v):
    (M, group, block_m, split, mh), *opts = v
    return f"M{M}-g{group}-bm{block_m}-s{split}-mh{mh}-{_OPTS[tuple(opts)]}"


@pytest.mark.parametrize("shape,kh,pp,pk", _VARIANTS, ids=[_vid(v) for v in _VARIANTS])
def test_w4a8_tcg_vs_dequant(shape, kh, pp, pk):
    from kestrel.kernels.gemm_w4a8_tcg import gemm_w4a8_tcg
    M, group, block_m, split, mh = shape
    g = torch.Generator().manual_seed(M + group)
    N, K = 384, 1536
    x = torch.randn(M, K, generator=g).cuda().to(torch.bfloat16)
    w = quantize_weight_w4(torch.randn(N, K, generator=g) * 0.05, "int4", group).kernel_layout().to("cuda")
    a, s = aq.quant_fp8(x)
    tw = w.wna16()
    ref = aq.dequant_8bit(a, s) @ dequantize(tw).float().t()  # the twin's bf16 scales: what the kernel multiplies
    ap = aq.quant_fp8(x, perm=True)[0] if pk else a
    y = gemm_w4a8_tcg(ap, s, tw, torch.float32, block_m=block_m, split_k=split, mh=mh, kh=kh, pp=pp, a_perm=pk)
    assert _rel(y, ref) < 2e-3  # fp8 wgmma accumulation (no promotion within a K step)
    if kh or pp or pk:
        return
    yb = gemm_w4a8(a, s, w, tcg=True, bf16_max_m=0)
    assert yb.dtype == torch.bfloat16 and _rel(yb, ref) < 5e-3
    if M > 16:  # (up to FUSED_MAX_M tokens w4a8_linear takes the fused per-group-quant kernel instead)
        assert _rel(w4a8_linear(x, w, tcg=True, bf16_max_m=0), ref) < 5e-3


@pytest.mark.parametrize("M,block_m,split", [(300, 256, 1), (130, 256, 2), (64, 128, 1), (520, 128, 3)])
@pytest.mark.parametrize("kh", [False, True])
@pytest.mark.parametrize("pp", [False, True])
def test_w4a8_fold_tcg_vs_dequant(M, block_m, split, kh, pp):
    """MXFP4 x fp8 with the group scales folded into the decoded e4m3 weights (exact) vs dequantize-then-matmul."""
    from kestrel.kernels.gemm_w4a8_tcg import gemm_w4a8_fold_tcg
    g = torch.Generator().manual_seed(M)
    N, K = 384, 1536
    x = torch.randn(M, K, generator=g).cuda().to(torch.bfloat16)
    w = quantize_weight_w4(torch.randn(N, K, generator=g) * 0.05, "mxfp4").to("cuda")
    assert w.fold_base() is not None
    a, s = aq.quant_fp8(x)
    ref = aq.dequant_8bit(a, s) @ w.dequantize().cuda().float().t()
    mult, chan = w.fold_mult()
    y = gemm_w4a8_fold_tcg(a, s, w.wna16(), mult, chan, torch.float32, block_m=block_m, split_k=split, kh=kh,
                           pp=pp)
    assert _rel(y, ref) < 3e-3  # the fp8 wgmma's accumulation within a K step (values exact)


@pytest.mark.parametrize("pk", [False, True])
def test_w4a8_linear_gluon_route_options(pk, monkeypatch):
    """w4a8_linear / gemm_w4a8 with the Gluon int4 route's options (gemm_w4a8.TCG_PP, TCG_PK: the permuted quant)
    vs dequantize-then-matmul; a 3-D x through the route."""
    import kestrel.kernels.gemm_w4a8 as g4
    monkeypatch.setattr(g4, "TCG_PP", True)
    monkeypatch.setattr(g4, "TCG_PK", pk)
    g = torch.Generator().manual_seed(7)
    N, K = 256, 1024
    x = torch.randn(2, 150, K, generator=g).cuda().to(torch.bfloat16)
    w = quantize_weight_w4(torch.randn(N, K, generator=g) * 0.05, "int4", 128).kernel_layout().to("cuda")
    a, s = aq.quant_fp8(x.reshape(-1, K))
    ref = aq.dequant_8bit(a, s) @ dequantize(w.wna16()).float().t()
    y = w4a8_linear(x, w, tcg=True, bf16_max_m=0)
    assert y.shape == (2, 150, N) and _rel(y.reshape(-1, N), ref) < 5e-3
    assert _rel(gemm_w4a8(a, s, w, tcg=True, bf16_max_m=0), ref) < 5e-3


@pytest.mark.parametrize("kernel", ["int4", "int4-pk", "mxfp4"])
@pytest.mark.parametrize("M,block_m,split", [(130, 256, 2), (300, 256, 3), (520, 128, 4)])
def test_w4a8_tcg_in_kernel_split_reduce(kernel, M, block_m, split, monkeypatch):
    """gemm_w4a8_tcg.REDUCE (the splits' partials summed in the kernel, y written in its dtype) vs dequantize-then-
    matmul, bf16 and fp32 y; a second call equals the first bit for bit (the sum runs in split order, and the last
    split reset the tile counters)."""
    import kestrel.kernels.gemm_w4a8_tcg as t
    monkeypatch.setattr(t, "REDUCE", True)
    g = torch.Generator().manual_seed(M + split)
    N, K = 384, 1536
    x = torch.randn(M, K, generator=g).cuda().to(torch.bfloat16)
    a, s = aq.quant_fp8(x)
    if kernel == "mxfp4":
        w = quantize_weight_w4(torch.randn(N, K, generator=g) * 0.05, "mxfp4").to("cuda")
        ref = aq.dequant_8bit(a, s) @ w.dequantize().cuda().float().t()
        run = lambda dt: t.gemm_w4a8_fold_tcg(a, s, w.wna16(), *w.fold_mult(), dt, block_m=block_m, split_k=split,
                                              kh=True, pp=True)
    else:
        w = quantize_weight_w4(torch.randn(N, K, generator=g) * 0.05, "int4", 128).kernel_layout().to("cuda")
        ref = aq.dequant_8bit(a, s) @ dequantize(w.wna16()).float().t()
        pk = kernel == "int4-pk"
        ap = aq.quant_fp8(x, perm=True)[0] if pk else a
        run = lambda dt: t.gemm_w4a8_tcg(ap, s, w.wna16(), dt, block_m=block_m, split_k=split, pp=True, a_perm=pk)
    y = run(torch.float32)
    assert y.dtype == torch.float32 and _rel(y, ref) < 3e-3
    assert torch.equal(run(torch.float32), y)
    yb = run(torch.bfloat16)
    assert yb.dtype == torch.bfloat16 and _rel(yb, ref) < 5e-3
