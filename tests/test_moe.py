"""MoE: routing + sort/align vs brute force, the grouped GEMM for every format vs a per-expert loop, and the fused
MoE layer vs a plain per-expert loop on dequantized weights."""
import dataclasses

import pytest
import torch

from kestrel.kernels import act_quant as aq
from kestrel.kernels.lowbit_gemm import A_BF16, A_FP8, A_INT8, A_MXFP4, A_NVFP4, Operand
from kestrel.kernels.moe_align import (max_blocks, moe_align, moe_align_fast, moe_align_single, moe_align_torch,
                                       route_topk)
from kestrel.kernels.moe_gemm import grouped_gemm, moe_config, moe_configs, quantize_experts
from kestrel.kernels.moe_layer import FusedMoE, ref_moe
from kestrel.kernels.moe_mv import MvConfig, grouped_gemm_planar, planar_from_codes
from kestrel.kernels.moe_tc import TcConfig, grouped_gemm_planar_tc

pytestmark = pytest.mark.skipif(not aq.use_triton(torch.empty(0)), reason="needs TRITON_INTERPRET=1 (or a GPU)")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("M,k,E,bm", [(7, 2, 4, 4), (1, 8, 64, 16), (40, 3, 5, 16), (200, 8, 128, 64)])
def test_align_covers_every_slot_once(M, k, E, bm):
    g = torch.Generator().manual_seed(M * E)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(torch.int32)
    sorted_ids, expert_ids, num_post = moe_align(ids, E, bm)
    T = M * k
    npost = int(num_post)
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    assert npost == int(((counts + bm - 1) // bm * bm).sum())
    assert expert_ids.numel() == max_blocks(T, E, bm) and npost <= sorted_ids.numel()
    valid = sorted_ids[:npost]
    real = valid[valid < T]
    assert sorted(real.tolist()) == list(range(T))  # every (token, slot) exactly once
    assert (sorted_ids[npost:] == T).all()
    for b in range(npost // bm):  # each block holds slots of its expert only
        blk = sorted_ids[b * bm:(b + 1) * bm]
        blk = blk[blk < T].long()
        assert (ids.flatten()[blk] == expert_ids[b]).all()
    want = moe_align_torch(ids, E, bm)
    # the single-launch Triton align and the torch-ops one agree exactly (both stable)
    for got, ref in zip(moe_align_single(ids, E, bm), want):
        assert torch.equal(got, ref)
    # the many-CTA align: same blocks; within an expert the slot order may differ (atomic order on a GPU)
    fs, fe, fn = moe_align_fast(ids, E, bm)
    assert torch.equal(fe, want[1]) and torch.equal(fn, want[2]) and torch.equal(fs < T, want[0] < T)
    assert torch.equal(fs.sort().values, want[0].sort().values)
    fv = fs < T
    assert (ids.flatten()[fs[fv].long()] == fe.repeat_interleave(bm)[fv]).all()


def test_route_topk_renormalizes():
    logits = torch.randn(5, 8)
    w, ids = route_topk(logits, 2)
    torch.testing.assert_close(w.sum(-1), torch.ones(5))
    assert torch.equal(ids.long(), torch.softmax(logits, -1).topk(2).indices)
    with pytest.raises(ValueError):
        route_topk(logits, 9)


def _act(x, act):
    """activation operand from the CPU reference quantizers + its dequantized value."""
    if act == "bf16":
        xb = x.to(torch.bfloat16)
        return Operand(A_BF16, xb), xb.float()
    if act == "fp8":
        q, s = aq.ref_quant_fp8(x)
        return Operand(A_FP8, q, s), aq.dequant_8bit(q, s)
    if act == "int8":
        q, s = aq.ref_quant_int8(x)
        return Operand(A_INT8, q, s), aq.dequant_8bit(q, s)
    if act == "mxfp4":
        q, s = aq.ref_quant_mxfp4(x)
        return Operand(A_MXFP4, q, s), aq.dequant_mxfp4(q, s)
    q, s, gs = aq.ref_quant_nvfp4(x)
    return Operand(A_NVFP4, q, s, gs), aq.dequant_nvfp4(q, s, gs)


PAIRS = [("bf16", "bf16"), ("int4", "bf16"), ("fp8", "fp8"), ("int8", "int8"), ("int4", "fp8"), ("mxfp4", "fp8"),
         ("nvfp4", "fp8"), ("mxfp4", "mxfp4"), ("nvfp4", "nvfp4")]


@pytest.mark.parametrize("wfmt,act,swap,group", [p + (0, 64) for p in PAIRS] + [
    ("fp8", "fp8", 1, 64), ("int8", "int8", 1, 64), ("int4", "fp8", 1, 64), ("mxfp4", "fp8", 1, 64),
    ("int4", "bf16", 0, 128), ("int4", "fp8", 0, 128), ("int4", "int8", 0, 128),  # g128: int4 "halves" packing
    ("int4", "bf16", 1, 128), ("int4", "bf16", 3, 128), ("int4", "fp8", 2, 128)])  # swap 2/3: + split-K 2
def test_grouped_gemm_vs_per_expert_loop(wfmt, act, swap, group):
    g = torch.Generator().manual_seed(11)
    M, k, E, N, K = 6, 2, 4, 48, 256
    x = torch.randn(M, K, generator=g)
    W = quantize_experts(torch.randn(E, N, K, generator=g) * 0.1, wfmt, group=group)
    assert W.w4 is None or W.w4.layout == ("halves" if group == 128 else "pairs")
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(torch.int32)
    topk_w = torch.rand(M, k, generator=g)
    a, a_deq = _act(x, act)
    T = M * k
    # swap & 1: C^T = W @ A^T (8-bit MMA, or halves int4 x bf16); swap & 2: split-K over 2 (fp32 atomics)
    cfg = dataclasses.replace(moe_config(T, E, act), SWAP_AB=swap & 1, SPLIT_K=1 + (swap >> 1))
    out = torch.full((T, N), float("nan"))  # poisoned: every slot must be written
    grouped_gemm(a, W, moe_align(ids, E, cfg.BM), T, k, out, cfg, topk_weights=topk_w.reshape(-1))
    Wd = W.dequantize()
    if wfmt == "int4" and act == "bf16" and not swap & 1:
        Wd = Wd.to(torch.bfloat16).float()  # W4A16 dequantizes the weight tile to bf16 in registers (swapped: exact)
    ref = torch.stack([a_deq[t // k] @ Wd[ids.flatten()[t]].t() * topk_w.flatten()[t] for t in range(T)])
    assert _rel(out, ref) < (2e-3 if (wfmt, act, swap & 1) == ("int4", "bf16", 0) else 1e-5)


@pytest.mark.parametrize("group,cfg", [(128, MvConfig()), (128, MvConfig(BN=32, SPLIT_K=2)),
                                       (64, MvConfig(BM=32, BN=16, SWAP=1, KB=2)), (128, MvConfig(SPLIT_K=2, SWAP=1)),
                                       (128, TcConfig(BM=16, BN=32)), (64, TcConfig(BM=16, BN=32, SWAP=1)),
                                       (256, TcConfig(BM=32, BN=64))])
def test_planar_grouped_gemm_vs_float64_loop(group, cfg):
    """planar int4 grouped GEMM (moe_mv, moe_tc) vs a per-slot float64 loop on the dequantized expert weights."""
    g = torch.Generator().manual_seed(3)
    M, k, E, N, K = 5, 2, 4, 48, 256
    q = torch.randint(-8, 8, (E, N, K), generator=g)
    sc = torch.rand(E, N, K // group, generator=g) * 0.1 + 0.01
    w = planar_from_codes(q, sc, group)
    Wd = q.double() * sc.double().repeat_interleave(group, -1)
    assert torch.allclose(w.dequantize().double(), Wd, atol=1e-6)  # the layout round trip
    tol = 1e-6
    if isinstance(cfg, TcConfig):  # moe_tc rounds each scaled weight to bf16 (moe_mv: exact codes, fp32 scaling)
        Wd = Wd.to(torch.bfloat16).double()
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(torch.int32)
    tw = torch.rand(M, k, generator=g)
    T = M * k
    ref = torch.stack([x[t // k].double() @ Wd[ids.flatten()[t]].t() * tw.flatten()[t] for t in range(T)])
    run = grouped_gemm_planar if isinstance(cfg, MvConfig) else grouped_gemm_planar_tc
    out = torch.full((T, N), float("nan"))  # poisoned: every slot must be written
    run(x, w, moe_align(ids, E, cfg.BM), T, k, out, cfg, topk_weights=tw.reshape(-1))
    assert _rel(out, ref) < tol
    red = torch.full((M, N), float("nan"))  # reduce_k: each token's k slots summed by the kernel (zeroes it first)
    run(x, w, moe_align(ids, E, cfg.BM), T, k, red, cfg, topk_weights=tw.reshape(-1), reduce_k=k)
    assert _rel(red, ref.view(M, k, N).sum(1)) < tol


# per-activation-format tolerance of the whole layer vs the loop: the loop computes the intermediate in another
# order, and an fp4 / int8 re-quantization of it can flip a few roundings (a 4-bit flip moves a value by up to 1/3)
LAYER_TOL = {"bf16": 5e-3, "fp8": 1e-2, "int8": 3e-2, "mxfp4": 6e-2, "nvfp4": 8e-2}


@pytest.mark.parametrize("wfmt,act", PAIRS)
def test_fused_moe_layer_vs_reference_loop(wfmt, act):
    torch.manual_seed(5)
    M, H, I, E, k = 6, 64, 32, 4, 2
    router, w13, w2 = torch.randn(E, H), torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1
    moe = FusedMoE.from_float(router, w13, w2, k, wfmt, act, group=32)
    x = torch.randn(M, H).to(torch.bfloat16)
    tw, ti = moe.route(x)
    y = moe(x)
    assert y.shape == (M, H) and y.dtype == torch.bfloat16
    assert torch.equal(moe(x, (tw, ti), align=moe.plan(ti)), y)  # precomputed sort/align: same result
    ref = ref_moe(x, tw, ti, moe.w13.dequantize(), moe.w2.dequantize(), act)
    assert _rel(y, ref) < LAYER_TOL[act]
    moe.fused_reduce = False  # down GEMM writes [T, H] slots and they are summed after (vs atomics into token rows)
    assert _rel(moe(x), ref) < LAYER_TOL[act]
    if (wfmt, act) == ("bf16", "bf16"):  # and the unquantized layer itself
        assert _rel(y, ref_moe(x, tw, ti, w13, w2, "bf16")) < 1e-2


def test_moe_bad_inputs():
    router, w13, w2 = torch.randn(4, 64), torch.randn(4, 64, 64), torch.randn(4, 64, 32)
    with pytest.raises(ValueError):
        FusedMoE.from_float(router, w13, w2, 2, "fp8", "bf16")  # fp8 weights need fp8 activations here
    with pytest.raises(ValueError):
        FusedMoE.from_float(router, w13, w2, 2, "int5")
    moe = FusedMoE.from_float(router, w13, w2, 2)
    with pytest.raises(ValueError):
        moe(torch.randn(3, 32))
    assert moe(torch.randn(0, 64)).shape == (0, 64)  # an empty batch is fine


@pytest.mark.parametrize("M", [5, 130])
def test_fused_moe_planar_int4_vs_reference_loop(M):
    """the layer with planar int4 experts vs the per-expert loop: M = 5 runs the moe_mv kernel for both projections,
    M = 130 (65 slots per expert: 64-row blocks) the moe_tcg one (here on the CPU: its moe_tc fallback)."""
    torch.manual_seed(6)
    H, I, E, k = 128, 128, 4, 2
    router, w13, w2 = torch.randn(E, H), torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1
    moe = FusedMoE.from_float(router, w13, w2, k, "int4", "bf16", group=64)  # planar by default here
    assert moe.w13.planar is not None and moe.w2.planar is not None
    x = torch.randn(M, H).to(torch.bfloat16)
    from kestrel.kernels.moe_gemm import TcgConfig  # the Gluon kernel's config (the tc kernel runs it here)
    want = MvConfig if M == 5 else (TcgConfig, TcConfig)
    assert all(isinstance(c, want) for c in moe_configs(M, k, E, "bf16", moe.w13, moe.w2))
    tw, ti = moe.route(x)
    y = moe(x)
    ref = ref_moe(x, tw, ti, moe.w13.dequantize(), moe.w2.dequantize(), "bf16")
    assert _rel(y, ref) < LAYER_TOL["bf16"]
    moe.fused_reduce = False  # down GEMM writes [T, H] slots, summed after: the same result up to fp32 order
    assert _rel(moe(x), y) < 5e-3 and _rel(moe(x), ref) < LAYER_TOL["bf16"]
    # same quantized values as the halves/pairs int4 layer
    halves = FusedMoE.from_float(router, w13, w2, k, "int4", group=64, planar=False)
    assert halves.w13.planar is None and torch.equal(moe.w13.dequantize(), halves.w13.dequantize())


def test_tcg_config_falls_back_to_tc_off_hopper():
    """a TcgConfig (Gluon kernel, Hopper only) runs the Triton tc kernel where Gluon cannot (here: the CPU
    interpreter), with the same result; `supports` refuses CPU tensors and groups other than 128."""
    from kestrel.kernels import moe_gemm
    if moe_gemm.moe_tcg is None:
        pytest.skip("no Gluon in this Triton")
    from kestrel.kernels.moe_tcg import TcgConfig, supports
    g = torch.Generator().manual_seed(4)
    M, k, E, N, K = 6, 2, 4, 64, 256
    q = torch.randint(-8, 8, (E, N, K), generator=g)
    sc = torch.rand(E, N, K // 128, generator=g) * 0.1 + 0.01
    W = moe_gemm.ExpertWeights("int4", planar=planar_from_codes(q, sc, 128))
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(torch.int32)
    T = M * k
    cfg = TcgConfig(BM=16, BN=32)
    assert not supports(x, W.planar, cfg)
    assert not supports(x, planar_from_codes(q, sc.repeat_interleave(2, -1), 64), cfg)
    Wd = (q.double() * sc.double().repeat_interleave(128, -1)).to(torch.bfloat16).double()
    ref = torch.stack([x[t // k].double() @ Wd[ids.flatten()[t]].t() for t in range(T)])
    al = moe_align(ids, E, cfg.BM)
    out = torch.full((T, N), float("nan"))
    moe_gemm.grouped_gemm(moe_gemm.quant_act(x, "bf16"), W, al, T, k, out, cfg)
    assert _rel(out, ref) < 1e-6
    tc = torch.full((T, N), float("nan"))
    moe_gemm.grouped_gemm(moe_gemm.quant_act(x, "bf16"), W, al, T, k, tc, moe_gemm._tc_fallback(cfg))
    assert torch.equal(out, tc)


def test_tcg_bm128_blocks_for_many_slots_per_expert(monkeypatch):
    """KESTREL_MOE_TCG_BM=128 (moe_gemm.TCG_BM): above 192 slots per expert (Mixtral at M = 1024) both projections
    get 128-row blocks and a BN 128 tcgp config, below it the 64-row default; the layer stays right (CPU: the tc
    fallback runs the config)."""
    from kestrel.kernels import moe_gemm
    if moe_gemm.moe_tcg is None:
        pytest.skip("no Gluon in this Triton")
    monkeypatch.setattr(moe_gemm, "USE_TCG", "3")
    monkeypatch.setattr(moe_gemm, "TCG_BM", "128")
    torch.manual_seed(7)
    H, I, E, k = 128, 128, 2, 1
    router, w13, w2 = torch.randn(E, H), torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1
    moe = FusedMoE.from_float(router, w13, w2, k, "int4", "bf16", group=128)
    assert moe.w13.planar is not None
    assert [c.BM for c in moe_configs(200, k, E, "bf16", moe.w13, moe.w2)] == [64, 64]  # 100 per expert
    cfgs = moe_configs(400, k, E, "bf16", moe.w13, moe.w2)
    assert all(isinstance(c, moe_gemm.TcgConfig) and (c.BM, c.BN, c.SWAP, c.num_stages) == (128, 128, 2, 4)
               for c in cfgs)
    x = torch.randn(400, H).to(torch.bfloat16)
    tw, ti = moe.route(x)
    ref = ref_moe(x, tw, ti, moe.w13.dequantize(), moe.w2.dequantize(), "bf16")
    assert _rel(moe(x, (tw, ti)), ref) < LAYER_TOL["bf16"]


def test_tcg_default_warp_specialised_for_64_row_blocks_only(monkeypatch):
    """KESTREL_MOE_TCG=5 (the default): the warp-specialised tcgp loop for expert blocks of up to 64 rows (Qwen3-
    like routing), the plain tcgp loop for 128-row blocks (where WS measured slower on the H200); the layer stays
    right (CPU: the tc fallback runs the config)."""
    from kestrel.kernels import moe_gemm
    if moe_gemm.moe_tcg is None:
        pytest.skip("no Gluon in this Triton")
    monkeypatch.setattr(moe_gemm, "USE_TCG", "5")
    monkeypatch.setattr(moe_gemm, "TCG_BM", "128")
    torch.manual_seed(8)
    H, I, E, k = 128, 128, 2, 1
    router, w13, w2 = torch.randn(E, H), torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1
    moe = FusedMoE.from_float(router, w13, w2, k, "int4", "bf16", group=128)
    small = moe_configs(200, k, E, "bf16", moe.w13, moe.w2)  # 100 slots per expert: 64-row blocks
    assert all((c.BM, c.BN, c.SWAP, c.WS, c.PERSIST) == (64, 256, 2, moe_gemm.TCG_WS, 0) for c in small)
    big = moe_configs(400, k, E, "bf16", moe.w13, moe.w2)  # 200 per expert: 128-row blocks
    assert all((c.BM, c.SWAP, c.WS) == (128, 2, 0) for c in big)
    x = torch.randn(200, H).to(torch.bfloat16)
    tw, ti = moe.route(x)
    ref = ref_moe(x, tw, ti, moe.w13.dequantize(), moe.w2.dequantize(), "bf16")
    assert _rel(moe(x, (tw, ti)), ref) < LAYER_TOL["bf16"]


def test_tcg_80_row_blocks_config_and_fallback(monkeypatch):
    """KESTREL_MOE_TCG_BM=80 (Hopper + KESTREL_MOE_TCG=5 only: `_tcg_bm` gives 0 elsewhere, as on this CPU): up to 192
    slots per expert the layer gets 80-row blocks and the warp-specialised BN 256 loop; where Gluon cannot run, the
    80-row align is run as 16-row blocks by the Triton tc kernel (expert ids repeated), with the reference's result."""
    from kestrel.kernels import moe_gemm
    if moe_gemm.moe_tcg is None:
        pytest.skip("no Gluon in this Triton")
    monkeypatch.setattr(moe_gemm, "USE_TCG", "5")
    monkeypatch.setattr(moe_gemm, "TCG_BM", "80")
    assert moe_gemm._tcg_bm() == 0 or torch.cuda.is_available()
    monkeypatch.setattr(moe_gemm, "_tcg_bm", lambda: 80)
    torch.manual_seed(9)
    H, I, E, k = 128, 128, 2, 1
    router, w13, w2 = torch.randn(E, H), torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1
    moe = FusedMoE.from_float(router, w13, w2, k, "int4", "bf16", group=128)
    cfgs = moe_configs(200, k, E, "bf16", moe.w13, moe.w2)  # 100 slots per expert
    assert all((c.BM, c.BN, c.SWAP, c.WS) == (80, 256, 2, moe_gemm.TCG_WS) for c in cfgs)
    x = torch.randn(200, H).to(torch.bfloat16)
    tw, ti = moe.route(x)
    ref = ref_moe(x, tw, ti, moe.w13.dequantize(), moe.w2.dequantize(), "bf16")
    assert _rel(moe(x, (tw, ti)), ref) < LAYER_TOL["bf16"]


def test_ws_block_rows_auto(monkeypatch):
    """KESTREL_MOE_TCG_BM=auto (default): with the WS loop on Hopper the block rows minimising expected blocks x the
    measured per-block cost, if 8 % below 64 rows' — 80 at Qwen3-30B-A3B M = 1024 (64 slots per expert), 96 at
    Mixtral M = 1024 (256), 64 where two 64-row blocks hold an expert (96) and at DeepSeek-V3 M = 4096 (128); off
    Hopper (this CPU) the session-8 rule: 128 above 192."""
    from kestrel.kernels import moe_gemm
    if moe_gemm.moe_tcg is None:
        pytest.skip("no Gluon in this Triton")
    assert [moe_gemm.ws_block_rows(p) for p in (40, 64, 96, 128, 256)] == [64, 80, 64, 64, 96]
    monkeypatch.setattr(moe_gemm, "USE_TCG", "5")
    monkeypatch.setattr(moe_gemm, "TCG_BM", "auto")
    if not torch.cuda.is_available():
        assert moe_gemm._tcg_bm() == 128
        assert moe_config(8 * 1024, 128, "bf16", planar=True).BM == 64
        assert moe_config(2 * 1024, 8, "bf16", planar=True).BM == 128
    monkeypatch.setattr(moe_gemm, "_ws_hopper", lambda: True)
    assert moe_config(8 * 1024, 128, "bf16", planar=True).BM == 80
    assert moe_config(2 * 1024, 8, "bf16", planar=True).BM == 96
    assert moe_config(8 * 1024, 128, "bf16", planar=False).BM == 64  # (the lowbit kernels: power-of-two tiles)


def test_tcg_loop2_flag_reaches_the_gluon_configs(monkeypatch):
    """KESTREL_MOE_TCG_LOOP=2 (moe_gemm.TCG_LOOP): the race-free K loop for the tcgp / WS / persistent configs the
    heuristic makes, but only where moe_tcg.supports has that loop (the persistent one needs BN 256) - never a silent
    fall-back to the Triton kernel; 0 (KESTREL_MOE_TCG_LOOP=0, the pre-session-15 default) leaves every config at
    LOOP 0."""
    from kestrel.kernels import moe_gemm
    if moe_gemm.moe_tcg is None:
        pytest.skip("no Gluon in this Triton")
    torch.manual_seed(10)
    H, I, E, k = 128, 128, 2, 1
    router, w13, w2 = torch.randn(E, H), torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1
    moe = FusedMoE.from_float(router, w13, w2, k, "int4", "bf16", group=128)
    monkeypatch.setattr(moe_gemm, "TCG_LOOP", 0)
    assert all(c.LOOP == 0 for c in moe_configs(200, k, E, "bf16", moe.w13, moe.w2))
    monkeypatch.setattr(moe_gemm, "TCG_LOOP", 2)
    for mode, bm, slots, want in (("5", "", 200, 2), ("3", "", 200, 2), ("3", "128", 400, 2), ("4", "", 200, 2),
                                  ("4", "128", 400, 0), ("2", "", 200, 0)):
        monkeypatch.setattr(moe_gemm, "USE_TCG", mode)
        monkeypatch.setattr(moe_gemm, "TCG_BM", bm)
        cfgs = moe_configs(slots, k, E, "bf16", moe.w13, moe.w2)
        assert all(c.LOOP == want for c in cfgs), (mode, bm, cfgs)
        assert all(moe_gemm.moe_tcg.loop_ok(c) for c in cfgs), cfgs  # (the Gluon kernel's gate, in supports)
    assert not moe_gemm.moe_tcg.loop_ok(dataclasses.replace(cfgs[0], LOOP=2))  # SWAP 1 has no LOOP 2
    assert not moe_gemm.moe_tcg.loop_ok(moe_gemm.TcgConfig(BM=128, BN=128, SWAP=2, PERSIST=1, LOOP=2))
    assert not moe_gemm.moe_tcg.loop_ok(moe_gemm.TcgConfig(BM=64, BN=256, SWAP=2, LOOP=1))
